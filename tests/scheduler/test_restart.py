"""The scheduler survives its own restart: the event loop without Ray (a "crash" is a scheduler
whose state stops being saved and that is dropped; a new one restores it), then the Ray actor
on a local cluster, its worker SIGKILLed by PID."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported anywhere

import pytest
import ray

from rlix.errors import SchedulerError, UnknownPipelineError
from rlix.scheduler.persistence import MemoryStore, SchedulerPersistence
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.async_scheduler import AsyncScheduler
from rlix.scheduler.service import (
    ACTOR_NAME,
    NAMESPACE,
    STATE_PREFIX,
    start_scheduler,
    topology_from_ray,
)
from rlix.scheduler.types import PipelineSpec, Progress, Stage, Topology

from sched_kit import run, until

PARAMS = PlannerParams(dwell_s=0.0, aging_s=60.0)
PREFIX = "test:sched:"


# ---------------------------------------------------------------------- without Ray
class Gated:
    """An in-process coordinator (resize and re-assert) whose calls block while `gate` is clear."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[tuple] = []
        self.done: list[tuple] = []

    async def __call__(self, remove, add):
        self.calls.append(("resize", list(remove), dict(add)))
        await self.gate.wait()
        self.done.append(self.calls[-1])

    async def reassert(self, shards, wake):
        call = ("reassert", dict(shards), wake)
        self.calls.append(call)
        await self.gate.wait()
        self.done.append(call)


def same_changes(got: list[dict], want: list[dict]) -> bool:
    """The same role changes; their times moved onto another clock agree to within 1 ms (on one
    host the clocks are the same, up to the float noise of the offsets)."""
    return [dict(c, at=0) for c in got] == [dict(c, at=0) for c in want] and \
        all(abs(x["at"] - y["at"]) < 1e-3 for x, y in zip(got, want))


def scheduler(store: MemoryStore) -> AsyncScheduler:
    return AsyncScheduler(Topology((2,)), PARAMS, persistence=SchedulerPersistence(store, PREFIX))


def crash(s: AsyncScheduler) -> None:
    """What a SIGKILL leaves: the state saved so far; nothing the dying loop does afterwards."""
    s.persistence = None


def restarted(store: MemoryStore, coordinators: dict[str, Gated]) -> AsyncScheduler:
    s = scheduler(store)
    assert s.restore()
    for name in s.core.pipelines:
        s.attach(name, coordinators[name])
    return s


def test_retried_requests_attach_to_the_restored_ones_after_the_shards_are_reasserted():
    store = MemoryStore()
    before: dict = {}

    async def first_life() -> None:
        s = scheduler(store)
        a, b = Gated(), Gated()
        s.register(PipelineSpec("a", priority=1, train_gpus=1, max_shards=1), a)
        s.register(PipelineSpec("b", train_gpus=2, max_shards=2), b)
        await s.settle()
        a.gate.clear()  # a's shard never finishes sleeping in this life
        b.gate.clear()
        asyncio.ensure_future(s.request("a", "train", 1))
        await until(lambda: s.core.ledger.stage_holding("a", Stage.TRAIN) is not None)
        asyncio.ensure_future(s.request("b", "train", 2))  # a trains on one of the two: waits
        await until(lambda: len(s.core.pending) == 1)
        before.update(held=s.core.ledger.stage_holding("a", Stage.TRAIN),
                      pending=dict(s.core.pending), roles=s.core.role_changes(),
                      shards={n: s.core.shard_gpus(n) for n in ("a", "b")})
        crash(s)

    async def second_life() -> None:
        a, b = Gated(), Gated()
        s = restarted(store, {"a": a, "b": b})
        assert s.restarts == 1 and [dataclasses.replace(r, submitted_at=0) for r in s.core.pending.values()] \
            == [dataclasses.replace(r, submitted_at=0) for r in before["pending"].values()]
        assert same_changes(s.core.role_changes(), before["roles"])
        a.gate.clear()  # a's re-assertion is slow
        s.reconcile({"a": a.reassert, "b": b.reassert})
        await until(lambda: a.calls)

        # Ray re-sends both requests: neither is refused as a second pending request
        granted = asyncio.ensure_future(s.request("a", "train", 1))
        waiting = asyncio.ensure_future(s.request("b", "train", 2))
        await asyncio.sleep(0.05)
        assert not granted.done(), "handed over before a's shards were re-asserted"
        assert not waiting.done() and list(s.core.pending) == list(before["pending"])
        a.gate.set()
        assert await asyncio.wait_for(granted, 2) == list(before["held"].gpus)
        # first everything the ledger does not have awake sleeps, then what it has wakes
        shards = {n: {r: list(g) for r, g in before["shards"][n].items()} for n in ("a", "b")}
        assert shards["a"] and not shards["b"]
        assert a.done == [("reassert", shards["a"], False), ("reassert", shards["a"], True)]
        assert b.done == [("reassert", {}, False)]
        assert s.core.ledger.stage_holding("a", Stage.TRAIN).request_id == before["held"].request_id
        s.release("a", Stage.TRAIN, Progress("a", remaining=0, target=8))  # a's shard may go
        assert len(await asyncio.wait_for(waiting, 2)) == 2  # the restored request, granted
        assert not s.core.pending
        seqs = [c["seq"] for c in s.core.role_changes()]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > len(before["roles"])
        s.core.ledger.check_invariants()
        await s.close()

    run(first_life())
    run(second_life())


