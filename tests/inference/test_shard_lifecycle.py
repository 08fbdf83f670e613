"""A shard's life as a state machine (fleet/shard.py): every transition the table allows is
taken, every other one is refused by name; the router sees only the projection, pushed by the
fleet when it changes; the fleet's acts walk the machine (no processes: mock shard HTTP)."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from rlix.errors import EngineStateError
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.shard import ROUTING, TRANSITIONS, Life, Shard
from rlix.inference.router.router import Router
from rlix.inference.router.shard_table import ShardState


def _at(state: Life) -> Shard:
    shard = Shard(0, "http://s0", state)
    assert list(shard.history) == [state]
    return shard


@pytest.mark.parametrize("src,dst", list(itertools.product(Life, Life)))
def test_each_transition_is_taken_or_refused_as_the_table_says(src: Life, dst: Life) -> None:
    shard = _at(src)
    if dst is src or dst in TRANSITIONS[src]:
        shard.enter(dst)
        assert shard.state is dst
    else:
        with pytest.raises(EngineStateError, match=f"shard 0: {src.value} -> {dst.value} is not a transition"):
            shard.enter(dst)
        assert shard.state is src and list(shard.history) == [src]  # nothing changed


def test_the_machine_has_the_states_a_shard_goes_through() -> None:
    # from any live state a death is possible; nothing leaves DOWN; routing only when ACTIVE
    assert all(Life.DOWN in TRANSITIONS[s] for s in Life if s is not Life.DOWN)
    assert TRANSITIONS[Life.DOWN] == frozenset()
    assert [s for s in Life if ROUTING[s] is ShardState.ACTIVE] == [Life.ACTIVE]
    # an asleep shard is never routed to straight away: it wakes (or is synced awake) first
    assert Life.ACTIVE not in TRANSITIONS[Life.ASLEEP] and Life.ACTIVE not in TRANSITIONS[Life.WAKING]
    shard = _at(Life.ASLEEP)
    assert (shard.asleep, shard.awake, shard.active) == (True, False, False)
    shard.enter(Life.UNKNOWN)
    assert shard.asleep is None and not shard.awake


class _Router(Router):
    """A router that records what the fleet tells it."""

    def __init__(self) -> None:
        super().__init__("k")
        self.told: list[tuple[int, str | None]] = []

    async def set_shard(self, rank, url=None, state=None):  # type: ignore[no-untyped-def]
        self.told.append((rank, state))
        return await super().set_shard(rank, url, state)


class _Launcher:
    def __init__(self) -> None:
        self.running: dict[int, int] = {}

    async def start(self, rank: int, gpus=()) -> str:  # type: ignore[no-untyped-def]
        self.running[rank] = 1000 + rank
        return f"http://shard{rank}"

    async def stop(self, rank: int) -> None:
        self.running.pop(rank, None)

    def pids(self) -> dict[int, int]:
        return dict(self.running)

    async def dead_ranks(self) -> list[int]:
        return []


def _fleet(fail: set[str] = frozenset()) -> tuple[ShardFleet, _Router]:
    router = _Router()
    client = RemoteInferenceClient(None, {}, "k")

    async def request(method, base, target, body, headers):  # type: ignore[no-untyped-def]
        path = target.split("?")[0]
        if path in fail:
            return 500, b'{"error": {"message": "boom", "type": "EngineStateError"}}'
        if path == "/wake_up":
            return 200, b'{"status": "awake"}'
        return 200, b'{"status": "ok"}'

    client._request = request
    return ShardFleet(_Launcher(), router, client, poll_s=0, drain_before_sleep=False), router


def test_the_fleets_acts_walk_the_machine_and_the_router_sees_the_projection() -> None:
    async def main() -> tuple[Shard, list]:
        fleet, router = _fleet()
        await fleet.start([0], active=False)
        await fleet.activate([0])
        await fleet.sleep_partial([0])
        await fleet.sleep_partial([0])  # asleep already: no second sleep, no router call
        await fleet.wake_up_partial([0])
        await fleet.activate([0])
        await fleet.deactivate([0])
        with pytest.raises(EngineStateError, match="asleep -> active"):
            await fleet.sleep_partial([0])
            await fleet.activate([0])  # an asleep shard cannot be routed to
        return fleet.shards[0], router.told

    shard, told = asyncio.run(main())
    assert list(shard.history) == [Life.INACTIVE, Life.ACTIVE, Life.PREEMPTING, Life.ASLEEP, Life.PREEMPTING,
                             Life.ASLEEP, Life.WAKING, Life.INACTIVE, Life.ACTIVE, Life.INACTIVE,
                             Life.PREEMPTING, Life.ASLEEP]
    # told once per change of what may be routed; the wake alone tells it nothing
    assert told == [(0, "inactive"), (0, "active"), (0, "preempted"), (0, "active"), (0, "inactive"),
                    (0, "preempted")]


def test_a_failed_wake_or_sleep_leaves_the_state_unknown_and_the_next_call_asks() -> None:
    async def main() -> list[Life]:
        fleet, _ = _fleet(fail={"/wake_up"})
        await fleet.start([0], active=True)
        await fleet.sleep_partial([0])
        with pytest.raises(Exception, match="boom"):
            await fleet.wake_up_partial([0])
        assert fleet.asleep_ranks([0]) == [0]  # not known awake: a sync wakes it first
        fleet.note_woken([0])  # a sync call woke it
        assert fleet.asleep_ranks([0]) == []
        await fleet.activate([0])
        return list(fleet.shards[0].history)

    assert asyncio.run(main())[-4:] == [Life.WAKING, Life.UNKNOWN, Life.INACTIVE, Life.ACTIVE]


def test_the_history_keeps_the_latest_states_only() -> None:
    from rlix.inference.fleet.shard import HISTORY
    shard = _at(Life.INACTIVE)
    for _ in range(HISTORY):
        shard.enter(Life.ACTIVE)
        shard.enter(Life.INACTIVE)
    assert len(shard.history) == HISTORY and shard.history[-1] is Life.INACTIVE
