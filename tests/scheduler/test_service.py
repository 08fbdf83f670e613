"""The scheduler service: its event loop without Ray, then the Ray actor on a local cluster
with four fake GPUs, fake coordinator actors, and a coordinator killed mid-run."""

from __future__ import annotations

import asyncio
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported anywhere

import pytest
import ray

from rlix.pipeline.rollout.types import RolloutDemand
from rlix.errors import SchedulerError, UnknownPipelineError
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.async_scheduler import AsyncScheduler
from rlix.scheduler.service import (
    get_scheduler,
    start_scheduler,
    topology_from_ray,
)
from rlix.scheduler.types import PipelineSpec, Plan, Progress, Stage, Topology

from sched_kit import run, until

PARAMS = PlannerParams(dwell_s=0.0, aging_s=60.0)


# ---------------------------------------------------------------------- without Ray
class Gated:
    """An in-process coordinator whose calls block while `gate` is clear."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls: list[tuple[list[int], dict]] = []

    async def __call__(self, remove, add):
        self.calls.append((remove, add))
        await self.gate.wait()


def test_request_returns_once_the_shrinks_on_its_gpus_are_done():
    async def main():
        s = AsyncScheduler(Topology((2,)), PARAMS)
        a, b = Gated(), Gated()
        s.register(PipelineSpec("a", train_gpus=1, max_shards=1), a)
        s.register(PipelineSpec("b", max_shards=2), b)
        await s.settle()
        assert len(s.core.shard_gpus("a")) == 1 and len(s.core.shard_gpus("b")) == 1
        a.gate.clear()  # a's own shard will be slow to sleep
        waiter = asyncio.ensure_future(s.request("a", "train", 1))
        await until(lambda: a.calls and a.calls[-1][0])  # the shrink has started
        assert not waiter.done()
        a.gate.set()
        gpus = await asyncio.wait_for(waiter, 2)
        assert gpus == list(s.core.ledger.stage_holding("a", Stage.TRAIN).gpus)
        s.release("a", Stage.TRAIN)
        await s.settle()
        assert s.core.ledger.idle_gpus() == [] and s.snapshot()["plans"]
        await s.close()
    run(main())


def test_a_hold_until_named_pipelines_register_lifts_itself_at_the_last_one():
    """A run's scheduler plans nothing until every pipeline of the run has registered (each
    one's training home is then known), and from then on without waiting for anything else."""
    async def main():
        s = AsyncScheduler(Topology((2,)), PARAMS)
        s.hold(until_registered=["a", "b"])
        s.register(PipelineSpec("a", max_shards=2), Gated())
        await s.settle()
        assert s.holding and not s.core.shard_gpus("a")
        s.register(PipelineSpec("b", max_shards=2), Gated())
        await s.settle()
        assert not s.holding and len(s.core.shard_gpus("a")) == len(s.core.shard_gpus("b")) == 1
        s.hold(until_registered=["a"])  # all named have registered already: no hold at all
        assert not s.holding
        await s.close()
    run(main())


def test_release_with_progress_hands_the_gpu_back_where_the_new_demand_is():
    async def main(with_progress: bool) -> tuple[int, int]:
        s = AsyncScheduler(Topology((2,)), PARAMS)
        s.register(PipelineSpec("a", train_gpus=1, max_shards=2), Gated())
        s.register(PipelineSpec("b", max_shards=2), Gated())
        s.report_progress(Progress("a", remaining=0, target=64))  # a's batch is complete
        s.report_progress(Progress("b", remaining=64, target=64))
        await s.request("a", "train", 1)
        new_demand = Progress("a", remaining=64, target=64, step=1) if with_progress else None
        s.release("a", Stage.TRAIN, new_demand)
        await s.settle()
        held = len(s.core.shard_gpus("a")), len(s.core.shard_gpus("b"))
        await s.close()
        return held

    assert run(main(True)) == (1, 1)  # the demand came with the release: one GPU each
    assert run(main(False)) == (0, 2)  # a's stale "no demand": both went to b


