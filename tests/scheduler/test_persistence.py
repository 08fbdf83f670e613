"""SchedulerPersistence: the core's state saved to a store and loaded into a fresh core (what a
restarted scheduler does), without Ray."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlix.errors import SchedulerStateError
from rlix.scheduler.core import SchedulerCore, gpu_roles
from rlix.scheduler.persistence import (
    ROLE_CHUNK,
    MemoryStore,
    SchedulerPersistence,
    ServiceState,
)
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Progress, Stage, Topology

TOPOLOGY = Topology((4,))
PREFIX = "test:state:"


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def busy_core(clock: Clock) -> SchedulerCore:
    """A core with something of everything: homes, shards, a training holding, a pending
    request, progress with shard loads, a release, a departed pipeline, role changes."""
    core = SchedulerCore(TOPOLOGY, PlannerParams(dwell_s=5.0, aging_s=30.0), clock=clock)
    core.register(PipelineSpec("a", priority=1, train_gpus=3, max_shards=2, fixed_trainer=True))
    core.register(PipelineSpec("b", train_gpus=2, max_shards=2))
    core.register(PipelineSpec("c", train_gpus=1, max_shards=1, partial_overlap=False))
    core.register(PipelineSpec("gone", max_shards=1))
    core.replan("start")
    core.unregister("gone")
    core.report_progress(Progress("a", remaining=12, target=32, step=2, shard_load={0: 3}))
    core.report_progress(Progress("b", remaining=30, target=32, step=1, turns_outstanding=7))
    clock.t += 1.0
    core.submit_request("c", Stage.TRAIN, 1)
    core.replan("c trains")
    core.release("c", Stage.TRAIN)
    core.replan("c released")
    clock.t += 1.0
    core.submit_request("a", Stage.TRAIN, 3)
    core.replan("a trains")
    core.submit_request("b", Stage.TRAIN, 2)  # 1 GPU is left outside a's training: pending
    core.replan("b waits")
    assert core.pending and core.ledger.stage_holding("a", Stage.TRAIN) is not None
    return core


def reload(store: MemoryStore, clock: Clock, wall: float) -> tuple[SchedulerCore, ServiceState | None]:
    core = SchedulerCore(TOPOLOGY, PlannerParams(dwell_s=5.0, aging_s=30.0), clock=clock)
    state = SchedulerPersistence(store, PREFIX, wall_clock=lambda: wall).load(core)
    return core, state


def test_round_trip_restores_ledger_requests_progress_and_logs_with_times_moved():
    old_clock = Clock(100.0)
    core = busy_core(old_clock)
    store = MemoryStore()
    saver = SchedulerPersistence(store, PREFIX, wall_clock=lambda: 5000.0)  # offset 4900
    service = ServiceState(holding=True, failures=[{"pipeline": "x", "reason": "r", "at": 90.0}],
                           errors=[{"what": "w", "error": "e", "at": 95.0}], restarts=2)
    assert saver.save(core, service)

    # the new process: its monotonic clock reads 7, and 10 s of wall time have passed
    new_clock = Clock(7.0)
    got, state = reload(store, new_clock, wall=5010.0)
    shift = (5000.0 - 102.0) - (5010.0 - 7.0)  # what moves an old time onto the new clock
    assert state == dataclasses.replace(service, failures=[{"pipeline": "x", "reason": "r", "at": 90.0 + shift}],
                                        errors=[{"what": "w", "error": "e", "at": 95.0 + shift}])
    got.ledger.check_invariants()
    old, new = core.ledger, got.ledger
    assert new.pipelines == old.pipelines and list(new.pipelines) == list(old.pipelines)
    assert new.train_home == old.train_home and new.train_home["c"] and new.train_home["a"]
    assert new.owner == old.owner and new.last_shard_gpus == old.last_shard_gpus
    assert new.shardless_since == old.shardless_since and new.version == old.version
    assert new.holding_since == {n: t + shift for n, t in old.holding_since.items()} and new.holding_since
    assert list(new.holdings) == list(old.holdings)
    for key, h in old.holdings.items():
        assert new.holdings[key] == dataclasses.replace(h, since=h.since + shift)
    # ages go on: a holding is 10 s (the wall time between save and load) older than it was
    a_train = new.stage_holding("a", Stage.TRAIN)
    assert new_clock() - a_train.since == pytest.approx(102.0 - old.stage_holding("a", Stage.TRAIN).since + 10.0)
    assert [(r.id, r.pipeline, r.stage, r.gpus) for r in got.pending.values()] == \
        [(r.id, r.pipeline, r.stage, r.gpus) for r in core.pending.values()]
    for rid, r in core.pending.items():
        assert got.pending[rid].submitted_at == pytest.approx(r.submitted_at + shift)
    assert got.progress["a"].shard_load == {0: 3} and got.progress["b"].turns_outstanding == 7
    assert got.progress["a"].reported_at == pytest.approx(core.progress["a"].reported_at + shift)
    assert [p["summary"] for p in got.plan_log] == [p["summary"] for p in core.plan_log]
    assert [dict(c, at=0) for c in got.role_log] == [dict(c, at=0) for c in core.role_log]
    assert got.role_log[-1]["at"] == pytest.approx(core.role_log[-1]["at"] + shift)
    assert got.next_id == core.next_id and got.role_seq == core.role_seq
    assert got.departed == core.departed and "gone" in got.departed
    assert got.last_release == {"c": {"stage": "train", "freed": [g for g in new.train_home["c"]]}}
    assert got.snapshot()["ledger"]["idle"] == core.snapshot()["ledger"]["idle"]


def test_restored_core_goes_on_numbering_roles_and_requests_and_grants_the_pending_one():
    clock = Clock(100.0)
    core = busy_core(clock)
    store = MemoryStore()
    SchedulerPersistence(store, PREFIX, wall_clock=lambda: 5000.0).save(core, ServiceState())
    got, _ = reload(store, Clock(3.0), wall=4903.0)
    seq, pending_id = got.role_seq, next(iter(got.pending))
    got.release("a", Stage.TRAIN)
    plan = got.replan("after restart")
    assert [g.request_id for g in plan.grants] == [pending_id]  # b's request, from before
    assert got.submit_request("a", Stage.TRAIN, 1).id == core.next_id  # ids are never reused
    changes = got.role_changes(seq - 1)
    assert [c["seq"] for c in changes] == list(range(seq, seq + len(changes))) and len(changes) > 2
    roles = gpu_roles(core.snapshot())  # each change follows on from the GPU's role at the save
    for c in changes[1:]:
        assert c["before"] == roles.get(c["gpu"], "idle")
        roles[c["gpu"]] = c["after"]


def test_role_log_is_saved_in_chunks_and_old_chunks_are_dropped():
    clock = Clock(0.0)
    core = SchedulerCore(Topology((2,)), PlannerParams(dwell_s=0.0), clock=clock, log_size=2)  # keeps 400
    core.register(PipelineSpec("a", train_gpus=2, max_shards=2))
    store = MemoryStore()
    saver = SchedulerPersistence(store, PREFIX, wall_clock=lambda: 0.0)
    sizes = []
    core.replan()
    for _ in range(300):  # 4 role changes a round: shards -> train -> shards
        core.submit_request("a", Stage.TRAIN, 2)
        core.replan()
        saver.save(core, ServiceState())
        core.release("a", Stage.TRAIN)
        core.replan()
        puts = store.puts
        saver.save(core, ServiceState())
        sizes.append(store.puts - puts)
    assert core.role_seq > 1000 and len(core.role_log) == 400
    chunks = sorted(int(k.rsplit(":", 1)[1]) for k in store.data if ":roles:" in k)
    first, last = (core.role_log[0]["seq"] - 1) // ROLE_CHUNK, (core.role_seq - 1) // ROLE_CHUNK
    assert chunks == list(range(first, last + 1))  # only what the kept log needs
    assert max(sizes) <= 3  # a save writes the newest chunk(s) and the state, not the whole log
    got = SchedulerCore(Topology((2,)), PlannerParams(dwell_s=0.0), clock=clock, log_size=2)
    SchedulerPersistence(store, PREFIX, wall_clock=lambda: 0.0).load(got)
    assert list(got.role_log) == list(core.role_log)


def test_unchanged_state_is_not_written_again_and_clear_removes_only_its_prefix():
    clock = Clock(1.0)
    core = busy_core(clock)
    store = MemoryStore()
    store.put("other:key", b"x")
    saver = SchedulerPersistence(store, PREFIX)
    assert saver.save(core, ServiceState()) and not saver.save(core, ServiceState())
    assert saver.save(core, ServiceState(holding=True))
    saver.clear()
    assert list(store.data) == ["other:key"]
    assert reload(store, Clock(0.0), wall=0.0)[1] is None  # nothing stored: nothing to restore


@pytest.mark.parametrize("damage, message", [
    (lambda doc: doc["state"].update(format=99), "format 99"),
    (lambda doc: doc["state"].update(gpus_per_node=[2, 2]), "GPUs per node"),
    (lambda doc: doc["state"]["holdings"][1].update(gpus=doc["state"]["holdings"][0]["gpus"]),
     "two holdings"),
    (lambda doc: doc["state"].pop("pending"), "unreadable"),
    (lambda doc: doc["state"].update(role_seq=doc["state"]["role_seq"] + ROLE_CHUNK), "lacks chunk"),
])
def test_a_damaged_state_is_refused_with_a_typed_error(damage, message):
    store = MemoryStore()
    SchedulerPersistence(store, PREFIX).save(busy_core(Clock(1.0)), ServiceState())
    doc = json.loads(store.data[PREFIX + "core"])
    damage(doc)
    store.data[PREFIX + "core"] = json.dumps(doc).encode()
    with pytest.raises(SchedulerStateError, match=message):
        reload(store, Clock(0.0), wall=0.0)


def test_a_missing_role_change_is_refused():
    store = MemoryStore()
    SchedulerPersistence(store, PREFIX).save(busy_core(Clock(1.0)), ServiceState())
    key = next(k for k in store.data if ":roles:" in k)
    store.data[key] = json.dumps(json.loads(store.data[key])[1:]).encode()
    with pytest.raises(SchedulerStateError, match="not continuous"):
        reload(store, Clock(0.0), wall=0.0)


def test_gpus_lost_with_their_node_stay_lost_across_a_restart():
    core = SchedulerCore(Topology((2, 2)), PlannerParams(dwell_s=0.0), clock=Clock(0.0))
    core.register(PipelineSpec("a", max_shards=4))
    core.replan("start")
    core.gpus_lost([2, 3])
    store = MemoryStore()
    assert SchedulerPersistence(store, PREFIX, wall_clock=lambda: 0.0).save(core, ServiceState())
    got = SchedulerCore(Topology((2, 2)), PlannerParams(dwell_s=0.0), clock=Clock(1.0))
    SchedulerPersistence(store, PREFIX, wall_clock=lambda: 1.0).load(got)
    assert got.ledger.lost == {2, 3}
    got.replan("after the restart")
    assert sorted(g for h in got.ledger.holdings.values() for g in h.gpus) == [0, 1]
