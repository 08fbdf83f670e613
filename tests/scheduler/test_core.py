"""SchedulerCore: validation, bookkeeping around the real planner, atomic rejection of bad plans."""

from __future__ import annotations

import logging

import pytest

from rlix.errors import SchedulerError, UnknownPipelineError
from rlix.scheduler.planning import planner
from rlix.scheduler.core import ROLE_REASONS, SchedulerCore
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import (
    Grant,
    PipelineSpec,
    Plan,
    Progress,
    ShardMove,
    Stage,
    Topology,
)


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(*specs: PipelineSpec, nodes: int = 1, per_node: int = 4, plan_fn=None):
    clock = Clock()
    core = SchedulerCore(Topology.uniform(nodes, per_node), PlannerParams(dwell_s=0.0),
                         clock=clock, plan_fn=plan_fn)
    for s in specs:
        core.register(s)
    return core, clock


def counts(core: SchedulerCore) -> dict[str, int]:
    return {n: len(core.shard_gpus(n)) for n in core.pipelines}


def test_validation_raises_typed_errors():
    core, _ = make(PipelineSpec("a", train_gpus=2, max_shards=4),
                   PipelineSpec("solo", train_gpus=2, partial_overlap=False, max_shards=2))
    with pytest.raises(SchedulerError, match="already registered"):
        core.register(PipelineSpec("a"))
    with pytest.raises(SchedulerError, match="tp=8"):
        core.register(PipelineSpec("wide", tp=8))
    for call in (lambda: core.submit_request("nope", Stage.TRAIN, 1),
                 lambda: core.release("nope", "train"),
                 lambda: core.report_progress(Progress("nope", remaining=1)),
                 lambda: core.unregister("nope")):
        with pytest.raises(UnknownPipelineError):
            call()
    with pytest.raises(SchedulerError, match="cluster has 4"):
        core.submit_request("a", Stage.TRAIN, 5)
    with pytest.raises(SchedulerError, match="positive integer"):
        core.submit_request("a", Stage.TRAIN, 0)
    with pytest.raises(SchedulerError, match="home GPUs"):
        core.submit_request("solo", Stage.TRAIN, 3)  # could never be granted
    with pytest.raises(SchedulerError, match="unknown stage"):
        core.submit_request("a", "warmup", 1)
    with pytest.raises(SchedulerError, match="rollout"):
        core.submit_request("a", Stage.ROLLOUT, 1)
    with pytest.raises(SchedulerError, match="holds no GPUs"):
        core.release("a", Stage.TRAIN)
    with pytest.raises(SchedulerError, match=">= 0"):
        core.report_progress(Progress("a", remaining=-1))

    first = core.submit_request("a", "train", 2)
    with pytest.raises(SchedulerError, match="still pending"):
        core.submit_request("a", Stage.LOGPROB, 1)
    assert list(core.pending) == [first.id]  # the refused one left no trace


def test_request_ids_are_assigned_and_stamped_by_the_core():
    core, clock = make(PipelineSpec("a", train_gpus=1), PipelineSpec("b", train_gpus=1))
    clock.t = 5.0
    ra = core.submit_request("a", Stage.TRAIN, 1)
    rb = core.submit_request("b", Stage.INIT, 1)
    assert (ra.id, rb.id) == (1, 2) and ra.submitted_at == 5.0 and rb.stage is Stage.INIT
    clock.t = 7.5
    pending = {p["id"]: p for p in core.snapshot()["pending"]}
    assert pending[1]["waiting_s"] == pytest.approx(2.5) and pending[2]["stage"] == "init"


def test_train_request_shrinks_the_other_pipeline_and_release_expands_back(caplog):
    core, clock = make(PipelineSpec("a", train_gpus=2, max_shards=1),
                       PipelineSpec("b", max_shards=4))
    caplog.set_level(logging.INFO, logger="rlix.scheduler")
    core.replan("start")
    assert counts(core) == {"a": 1, "b": 3} and core.ledger.idle_gpus() == []
    b_before = core.shard_gpus("b")

    clock.t = 10.0
    req = core.submit_request("a", Stage.TRAIN, 2)
    p = core.replan("request")
    assert [g.request_id for g in p.grants] == [req.id] and len(p.grants[0].gpus) == 2
    assert req.id not in core.pending  # granted requests leave the queue
    assert {m.pipeline for m in p.shrinks} >= {"b"}, p.summary()
    held = core.ledger.stage_holding("a", Stage.TRAIN)
    assert held is not None and set(held.gpus) == set(p.grants[0].gpus)
    assert any("plan (request): grant a/train" in r.getMessage() for r in caplog.records)

    clock.t = 20.0
    assert sorted(core.release("a", "train")) == sorted(held.gpus)
    p = core.replan("release")
    assert p.expands and not p.shrinks
    assert core.ledger.idle_gpus() == [] and len(core.shard_gpus("b")) == len(b_before)
    assert [e["reason"] for e in core.snapshot()["plans"]] == ["start", "request", "release"]