def test_a_cycle_trains_again_without_lending_the_gpu_to_another_pipelines_rollouts():
    """A pipeline whose next batch is complete releases and asks again: released on its own,
    the next plan gives its GPU to the other pipeline's rollouts (a shard start there, which
    the request a moment later must wait for); cycled, no plan sees the GPU free."""
    async def main(cycled: bool) -> tuple[list[dict], list]:
        s = AsyncScheduler(Topology((2,)), PARAMS)
        a, b = Gated(), Gated()
        s.register(PipelineSpec("a", train_gpus=1, max_shards=2), a)
        s.register(PipelineSpec("b", max_shards=2), b)
        s.report_progress(Progress("a", remaining=0, target=64))
        s.report_progress(Progress("b", remaining=64, target=64))
        await s.settle()
        first = await s.request("a", "train", 1)
        since = len(s.core.role_changes())
        n_b = len(b.calls)
        done = Progress("a", remaining=0, target=64, step=1)  # the next batch is complete too
        if cycled:
            second = await s.cycle("a", "train", 1, done)
        else:
            s.release("a", Stage.TRAIN, done)
            await s.settle()
            second = await s.request("a", "train", 1)
        await s.settle()
        changes = [c for c in s.core.role_changes()[since:] if c["gpu"] in first]
        expanded_b = [c for c in b.calls[n_b:] if c[1]]
        await s.close()
        assert second == first
        return changes, expanded_b

    changes, expanded_b = run(main(cycled=True))
    assert [c["after"] for c in changes] == ["idle", "a/train"] and not expanded_b
    changes, expanded_b = run(main(cycled=False))  # what the cycle avoids
    assert any(c["after"].startswith("b/generate") for c in changes) and expanded_b


def test_a_cycle_of_a_stage_not_held_is_a_request():
    async def main() -> list[int]:
        s = AsyncScheduler(Topology((2,)), PARAMS)
        s.register(PipelineSpec("a", train_gpus=1, max_shards=2), Gated())
        gpus = await s.cycle("a", "train", 1)
        with pytest.raises(SchedulerError, match="not cycled"):
            await s.cycle("a", "rollout", 1)
        await s.close()
        return gpus

    assert len(run(main())) == 1


def test_progress_sent_with_a_request_is_applied_before_its_plan():
    async def main() -> tuple[int, list[int], int]:
        s = AsyncScheduler(Topology((2,)), PARAMS)
        s.register(PipelineSpec("a", train_gpus=1, max_shards=2), Gated())
        s.register(PipelineSpec("b", max_shards=2), Gated())
        s.report_progress(Progress("a", remaining=8, target=64))
        s.report_progress(Progress("b", remaining=64, target=64))
        await s.settle()
        gpus = await s.request("a", "train", 1, Progress("a", remaining=0, target=64, step=3))
        await s.settle()
        remaining, held = s.core.progress["a"].remaining, len(s.core.shard_gpus("b"))
        await s.close()
        return remaining, gpus, held

    remaining, gpus, b_shards = run(main())
    assert remaining == 0 and len(gpus) == 1 and b_shards == 1


def test_rollout_request_waits_for_an_awake_shard():
    async def main():
        s = AsyncScheduler(Topology((2,)), PARAMS)
        a = Gated()
        a.gate.clear()
        s.register(PipelineSpec("a", max_shards=2), a)  # both shards start waking, slowly
        waiter = asyncio.ensure_future(s.request("a", Stage.ROLLOUT, 0))
        await until(lambda: a.calls)
        assert not waiter.done()
        a.gate.set()
        assert await asyncio.wait_for(waiter, 2) == [0, 1]
        await s.close()
    run(main())


