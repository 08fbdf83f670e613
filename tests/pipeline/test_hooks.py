"""Hooks: the no-op standalone hooks and the progress throttle."""

from __future__ import annotations

import asyncio

import pytest

from rlix.pipeline.hooks import NoOpHooks, ProgressThrottle, RLixHooks
from rlix.pipeline.rollout.types import NO_DEMAND, RolloutDemand as D


def test_noop_hooks_grant_their_fixed_gpus_and_satisfy_the_protocol():
    hooks = NoOpHooks([2, 3])
    assert isinstance(hooks, RLixHooks)

    async def main() -> list[int]:
        gpus = await hooks.before_training(0)
        await hooks.report_progress(D(1, 2), 0)
        await hooks.clear_progress()
        await hooks.after_training(0)
        return gpus
    assert asyncio.run(main()) == [2, 3]


def test_progress_is_reported_at_2_percent_steps_and_at_100():
    throttle = ProgressThrottle()
    assert [c for c in range(0, 101) if throttle.should_report(c, 100)] == list(range(0, 100, 2)) + [100]
    assert not throttle.should_report(100, 100)
    assert not throttle.should_report(150, 100)  # beyond the target is still complete
    throttle = ProgressThrottle()
    assert [c for c in range(0, 1001) if throttle.should_report(c, 1000)] == list(range(0, 1000, 20)) + [1000]


def test_small_targets_report_every_change_and_target_changes_always_report():
    throttle = ProgressThrottle()
    assert [c for c in range(0, 11) if throttle.should_report(c, 10)] == list(range(0, 11))
    assert throttle.should_report(10, 20)  # new target
    assert not throttle.should_report(10, 20)


def test_falling_back_to_zero_reports_and_reset_forces_the_next_report():
    throttle = ProgressThrottle()
    assert throttle.should_report(0, 1000)
    assert not throttle.should_report(5, 1000)  # 0.5%: same band as 0
    assert not throttle.should_report(0, 1000)  # last report said 0 already
    assert throttle.should_report(30, 1000)
    assert throttle.should_report(0, 1000)  # emptied (a batch was taken)
    assert throttle.should_report(600, 1000)
    assert not throttle.should_report(610, 1000)
    throttle.reset()
    assert throttle.should_report(610, 1000)
    with pytest.raises(ValueError):
        ProgressThrottle(0)


class _Method:
    """A fake Ray actor method: `.remote(*args)` records the call and returns an awaitable."""

    def __init__(self, calls: list, name: str, result=None) -> None:  # type: ignore[no-untyped-def]
        self.calls, self.name, self.result = calls, name, result

    def remote(self, *args):  # type: ignore[no-untyped-def]
        self.calls.append((self.name, args))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.result)
        return fut


class _FakeScheduler:
    def __init__(self) -> None:
        self.calls: list = []
        self.request = _Method(self.calls, "request", [0])
        self.release = _Method(self.calls, "release")
        self.report_progress = _Method(self.calls, "report_progress")


def test_scheduler_hooks_carry_batch_complete_with_the_training_request():
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched = _FakeScheduler()
    hooks = SchedulerHooks(sched, "p", 1)

    async def main() -> None:
        await hooks.report_progress(D(32, 64), 3)
        await hooks.report_progress(D(64, 64), 3)  # complete: held back, not sent alone
        await hooks.before_training(3)
        await hooks.report_progress(D(64, 64), 3)  # a late completion of step 3 ...
        await hooks.after_training(3, demand=D(0, 64))
        await hooks.before_training(4)  # ... does not ride with step 4's request

    asyncio.run(main())
    names = [n for n, _ in sched.calls]
    assert names == ["report_progress", "request", "release", "request"]
    sent = sched.calls[0][1][0]
    assert (sent.remaining, sent.target) == (32, 64)
    carried = sched.calls[1][1][3]
    assert (carried.pipeline, carried.remaining, carried.step) == ("p", 0, 3)
    assert sched.calls[3][1][3] is None
    released = sched.calls[2][1][2]
    assert (released.remaining, released.step) == (64, 4)