def test_pipeline_without_progress_report_keeps_full_demand():
    seen = []

    def spy(ledger, requests, progress, now, params):
        seen.append((sorted(ledger.pipelines), dict(progress)))
        return planner.plan(ledger, requests, progress, now, params)

    core, clock = make(PipelineSpec("quiet", max_shards=2), PipelineSpec("done", max_shards=2),
                       plan_fn=spy)
    core.report_progress(Progress("done", remaining=0, target=16))
    clock.t = 1.0
    core.replan("progress")
    names, progress = seen[-1]
    assert names == ["done", "quiet"] and set(progress) == {"done"}
    assert progress["done"].reported_at == 0.0  # stamped when reported, not when planned
    assert counts(core) == {"quiet": 2, "done": 0}


def test_a_pipeline_setting_up_gets_no_shards_until_ready_then_each_is_planned_when_ready():
    """Each pipeline is planned for as soon as it is set up: the first ready one uses every GPU
    meanwhile, one still loading holds none (no GPU held idle through another's set-up)."""
    core, clock = make(nodes=1, per_node=4)
    core.register(PipelineSpec("fast", max_shards=4), setting_up=True)
    core.register(PipelineSpec("slow", max_shards=4), setting_up=True)
    core.replan("register")
    assert counts(core) == {"fast": 0, "slow": 0}
    clock.t = 1000.0  # however long the set-up: the marker is not a report that goes stale
    core.replan("timer")
    assert counts(core) == {"fast": 0, "slow": 0}
    assert core.ready("fast") and not core.ready("fast")  # a repeated call changes nothing
    core.replan("ready fast")
    assert counts(core) == {"fast": 4, "slow": 0}
    assert core.ready("slow")
    core.replan("ready slow")
    assert counts(core) == {"fast": 2, "slow": 2}
    with pytest.raises(UnknownPipelineError):
        core.ready("nope")


def test_no_shard_goes_to_the_training_home_of_a_pipeline_still_setting_up():
    """Its trainer and engine are loading there: the ready pipeline starts on every other GPU
    at once, and gets that one only by sharing once the other is ready."""
    core, _ = make(nodes=1, per_node=4)
    core.register(PipelineSpec("fast", train_gpus=1, max_shards=4, fixed_trainer=True), setting_up=True)
    core.register(PipelineSpec("slow", train_gpus=1, max_shards=4, fixed_trainer=True), setting_up=True)
    slow_home = core.ledger.train_home["slow"]
    assert core.ready("fast")
    core.replan("ready fast")
    fast_gpus = {g for gs in core.shard_gpus("fast").values() for g in gs}
    assert len(fast_gpus) == 3 and not fast_gpus & slow_home
    assert core.ready("slow")
    core.replan("ready slow")
    assert counts(core) == {"fast": 2, "slow": 2}


def test_progress_is_stamped_with_the_core_clock():
    core, clock = make(PipelineSpec("a"))
    clock.t = 42.0
    core.report_progress(Progress("a", remaining=3, reported_at=-1.0))
    assert core.progress["a"].reported_at == 42.0
    assert core.snapshot()["progress"]["a"]["remaining"] == 3


def test_unregister_frees_gpus_cancels_pending_and_lists_shards():
    core, _ = make(PipelineSpec("a", train_gpus=4, max_shards=2), PipelineSpec("b", max_shards=2))
    core.replan()
    a_shards = core.shard_gpus("a")
    dropped = core.submit_request("a", Stage.TRAIN, 4)
    assert core.cancel_request(dropped.id) == dropped and core.cancel_request(dropped.id) is None
    core.submit_request("b", Stage.TRAIN, 1)
    req = core.submit_request("a", Stage.TRAIN, 4)  # not planned yet: still pending
    gone = core.unregister("a")
    assert {(m.dp_rank, m.gpus) for m in gone.shards} == set(a_shards.items())
    assert sorted(gone.freed_gpus) == sorted(g for gs in a_shards.values() for g in gs)
    assert [r.id for r in gone.cancelled] == [req.id]
    assert [r.pipeline for r in core.pending.values()] == ["b"]
    assert "a" not in core.pipelines and "a" not in core.progress


def test_a_plan_the_ledger_rejects_changes_nothing():
    bad = Plan(expands=[ShardMove("a", 0, (0,)), ShardMove("b", 0, (0,))])  # same GPU twice
    core, _ = make(PipelineSpec("a"), PipelineSpec("b"), plan_fn=lambda *args: bad)
    before = core.ledger.snapshot()
    with pytest.raises(SchedulerError, match="plan rejected"):
        core.replan("bad")
    assert core.ledger.snapshot() == before and core.snapshot()["plans"] == []
    assert "plan rejected" in core.snapshot()["last_error"]