def test_cancelled_request_leaves_the_queue_and_failure_fails_waiters():
    async def main():
        s = AsyncScheduler(Topology((2,)), PARAMS)
        a, b = Gated(), Gated()
        s.register(PipelineSpec("a", priority=1, train_gpus=2, max_shards=1), a)  # outranks b: its training may take b's last shard at once
        s.register(PipelineSpec("b", max_shards=1), b)
        await s.settle()
        b.gate.clear()  # b's shard never finishes sleeping
        waiter = asyncio.ensure_future(s.request("a", "train", 2))
        await until(lambda: b.calls and b.calls[-1][0])
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # It had been granted (ledger) but not delivered: cancelling gave the GPUs back.
        assert s.core.ledger.stage_holding("a", Stage.TRAIN) is None and not s.core.pending

        waiter = asyncio.ensure_future(s.request("a", "train", 2))
        rollout = asyncio.ensure_future(s.request("a", "rollout", 0))
        await until(lambda: s.core.ledger.stage_holding("a", Stage.TRAIN) is not None)
        s.pipeline_failed("a", "test says so")
        with pytest.raises(SchedulerError, match="test says so"):
            await asyncio.wait_for(waiter, 2)
        with pytest.raises(UnknownPipelineError, match="test says so"):
            await asyncio.wait_for(rollout, 2)
        assert s.snapshot()["failures"][0]["pipeline"] == "a"
        b.gate.set()
        await s.settle()
        assert len(s.core.shard_gpus("b")) == 1
        await s.close()
    run(main())


def test_unregister_puts_shards_to_sleep_before_others_get_the_gpus():
    async def main():
        s = AsyncScheduler(Topology((2,)), PARAMS)
        a, b = Gated(), Gated()
        s.register(PipelineSpec("a", max_shards=2), a)
        await s.settle()
        a_gpus = sorted(g for gs in s.core.shard_gpus("a").values() for g in gs)
        s.register(PipelineSpec("b", max_shards=2), b)
        await s.settle()
        assert len(s.core.shard_gpus("b")) == 1  # b takes one of a's two GPUs
        a_left, n_calls = s.core.shard_gpus("a"), len(a.calls)
        a.gate.clear()  # a's engines are slow to sleep
        assert s.unregister("a") == sorted(g for gs in a_left.values() for g in gs)
        assert "a" not in s.core.pipelines
        await until(lambda: len(a.calls) > n_calls)
        assert a.calls[n_calls:] == [(sorted(a_left), {})]  # its remaining shard goes to sleep
        await asyncio.sleep(0.05)
        assert len(b.calls) == 1  # b's expand onto a's GPU waits for that sleep
        a.gate.set()
        await s.settle()
        assert len(b.calls) == 2 and s.core.ledger.idle_gpus() == [] and a_gpus == [0, 1]
        with pytest.raises(UnknownPipelineError):
            s.unregister("a")
        await s.close()
    run(main())


def test_plan_wake_at_triggers_a_replan_by_itself():
    async def main():
        calls = []

        def stub(ledger, requests, progress, now, params):
            calls.append(now)
            return Plan(wake_at=now + 0.05) if len(calls) < 3 else Plan()

        s = AsyncScheduler(Topology((1,)), PARAMS, plan_fn=stub)
        s.register(PipelineSpec("a"), Gated())
        await until(lambda: len(calls) == 3)
        assert s.snapshot()["plans"] == [] and not s.snapshot()["timer_armed"]
        await s.close()
    run(main())


# ---------------------------------------------------------------------- with Ray
@ray.remote(num_cpus=0)
class FakeCoordinator:
    """Records resize calls (start, end); `set_delay` makes them slow."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.delay = 0.0

    async def resize_inference(self, remove, add):
        call = {"remove": list(remove), "add": {int(k): list(v) for k, v in add.items()},
                "start": time.time(), "end": None}
        self.calls.append(call)
        await asyncio.sleep(self.delay)
        call["end"] = time.time()

    async def set_delay(self, seconds: float) -> None:
        self.delay = seconds

    async def get_calls(self) -> list[dict]:
        return self.calls


def poll(fn, timeout: float = 10.0, what: str = "condition"):
    """Call fn until it returns something truthy; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, namespace="rlix-test",
             logging_level="warning")
    sched = start_scheduler(topology_from_ray(), PARAMS, liveness_interval_s=1.0)
    coords = {name: FakeCoordinator.remote() for name in ("a", "b", "c")}
    try:
        yield sched, coords
    finally:
        for handle in [*coords.values(), sched]:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        ray.shutdown()


def snap(sched) -> dict:
    return ray.get(sched.snapshot.remote())


def shards(s: dict, name: str) -> dict:
    return s["pipelines"].get(name, {}).get("shards", {})


