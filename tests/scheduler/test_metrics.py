"""The scheduler's Prometheus metrics: SchedulerMetrics over a SchedulerCore driven by hand (grants,
waits, preemptions, holdings, pending requests), and the scheduler actor serving its registry."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported anywhere

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlix.errors import SchedulerError
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.metrics import SchedulerMetrics
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Plan, Progress, ShardMove, Stage, Topology


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def value(m: SchedulerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def make(plan_fn=None):
    clock = Clock()
    core = SchedulerCore(Topology((4,)), PlannerParams(dwell_s=0.0), clock=clock, plan_fn=plan_fn)
    core.register(PipelineSpec("a", train_gpus=2, max_shards=4))
    core.register(PipelineSpec("b", train_gpus=1, max_shards=2))
    return core, clock, SchedulerMetrics(clock=clock)


def test_grants_waits_preemptions_and_holdings():
    core, clock, m = make()
    m.refresh(core)
    assert value(m, "rlix_gpus", state="idle") == 4 and value(m, "rlix_pipelines") == 2

    first = m.replan(core, "start")  # both have full demand: the four GPUs become shards
    m.refresh(core)
    woken = {p: sum(1 for e in first.expands if e.pipeline == p) for p in ("a", "b")}
    assert sum(woken.values()) == 4
    for p in ("a", "b"):
        assert value(m, "rlix_shard_wakes_total", pipeline=p) == woken[p]
        assert value(m, "rlix_gpus_held", pipeline=p, role="generate") == woken[p]
        assert value(m, "rlix_gpu_share", pipeline=p) == woken[p] / 4
    assert value(m, "rlix_gpus", state="idle") == 0
    assert value(m, "rlix_plans_total", outcome="changed") == 1

    core.submit_request("a", Stage.TRAIN, 2)
    m.refresh(core)
    clock.t += 2.5
    assert value(m, "rlix_pending_requests") == 1
    assert value(m, "rlix_pending_wait_seconds", pipeline="a", stage="train") == 2.5

    plan = m.replan(core, "request a/train")
    m.refresh(core)
    # a's two shards sleep for its training; b's shard gives its GPU to a's third shard
    assert [g.pipeline for g in plan.grants] == ["a"] and len(plan.shrinks) == 3
    assert value(m, "rlix_grants_total", pipeline="a", stage="train") == 1
    assert value(m, "rlix_request_wait_seconds_count", pipeline="a", stage="train") == 1
    assert value(m, "rlix_request_wait_seconds_sum", pipeline="a", stage="train") == 2.5
    assert value(m, "rlix_request_wait_seconds_bucket", pipeline="a", stage="train", le="1.0") == 0
    assert value(m, "rlix_request_wait_seconds_bucket", pipeline="a", stage="train", le="5.0") == 1
    assert value(m, "rlix_preemptions_total", pipeline="a", to="train") == 2
    assert value(m, "rlix_preemptions_total", pipeline="b", to="shard") == 1
    assert value(m, "rlix_preemptions_total", pipeline="b", to="train") is None
    assert value(m, "rlix_gpus_held", pipeline="a", role="train") == 2
    assert value(m, "rlix_pending_requests") == 0
    assert list(text_string_to_metric_families(m.text()))  # the exposition parses
    assert value(m, "rlix_plan_seconds_count") == 2

    core.release("a", Stage.TRAIN)
    core.report_progress(Progress("a", remaining=0, target=8))  # a needs no shard any more
    m.replan(core, "release")
    m.refresh(core)
    assert value(m, "rlix_gpus_held", pipeline="a", role="train") == 0
    assert value(m, "rlix_gpus_held", pipeline="b", role="generate") == 2

    core.unregister("b")
    m.refresh(core)
    assert value(m, "rlix_gpus_held", pipeline="b", role="generate") is None  # gone with it
    assert value(m, "rlix_pipelines") == 1


def test_shard_moves_and_rejected_plans_are_told_apart():
    moves: list[Plan] = []
    core, _, m = make(plan_fn=lambda *args: moves.pop(0))
    moves.append(Plan(expands=[ShardMove("a", 0, (0,))]))
    m.replan(core)
    moves.append(Plan(shrinks=[ShardMove("a", 0, (0,))], expands=[ShardMove("b", 0, (0,))]))
    m.replan(core)
    assert value(m, "rlix_preemptions_total", pipeline="a", to="shard") == 1
    moves.append(Plan(shrinks=[ShardMove("b", 0, (0,))]))
    m.replan(core)
    assert value(m, "rlix_preemptions_total", pipeline="b", to="idle") == 1
    moves.append(Plan(shrinks=[ShardMove("b", 0, (0,))]))  # b holds no shard: the ledger refuses
    with pytest.raises(SchedulerError):
        m.replan(core)
    assert value(m, "rlix_plans_total", outcome="rejected") == 1
    moves.append(Plan())
    m.replan(core)
    assert value(m, "rlix_plans_total", outcome="unchanged") == 1


@pytest.fixture
def local_ray():
    import ray  # deferred: only this test needs Ray

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, namespace="rlix-metrics-test",
             logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_scheduler_actor_serves_its_registry(local_ray):
    from rlix.scheduler.service import start_scheduler  # deferred: imports Ray

    sched = start_scheduler(Topology((2,)), PlannerParams(), metrics_port=0)
    endpoint = local_ray.get(sched.metrics_endpoint.remote())
    assert endpoint["error"] is None and endpoint["url"].startswith("http://127.0.0.1:")
    text = httpx.get(endpoint["url"], timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"rlix_gpus", "rlix_plan_seconds", "rlix_preemptions", "rlix_pending_requests"} <= set(families)
    idle = [s.value for s in families["rlix_gpus"].samples if s.labels == {"state": "idle"}]
    assert idle == [2.0]
    local_ray.kill(sched)


def test_serve_on_a_free_port_and_a_taken_one():
    import socket  # deferred: only this test binds a port

    m = SchedulerMetrics()
    port = m.serve(0)
    assert "rlix_plan_seconds" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            SchedulerMetrics().serve(taken.getsockname()[1])