def test_a_grant_for_a_request_that_is_not_pending_is_rejected():
    core, _ = make(PipelineSpec("a", train_gpus=1),
                   plan_fn=lambda *args: Plan(grants=[Grant(99, "a", Stage.TRAIN, (0,))]))
    with pytest.raises(SchedulerError, match="not pending"):
        core.replan()
    assert core.ledger.stage_holding("a", Stage.TRAIN) is None

    req = core.submit_request("a", Stage.TRAIN, 1)
    core._plan_fn = lambda *args: Plan(grants=[Grant(req.id, "a", Stage.TRAIN, (0, 1))])
    with pytest.raises(SchedulerError, match="does not match"):
        core.replan()
    assert list(core.pending) == [req.id]


def test_one_non_rollout_stage_at_a_time_per_pipeline():
    """Holding init while waiting for train could block the pipeline on itself."""
    core, _ = make(PipelineSpec("a", train_gpus=2, max_shards=2))
    core.submit_request("a", Stage.INIT, 3)
    core.replan()
    with pytest.raises(SchedulerError, match="already holds GPUs for init"):
        core.submit_request("a", Stage.TRAIN, 2)
    core.release("a", Stage.INIT)
    core.submit_request("a", Stage.TRAIN, 2)
    assert [g.stage for g in core.replan().grants] == [Stage.TRAIN]


def test_role_log_numbers_every_gpu_change_including_ones_a_poller_would_miss():
    core, clock = make(PipelineSpec("a", train_gpus=1, max_shards=1), PipelineSpec("b", max_shards=2),
                       per_node=2)
    core.replan("start")
    start = core.role_changes()
    assert [c["before"] for c in start] == ["idle", "idle"] and {c["gpu"] for c in start} == {0, 1}
    roles = {c["gpu"]: c["after"] for c in start}
    assert sorted(r.split("#")[0] for r in roles.values()) == ["a/generate", "b/generate"]
    seen = start[-1]["seq"]

    # train and release again before anyone polls: both changes of that GPU are kept, in order
    core.submit_request("a", Stage.TRAIN, 1)
    core.replan("request")
    core.release("a", "train")
    core.replan("release")
    later = core.role_changes(seen)
    assert [c["seq"] for c in later] == list(range(seen + 1, seen + 1 + len(later)))
    trained = [c for c in later if c["after"] == "a/train"]
    assert trained and any(c["before"] == "a/train" and c["gpu"] == trained[0]["gpu"] for c in later)
    for c in later:  # each change continues from the GPU's previous state
        assert c["before"] == roles.get(c["gpu"], "idle")
        roles[c["gpu"]] = c["after"]
    assert core.role_changes(later[-1]["seq"]) == []
    b_gpus = sorted(g for g, r in roles.items() if r.startswith("b/"))
    core.unregister("b")
    gone = core.role_changes(later[-1]["seq"])
    assert [(c["gpu"], c["after"]) for c in gone] == [(g, "idle") for g in b_gpus]


def test_every_role_change_says_why():
    """grant, expand, preemption (a plan's, told apart by what the GPU became), release,
    unregister, failure, lost: the timeline's reasons."""
    core, _ = make(PipelineSpec("a", train_gpus=1, max_shards=2), PipelineSpec("b", max_shards=2),
                   PipelineSpec("c", max_shards=1), nodes=2, per_node=2)
    core.replan("start")
    assert {c["reason"] for c in core.role_changes()} == {"expand"}
    seen = core.role_changes()[-1]["seq"]

    core.submit_request("a", Stage.TRAIN, 1)
    core.replan("request")
    granted = core.role_changes(seen)
    assert [c["reason"] for c in granted if c["after"] == "a/train"] == ["grant"]
    for c in granted:
        want = "grant" if c["after"].endswith("/train") else "expand" if "/generate#" in c["after"] \
            else "preemption"
        assert c["reason"] == want, c
    seen = granted[-1]["seq"]

    core.release("a", "train")
    assert [c["reason"] for c in core.role_changes(seen)] == ["release"]
    seen = core.role_changes()[-1]["seq"]
    core.replan("after release")
    seen = core.role_changes()[-1]["seq"] if core.role_changes(seen) else seen

    held_b = [g for g, r in core._roles.items() if r.startswith("b/")]
    core.unregister("b", "failure")
    failed = core.role_changes(seen)
    assert sorted(c["gpu"] for c in failed) == sorted(held_b)
    assert {c["reason"] for c in failed} == {"failure"}
    seen = failed[-1]["seq"]

    held_c = [g for g, r in core._roles.items() if r.startswith("c/")]
    core.unregister("c")
    assert {c["reason"] for c in core.role_changes(seen)} == {"unregister"}
    seen = core.role_changes()[-1]["seq"]

    held = sorted(g for g in core._roles if g in (2, 3))
    core.gpus_lost([2, 3])
    lost = core.role_changes(seen)
    assert sorted(c["gpu"] for c in lost) == held and {c["reason"] for c in lost} <= {"lost"}
    assert {c["reason"] for c in core.role_log} <= set(ROLE_REASONS)
    assert held_c  # c had its shard