def test_start_and_get_scheduler(cluster):
    sched, _ = cluster
    assert topology_from_ray() == Topology((4,))
    assert get_scheduler()._actor_id == sched._actor_id
    assert start_scheduler(Topology((4,)), PARAMS)._actor_id == sched._actor_id  # get-if-exists
    with pytest.raises(SchedulerError, match="already running"):
        start_scheduler(Topology((2, 2)))


def test_training_request_shrinks_other_pipeline_and_release_expands_back(cluster):
    sched, coords = cluster
    ray.get(sched.register.remote(PipelineSpec("a", train_gpus=2, max_shards=1), coords["a"]))
    ray.get(sched.register.remote(PipelineSpec("b", max_shards=4), coords["b"]))
    assert sorted(ray.get(sched.request.remote("b", "rollout"), timeout=10))
    s = poll(lambda: (lambda s: s if not s["ledger"]["idle"] and not s["in_flight"] else None)(
        snap(sched)), what="cluster filled")
    assert len(shards(s, "a")) == 1 and len(shards(s, "b")) == 3
    with pytest.raises(SchedulerError, match="not registered"):
        ray.get(sched.request.remote("zzz", "train", 1))

    ray.get(coords["b"].set_delay.remote(0.5))  # b's engines are slow to sleep
    n_before = len(ray.get(coords["b"].get_calls.remote()))
    gpus = ray.get(sched.request.remote("a", Stage.TRAIN, 2), timeout=10)
    granted_at = time.time()
    b_calls = ray.get(coords["b"].get_calls.remote())[n_before:]
    b_shrinks = [c for c in b_calls if c["remove"]]
    assert b_shrinks, "a's training must take GPUs from b's shards"
    assert all(c["end"] is not None and c["end"] <= granted_at for c in b_shrinks)
    s = snap(sched)
    held = [h for h in s["ledger"]["holdings"] if h["pipeline"] == "a" and h["role"] == "train"]
    assert len(gpus) == 2 and held[0]["gpus"] == sorted(gpus)
    assert not set(gpus) & {g for gs in shards(s, "b").values() for g in gs}
    assert any("grant a/train" in p["summary"] for p in s["plans"])

    ray.get(coords["b"].set_delay.remote(0.0))
    ray.get(sched.release.remote("a", "train"))
    s = poll(lambda: (lambda s: s if not s["ledger"]["idle"] and not s["in_flight"] else None)(
        snap(sched)), what="GPUs given back")
    assert len(shards(s, "a")) == 1 and len(shards(s, "b")) == 3  # as before the request
    expands = [c for c in ray.get(coords["b"].get_calls.remote())[n_before:] if c["add"]]
    assert expands and expands[-1]["start"] > granted_at
    with pytest.raises(SchedulerError, match="holds no GPUs"):
        ray.get(sched.release.remote("a", "train"))


def test_scheduler_hooks_send_the_release_and_collect_its_answer_later(cluster):
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched, _ = cluster
    hooks = SchedulerHooks(sched, "a", 2)

    async def cycle() -> tuple[list[int], list[int]]:
        first = await hooks.before_training(0)
        await hooks.after_training(0, demand=RolloutDemand(0, 64))  # returns with the release in flight
        second = await hooks.before_training(1)  # the release is applied before this request
        await hooks.after_training(1)
        await hooks.settle()
        return first, second

    first, second = asyncio.run(cycle())
    assert len(first) == 2 and len(second) == 2
    held = [h for h in snap(sched)["ledger"]["holdings"] if h["pipeline"] == "a" and h["role"] == "train"]
    assert held == []
    # a release the scheduler refuses is not lost: its error surfaces at the next settle
    asyncio.run(hooks.after_training(2))
    with pytest.raises(SchedulerError, match="holds no GPUs"):
        asyncio.run(hooks.settle())