def test_a_retried_release_or_unregister_gets_the_first_answer_a_new_one_an_error():
    store = MemoryStore()
    answers: dict = {}

    async def first_life() -> None:
        s = scheduler(store)
        s.register(PipelineSpec("a", train_gpus=1, max_shards=1), Gated())
        s.register(PipelineSpec("b", max_shards=1), Gated())
        await s.settle()
        await s.request("a", "train", 1)
        answers["release"] = s.release("a", "train")  # the answer lost with the old instance
        await s.settle()
        answers["unregister"] = s.unregister("b")
        crash(s)

    async def second_life() -> None:
        a = Gated()
        s = restarted(store, {"a": a})
        departed = Gated()
        s.reconcile({"a": a.reassert}, {"b": departed.reassert})
        await s.settle()
        assert departed.calls == [("reassert", {}, False)]  # the leaver keeps nothing awake
        assert s.release("a", "train") == answers["release"]
        with pytest.raises(SchedulerError, match="holds no GPUs"):
            s.release("a", "train")  # not a retry: the same error as ever
        assert s.unregister("b") == answers["unregister"]
        with pytest.raises(UnknownPipelineError):
            s.unregister("b")
        gpus = await s.request("a", "train", 1)  # and the pipeline goes on
        assert len(gpus) == 1
        await s.close()

    run(first_life())
    run(second_life())


def test_a_restored_pipeline_without_a_coordinator_is_failed_and_its_gpus_freed():
    store = MemoryStore()

    async def first_life() -> None:
        s = scheduler(store)
        s.register(PipelineSpec("a", max_shards=2), Gated())
        await s.settle()
        crash(s)

    async def second_life() -> None:
        s = scheduler(store)
        assert s.restore()
        s.reconcile({})
        assert "a" not in s.core.pipelines and s.core.ledger.idle_gpus() == [0, 1]
        assert "not restored" in s.snapshot()["failures"][-1]["reason"]
        await s.close()

    run(first_life())
    run(second_life())


# ---------------------------------------------------------------------- with Ray
@ray.remote(num_cpus=0)
class FakeCoordinator:
    """Applies resize and re-assert calls to the shards it holds awake (rank -> GPUs)."""

    def __init__(self) -> None:
        self.awake: dict[int, list[int]] = {}
        self.calls: list[dict] = []

    async def resize_inference(self, remove, add):
        self.calls.append({"kind": "resize", "remove": list(remove),
                           "add": {int(k): list(v) for k, v in add.items()}, "at": time.time()})
        for r in remove:
            self.awake.pop(int(r), None)
        self.awake.update({int(k): list(v) for k, v in add.items()})

    async def reassert_shards(self, shards, wake):
        want = {int(k): list(v) for k, v in shards.items()}
        self.calls.append({"kind": "reassert", "shards": want, "wake": wake, "at": time.time()})
        self.awake = {r: g for r, g in self.awake.items() if want.get(r) == g}
        if wake:
            self.awake.update(want)

    async def state(self) -> dict:
        return {"awake": self.awake, "calls": self.calls}