def test_scheduler_hooks_send_a_complete_batch_when_the_shards_went_idle():
    """Busy shards are not lent to an equal pipeline, so the scheduler must hear when they went
    idle, even with the next batch complete; a complete batch with shards still busy, or one
    whose shards were idle already in the last report, is still held for the request."""
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched = _FakeScheduler()
    hooks = SchedulerHooks(sched, "p", 1)

    async def main() -> None:
        await hooks.report_progress(D(32, 64), 3, shard_load={0: 8, 1: 8})  # busy: sent
        await hooks.report_progress(D(64, 64), 3, shard_load={0: 0, 1: 4})  # complete, busy: held
        await hooks.report_progress(D(64, 64), 3, shard_load={0: 0, 1: 0})  # went idle: sent
        await hooks.report_progress(D(64, 64), 3, shard_load={0: 0, 1: 0})  # idle already: held
        await hooks.before_training(3)

    asyncio.run(main())
    assert [n for n, _ in sched.calls] == ["report_progress", "report_progress", "request"]
    assert sched.calls[1][1][0].shard_load == {0: 0, 1: 0}
    assert sched.calls[2][1][3].shard_load == {0: 0, 1: 0}  # the held one rides on the request


def test_scheduler_hooks_send_the_pending_work_evidence_with_the_report():
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched = _FakeScheduler()
    hooks = SchedulerHooks(sched, "p", 1)
    asyncio.run(hooks.report_progress(D(10, 64), 2, pending_work=True))
    asyncio.run(hooks.report_progress(D(12, 64), 2))
    sent = [c[1][0] for c in sched.calls]
    assert [(p.remaining, p.pending_work) for p in sent] == [(54, True), (52, False)]


def test_scheduler_hooks_release_the_last_steps_gpus_at_once():
    """After the last step (nothing more wanted: target 0) the GPUs are released with the
    report, not kept for a next step that never comes; a complete next batch still cycles."""
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched = _FakeScheduler()
    hooks = SchedulerHooks(sched, "p", 1)

    async def main() -> None:
        await hooks.before_training(3)
        await hooks.after_training(3, demand=D(64, 64))  # the next batch is complete: kept
        await hooks.before_training(4)
        await hooks.after_training(4, demand=NO_DEMAND)  # the last step: released now
        await hooks.settle()

    sched.cycle = _Method(sched.calls, "cycle", [0])
    asyncio.run(main())
    assert [n for n, _ in sched.calls] == ["request", "cycle", "release"]
    released = sched.calls[2][1][2]
    assert (released.remaining, released.target, released.step) == (0, 0, 5)


def test_scheduler_hooks_carry_the_measured_rate_on_every_report():
    """The rate measured by the collector goes with its report and with the reports that ride
    on a training request or a release (the planner's expected work needs it)."""
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    sched = _FakeScheduler()
    hooks = SchedulerHooks(sched, "p", 1)

    async def main() -> None:
        await hooks.report_progress(D(10, 64), 2, seconds_per_trajectory=0.25)
        await hooks.report_progress(D(64, 64), 2)  # complete: rides on the request
        await hooks.before_training(2)
        await hooks.after_training(2, demand=D(0, 64))
        await hooks.settle()

    asyncio.run(main())
    sent = [args for name, args in sched.calls]
    assert sent[0][0].seconds_per_trajectory == 0.25
    assert sent[1][3].seconds_per_trajectory == 0.25  # with the training request
    assert sent[2][2].seconds_per_trajectory == 0.25  # with the release


def test_scheduler_hooks_say_where_their_engines_are_still_starting():
    """At `ready` and in every report: the run's GPUs whose engine of this pipeline is still
    starting in the background (the planner puts no further shard there meanwhile)."""
    from rlix.pipeline.scheduler_hooks import SchedulerHooks

    class Fleet:
        shards: dict = {}
        starting = {(2,), (3,)}

        def starting_on(self, gpus):  # type: ignore[no-untyped-def]
            return tuple(gpus) in self.starting

        async def sleep_partial(self, ranks):  # type: ignore[no-untyped-def]
            return {}

    class Coordinator:
        fleet = Fleet()

    sched = _FakeScheduler()
    sched.ready = _Method(sched.calls, "ready")
    hooks = SchedulerHooks(sched, "p", 1, gpus=[0, 1, 2, 3])

    async def main() -> None:
        await hooks.join(Coordinator(), None)  # type: ignore[arg-type]
        Coordinator.fleet.starting = {(3,)}
        await hooks.report_progress(D(4, 8), 0)

    asyncio.run(main())
    assert sched.calls[0] == ("ready", ("p", frozenset({2, 3})))
    assert sched.calls[1][0] == "report_progress" and sched.calls[1][1][0].engines_starting == frozenset({3})