def test_scheduler_hooks_keep_the_gpus_when_the_next_batch_is_complete(cluster):
    """No release when the next batch is complete: the next step's request cycles the stage in
    the scheduler (release and request in one re-plan), through the Ray actor."""
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched, _ = cluster
    hooks = SchedulerHooks(sched, "a", 2)

    def held_by_a() -> list:
        return [h for h in snap(sched)["ledger"]["holdings"] if h["pipeline"] == "a" and h["role"] == "train"]

    async def steps() -> tuple[list[int], list, list[int], list]:
        first = await hooks.before_training(0)
        await hooks.after_training(0, demand=RolloutDemand(64, 64))  # complete: the GPUs are kept
        await hooks.settle()
        between = held_by_a()
        second = await hooks.before_training(1)  # released and asked for again in one call
        await hooks.after_training(1, demand=RolloutDemand(64, 64))
        kept_at_the_end = held_by_a()
        await hooks.leave()  # the run ends holding them: released, then unregistered
        return first, between, second, kept_at_the_end

    first, between, second, kept = asyncio.run(steps())
    assert len(first) == 2 and len(second) == 2 and between and kept
    assert held_by_a() == [] and "a" not in snap(sched)["pipelines"]
    ray.get(sched.register.remote(PipelineSpec("a", train_gpus=2, max_shards=1),
                                  cluster[1]["a"]))  # as the later tests expect


def test_dead_coordinator_returns_its_gpus_and_others_go_on(cluster):
    sched, coords = cluster
    a_gpus = poll(lambda: [g for gs in shards(snap(sched), "a").values() for g in gs],
                  what="a holds a shard")
    killed_at = time.monotonic()
    ray.kill(coords["a"])  # idle: only the liveness check can notice
    s = poll(lambda: (lambda s: s if "a" not in s["pipelines"]
                      and sorted(g for gs in shards(s, "b").values() for g in gs) == [0, 1, 2, 3]
                      and not s["in_flight"] else None)(snap(sched)),
             timeout=10, what="a's GPUs re-planned for b")
    assert time.monotonic() - killed_at < 10
    assert s["failures"][-1]["pipeline"] == "a" and set(a_gpus) <= set(s["failures"][-1]["freed_gpus"])

    # b goes on: a training grant and its release
    gpus = ray.get(sched.request.remote("b", "train", 1), timeout=10)
    assert len(gpus) == 1
    ray.get(sched.release.remote("b", "train"))
    ray.get(sched.report_progress.remote(Progress("b", remaining=64, target=64)))


def test_coordinator_killed_during_a_resize_fails_the_waiter(cluster):
    sched, coords = cluster
    c = coords["c"]
    ray.get(sched.register.remote(PipelineSpec("c", train_gpus=1, max_shards=1), c))
    poll(lambda: shards(snap(sched), "c") and not snap(sched)["in_flight"], what="c has a shard")
    ray.get(c.set_delay.remote(60.0))  # c's calls now hang
    waiter = sched.request.remote("c", "train", 1)
    poll(lambda: any(call["end"] is None for call in ray.get(c.get_calls.remote())),
         what="c's resize in flight")
    killed_at = time.monotonic()
    ray.kill(c)
    with pytest.raises(SchedulerError, match="failed"):
        ray.get(waiter, timeout=10)
    s = poll(lambda: (lambda s: s if "c" not in s["pipelines"] and not s["ledger"]["idle"]
                      and not s["in_flight"] else None)(snap(sched)), what="c's GPUs re-planned")
    assert time.monotonic() - killed_at < 10
    assert sorted(g for gs in shards(s, "b").values() for g in gs) == [0, 1, 2, 3]
    assert ray.get(sched.request.remote("b", "train", 2), timeout=10)
    ray.get(sched.release.remote("b", "train"))


def test_a_coordinator_is_dead_only_when_its_own_actor_died():
    """A call that raised inside a live coordinator (even an error wrapping the death of a shard
    actor it called, as when a node leaves) must not unregister its pipeline."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from rlix.scheduler.service import _is_dead

    wrapped = RayTaskError("resize_inference", "Traceback ...", ActorDiedError()).as_instanceof_cause()
    assert isinstance(wrapped, ActorDiedError)  # what made it look like the coordinator's death
    assert not _is_dead(wrapped)
    assert _is_dead(ActorDiedError())
    assert not _is_dead(RuntimeError("a plain error"))