def poll(fn, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def kv_keys() -> list[str]:
    from ray.experimental import internal_kv

    return [k.decode() for k in internal_kv._internal_kv_list(STATE_PREFIX, namespace=NAMESPACE)]


def awake_gpus(coords: dict) -> dict[str, set[int]]:
    return {n: {g for gs in ray.get(c.state.remote())["awake"].values() for g in gs}
            for n, c in coords.items()}


def test_sigkilled_scheduler_comes_back_with_its_state_and_the_request_in_flight_completes(ray_cluster):
    sched = start_scheduler(topology_from_ray(), PARAMS, liveness_interval_s=0.5)
    ray_cluster.append(sched)
    coords = {n: FakeCoordinator.remote() for n in ("a", "b")}
    ray_cluster.extend(coords.values())
    ray.get(sched.register.remote(PipelineSpec("a", priority=1, train_gpus=1, max_shards=1), coords["a"]))
    ray.get(sched.register.remote(PipelineSpec("b", train_gpus=2, max_shards=2), coords["b"]))
    ray.get(sched.settle.remote())
    a_gpus = ray.get(sched.request.remote("a", "train", 1), timeout=10)
    in_flight = sched.request.remote("b", "train", 2)  # waits: a trains on one of the two GPUs
    poll(lambda: ray.get(sched.snapshot.remote())["pending"], what="b's request pending")
    before = ray.get(sched.snapshot.remote())
    roles_before = ray.get(sched.role_changes.remote(0))
    old_pid = ray.get(sched.pid.remote())
    assert [k for k in kv_keys() if k.endswith(":core")], "the state is not in the GCS store"

    os.kill(old_pid, signal.SIGKILL)
    new_pid = ray.get(sched.pid.remote(), timeout=60)  # queued until the actor is back
    assert new_pid != old_pid
    after = ray.get(sched.snapshot.remote())
    assert after["restarts"] == 1
    strip = lambda holdings: [{k: v for k, v in h.items() if k != "since"} for h in holdings]  # noqa: E731
    assert strip(after["ledger"]["holdings"]) == strip(before["ledger"]["holdings"])
    assert [(p["id"], p["pipeline"], p["gpus"]) for p in after["pending"]] == \
        [(p["id"], p["pipeline"], p["gpus"]) for p in before["pending"]]
    assert same_changes(ray.get(sched.role_changes.remote(0)), roles_before)
    assert ray.get(sched.audit.remote())["ok"]
    ray.get(sched.settle.remote())
    # each coordinator was told what the ledger has awake, and holds exactly that
    for name, coord in coords.items():
        state = ray.get(coord.state.remote())
        ledger = {int(r): g for r, g in after["pipelines"][name]["shards"].items()}
        assert [(c["shards"], c["wake"]) for c in state["calls"] if c["kind"] == "reassert"] == \
            [(ledger, False)] + ([(ledger, True)] if ledger else [])
        assert state["awake"] == {int(r): g for r, g in after["pipelines"][name]["shards"].items()}

    ray.get(sched.release.remote("a", "train", Progress("a", remaining=0, target=8)))
    b_gpus = ray.get(in_flight, timeout=30)  # sent to the old instance, answered by the new one
    assert sorted(b_gpus) == [0, 1]
    awake = awake_gpus(coords)
    assert not (awake["a"] | awake["b"]) & set(b_gpus), f"GPUs {b_gpus} granted while awake: {awake}"
    ray.get(sched.release.remote("b", "train"))
    ray.get(sched.settle.remote())
    snap = ray.get(sched.snapshot.remote())
    awake = awake_gpus(coords)
    for name in coords:  # the coordinators and the ledger agree; no GPU has two awake holders
        assert awake[name] == {g for gs in snap["pipelines"][name]["shards"].values() for g in gs}
    assert not awake["a"] & awake["b"]
    seqs = [c["seq"] for c in ray.get(sched.role_changes.remote(0))]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > len(roles_before)
    assert ray.get(sched.audit.remote())["ok"] and a_gpus

    # the restarted scheduler pings the coordinators it re-attached: a dead one is dropped
    ray.kill(coords["a"])
    poll(lambda: "a" not in ray.get(sched.snapshot.remote())["pipelines"], timeout=15,
         what="the dead coordinator dropped")

    # a fresh scheduler (not a restart) starts empty and leaves no stale state behind
    ray.kill(sched)
    poll(lambda: not _alive(), what="the scheduler gone")
    assert kv_keys(), "the killed scheduler's state should still be stored until a fresh start"
    fresh = start_scheduler(topology_from_ray(), PARAMS)
    ray_cluster.append(fresh)
    assert ray.get(fresh.snapshot.remote())["pipelines"] == {}
    fresh_id = fresh._actor_id.hex()
    assert all(fresh_id in k for k in kv_keys()), kv_keys()


def _alive() -> bool:
    try:
        ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def test_a_restart_that_cannot_read_its_state_refuses_calls_instead_of_starting_empty(ray_cluster):
    from ray.experimental import internal_kv

    from rlix.errors import SchedulerStateError, one_line

    sched = start_scheduler(topology_from_ray(), PARAMS)
    ray_cluster.append(sched)
    coord = FakeCoordinator.remote()
    ray_cluster.append(coord)
    ray.get(sched.register.remote(PipelineSpec("a", max_shards=2), coord))
    key = next(k for k in kv_keys() if k.endswith(":core"))
    internal_kv._internal_kv_put(key, b"{not json", overwrite=True, namespace=NAMESPACE)
    os.kill(ray.get(sched.pid.remote()), signal.SIGKILL)
    with pytest.raises(SchedulerStateError, match="unreadable") as err:
        ray.get(sched.snapshot.remote(), timeout=60)
    assert one_line(err.value).startswith("SchedulerStateError: the scheduler's state under")
