"""ShardCoordinator.reassert, what a restarted scheduler calls: the awake shards become what its
ledger says, once the old scheduler's calls still running here are done; repeating it changes
nothing. And a resize whose ranks wait on different starts. A fake fleet records what the
coordinator asks of it (no processes)."""

from __future__ import annotations

import asyncio

from rlix.inference.fleet.fleet import Placed
from rlix.inference.fleet.shard import Life, Shard
from rlix.pipeline.coordinator import ShardCoordinator


class FakeFleet:
    """What the coordinator uses of a ShardFleet; `place_gate` holds process starts."""

    supports_sleep = True
    sleep_level = 1
    release_timeout_s = None
    holder = "pipeline-x"

    def __init__(self) -> None:
        self.shards: dict[int, Shard] = {}
        self.calls: list[tuple] = []
        self.place_gate = asyncio.Event()
        self.place_gate.set()
        self.starting: set[tuple[int, ...]] = set()  # GPUs whose engine starts in the background
        self.start_gate = asyncio.Event()  # that start's end

    def starting_on(self, gpus):
        return tuple(gpus) in self.starting

    async def start(self, ranks, active=False):
        for r in ranks:
            self.shards[r] = Shard(r, f"http://shard-{r}", Life.ACTIVE if active else Life.INACTIVE)

    async def place(self, gpus_of):
        self.calls.append(("place", {int(r): tuple(g) for r, g in gpus_of.items()}))
        await self.place_gate.wait()
        if any(tuple(g) in self.starting for g in gpus_of.values()):
            await self.start_gate.wait()
        new = [r for r in gpus_of if r not in self.shards]
        for r, gpus in gpus_of.items():
            info = self.shards.setdefault(r, Shard(r, f"http://shard-{r}"))
            info.gpus = tuple(gpus)
        return Placed(started=sorted(new), resident=[])

    async def sleep_partial(self, ranks, level=None):
        self.calls.append(("sleep", sorted(ranks)))
        for r in ranks:
            self.shards[r].enter(Life.PREEMPTING)
            self.shards[r].enter(Life.ASLEEP)
        return {r: {} for r in ranks}

    async def wake_up_partial(self, ranks, tags=None):
        self.calls.append(("wake", sorted(ranks)))
        for r in ranks:
            if not self.shards[r].awake:
                self.shards[r].enter(Life.WAKING)
                self.shards[r].enter(Life.INACTIVE)

    async def activate(self, ranks):
        for r in ranks:
            self.shards[r].enter(Life.ACTIVE)

    async def dead_ranks(self):
        return []

    def active_ranks(self):
        return sorted(r for r, s in self.shards.items() if s.active)

    def asleep_ranks(self, ranks):
        return [r for r in ranks if not self.shards[r].awake]

    def note_woken(self, ranks, woken=True):
        for r in ranks:
            if not (woken and self.shards[r].awake):
                self.shards[r].enter(Life.INACTIVE if woken else Life.UNKNOWN)


class NoRefit:
    """Every shard serves the latest version already: a refit is a test failure."""

    async def refit(self, version, targets, wake=()):  # noqa: ANN001, ANN201
        raise AssertionError("no refit expected")


def test_reassert_sleeps_and_wakes_only_the_difference_and_repeats_change_nothing():
    async def main() -> None:
        fleet = FakeFleet()
        coord = ShardCoordinator(fleet, NoRefit())  # type: ignore[arg-type]
        await coord.start([0, 1, 2], version=0)
        await fleet.sleep_partial([0, 1, 2])
        await coord.resize_inference([], {0: [0]})
        fleet.calls.clear()

        assert await coord.reassert({0: [0]}) == {"unchanged": [0]}
        assert fleet.calls == [] and fleet.active_ranks() == [0]
        await coord.reassert({1: [1]}, wake=False)  # first round: only the sleeps
        assert fleet.calls == [("sleep", [0])] and fleet.active_ranks() == []
        await coord.reassert({1: [1]})
        assert fleet.calls[1:] == [("wake", [1])] and fleet.active_ranks() == [1]
        assert coord.assigned == {1: (1,)}
        n = len(fleet.calls)
        assert await coord.reassert({1: [1]}) == {"unchanged": [1]} and len(fleet.calls) == n
        await coord.reassert({})
        assert fleet.calls[n:] == [("sleep", [1])] and fleet.active_ranks() == [] and coord.assigned == {}

    asyncio.run(asyncio.wait_for(main(), 10))


def test_reassert_waits_for_the_old_schedulers_call_still_running_here():
    """The old scheduler's expand of rank 2 is still starting its process (outside the lock)
    when the restarted one says rank 2 is not awake: it ends asleep, not awake."""
    async def main() -> None:
        fleet = FakeFleet()
        coord = ShardCoordinator(fleet, NoRefit(), placed=True)  # type: ignore[arg-type]
        fleet.place_gate.clear()
        old_call = asyncio.ensure_future(coord.resize_inference([], {2: [2]}))
        while not fleet.calls:
            await asyncio.sleep(0.001)
        reassert = asyncio.ensure_future(coord.reassert({}, wake=False))
        await asyncio.sleep(0.05)
        assert not reassert.done()
        fleet.place_gate.set()
        await asyncio.wait_for(old_call, 2)
        out = await asyncio.wait_for(reassert, 2)
        assert out["reasserted"] == {"remove": [2], "add": []}
        assert fleet.active_ranks() == [] and fleet.shards[2].asleep is True and coord.assigned == {}

    asyncio.run(asyncio.wait_for(main(), 10))


def test_ranks_whose_engine_is_up_are_routed_to_before_those_waiting_for_a_background_start():
    """One resize gives rank 0 GPU 0 (its engine is up) and rank 1 GPU 1 (its engine still
    starting in the background): rank 0 generates at once, rank 1 when its start ends; the
    call answers with both woken."""
    async def main() -> None:
        fleet = FakeFleet()
        coord = ShardCoordinator(fleet, NoRefit(), placed=True)  # type: ignore[arg-type]
        fleet.starting = {(1,)}
        call = asyncio.ensure_future(coord.resize_inference([], {0: [0], 1: [1]}))
        for _ in range(200):
            if fleet.active_ranks():
                break
            await asyncio.sleep(0.01)
        assert fleet.active_ranks() == [0] and not call.done()
        fleet.starting.clear()
        fleet.start_gate.set()
        out = await asyncio.wait_for(call, 2)
        assert fleet.active_ranks() == [0, 1] and out["woke"] == [0, 1]
        assert coord.assigned == {0: (0,), 1: (1,)}

    asyncio.run(asyncio.wait_for(main(), 10))
