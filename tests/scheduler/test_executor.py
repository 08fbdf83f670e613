"""PlanExecutor without Ray: per-GPU (and per-rank) ordering, concurrency, failures.

Fake coordinators record every call's start and end; a call can be held at a gate the test
opens, so "does not wait" is shown by finishing while the other call is still held.
"""

from __future__ import annotations

import asyncio

import pytest

from rlix.scheduler.executor import PlanExecutor
from rlix.scheduler.types import Grant, Plan, ShardMove, Stage

from sched_kit import TIMEOUT, run, until


class Fake:
    """A coordinator: records calls in a shared log; `gate` holds every call until set."""

    def __init__(self, name: str, log: list, fail: Exception | None = None) -> None:
        self.name, self.log, self.fail = name, log, fail
        self.gate: asyncio.Event | None = None
        self.calls: list[tuple[list[int], dict[int, list[int]]]] = []

    async def __call__(self, remove: list[int], add: dict[int, list[int]]) -> None:
        self.calls.append((remove, add))
        kind = "shrink" if remove else "expand"
        self.log.append(("start", self.name, kind))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.log.append(("end", self.name, kind))


def make(log, **kw):
    granted: list[Grant] = []
    errors: list[tuple[str, BaseException]] = []

    def on_grant(g: Grant) -> None:
        granted.append(g)
        log.append(("grant", g.pipeline, g.request_id))

    ex = PlanExecutor(on_grant, lambda p, e: errors.append((p, e)), **kw)
    return ex, granted, errors


def test_expand_on_gpus_freed_by_a_slow_shrink_waits_for_it():
    async def main():
        log: list = []
        a, b = Fake("a", log), Fake("b", log)
        b.gate = asyncio.Event()
        ex, _, _ = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0, 1))], expands=[ShardMove("a", 0, (0, 1))]),
                  {"a": a, "b": b})
        await until(lambda: ("start", "b", "shrink") in log)
        await asyncio.sleep(0.05)  # give a wrongly-eager expand every chance to start
        assert a.calls == [] and ex.busy_gpus() == [0, 1]
        b.gate.set()
        await ex.drain()
        assert log == [("start", "b", "shrink"), ("end", "b", "shrink"),
                       ("start", "a", "expand"), ("end", "a", "expand")]
        assert a.calls == [([], {0: [0, 1]})] and b.calls == [([0], {})]
    run(main())


def test_expand_on_unrelated_gpus_does_not_wait_for_another_pipelines_slow_shrink():
    async def main():
        log: list = []
        a, b = Fake("a", log), Fake("b", log)
        b.gate = asyncio.Event()  # b's shrink hangs until we say so
        ex, granted, _ = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0,))],
                       grants=[Grant(7, "c", Stage.TRAIN, (3,))],
                       expands=[ShardMove("a", 1, (2,))]), {"a": a, "b": b})
        # Both finish while b's shrink is still held: neither waited for it.
        await until(lambda: ("end", "a", "expand") in log and granted)
        assert ("end", "b", "shrink") not in log
        assert [g.request_id for g in granted] == [7]
        b.gate.set()
        await ex.drain()
        assert log[-1] == ("end", "b", "shrink")
        assert log.index(("grant", "c", 7)) < log.index(("end", "b", "shrink"))
    run(main())


def test_grant_resolves_only_after_the_shrinks_on_its_gpus():
    async def main():
        log: list = []
        b, c = Fake("b", log), Fake("c", log)
        b.gate = asyncio.Event()
        ex, granted, _ = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0,)), ShardMove("c", 0, (1,))],
                       grants=[Grant(1, "a", Stage.TRAIN, (0, 1))]), {"b": b, "c": c})
        await until(lambda: ("end", "c", "shrink") in log)  # one of its two shrinks is done
        await asyncio.sleep(0.05)
        assert granted == []
        b.gate.set()
        await until(lambda: granted)
        assert log.index(("end", "b", "shrink")) < log.index(("grant", "a", 1))
        assert granted[0].gpus == (0, 1)
    run(main())


def test_actions_chain_across_plans_per_gpu():
    async def main():
        log: list = []
        a, b = Fake("a", log), Fake("b", log)
        a.gate = asyncio.Event()
        ex, granted, _ = make(log)
        ex.submit(Plan(expands=[ShardMove("a", 0, (0,))]), {"a": a, "b": b})   # slow wake
        ex.submit(Plan(shrinks=[ShardMove("a", 0, (0,))],                      # then preempted
                       grants=[Grant(3, "b", Stage.TRAIN, (0,))]), {"a": a, "b": b})
        await until(lambda: len(a.calls) == 1)
        await asyncio.sleep(0.05)
        assert len(a.calls) == 1 and granted == []  # the sleep waits for the wake in flight
        a.gate.set()
        await ex.drain()
        assert a.calls == [([], {0: [0]}), ([0], {})] and [g.request_id for g in granted] == [3]
    run(main())


def test_a_rank_moved_to_other_gpus_wakes_only_after_it_slept():
    async def main():
        log: list = []
        b = Fake("b", log)
        b.gate = asyncio.Event()
        ex, _, _ = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0,))], expands=[ShardMove("b", 0, (3,))]),
                  {"b": b})
        await until(lambda: len(b.calls) == 1)
        await asyncio.sleep(0.05)
        assert b.calls == [([0], {})]  # GPU 3 is free, but rank 0's engine is still sleeping
        b.gate.set()
        await ex.drain()
        assert b.calls == [([0], {}), ([], {0: [3]})]
    run(main())


def test_moves_with_the_same_dependencies_share_one_call():
    async def main():
        log: list = []
        a, b = Fake("a", log), Fake("b", log)
        ex, _, _ = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0,)), ShardMove("b", 2, (1,))],
                       expands=[ShardMove("a", 0, (0,)), ShardMove("a", 1, (1,)),
                                ShardMove("a", 2, (3,))]), {"a": a, "b": b})
        await ex.drain()
        assert b.calls == [([0, 2], {})]
        # ranks 0 and 1 wait for b's shrink; rank 2 on an idle GPU goes alone and at once
        assert sorted(a.calls, key=str) == sorted([([], {0: [0], 1: [1]}), ([], {2: [3]})], key=str)
    run(main())


def test_a_failed_shrink_is_reported_and_does_not_block_its_gpus():
    async def main():
        log: list = []
        dead = RuntimeError("actor died")
        a, b = Fake("a", log), Fake("b", log, fail=dead)
        ex, granted, errors = make(log)
        ex.submit(Plan(shrinks=[ShardMove("b", 0, (0,))], expands=[ShardMove("a", 0, (0,))],
                       grants=[]), {"a": a, "b": b})
        await ex.drain()
        assert errors == [("b", dead)] and a.calls == [([], {0: [0]})]
    run(main())


def test_missing_coordinator_is_skipped_and_a_hung_call_times_out():
    async def main():
        log: list = []
        a, slow = Fake("a", log), Fake("slow", log)
        slow.gate = asyncio.Event()  # never opened
        ex, _, errors = make(log, call_timeout_s=0.1)
        ex.submit(Plan(shrinks=[ShardMove("gone", 0, (0,)), ShardMove("slow", 0, (1,))],
                       expands=[ShardMove("a", 0, (0,)), ShardMove("a", 1, (1,))]),
                  {"a": a, "slow": slow})
        await ex.drain()
        assert [(p, type(e)) for p, e in errors] == [("slow", asyncio.TimeoutError)]
        assert sorted(r for _, add in a.calls for r in add) == [0, 1]
        assert ex.in_flight() == [] and ex.busy_gpus() == []
    run(main())


def test_settled_waits_for_the_last_action_on_the_given_gpus_only():
    async def main():
        log: list = []
        a, b = Fake("a", log), Fake("b", log)
        b.gate = asyncio.Event()
        ex, _, _ = make(log)
        ex.submit(Plan(expands=[ShardMove("a", 0, (0,)), ShardMove("b", 0, (1,))]),
                  {"a": a, "b": b})
        await asyncio.wait_for(ex.settled([0]), TIMEOUT)  # returns with b still held
        assert ("end", "a", "expand") in log and ("end", "b", "expand") not in log
        assert [d["pipeline"] for d in ex.in_flight()] == ["b"]
        await ex.close()
        assert ex.in_flight() == []
    run(main())


@pytest.mark.parametrize("n", [1, 5])
def test_calls_of_one_plan_run_concurrently(n):
    async def main():
        log: list = []
        started = []
        gate = asyncio.Event()

        def coordinator(name):
            async def call(remove, add):
                started.append(name)
                await gate.wait()
            return call

        ex, _, _ = make(log)
        coords = {f"p{i}": coordinator(f"p{i}") for i in range(n)}
        ex.submit(Plan(expands=[ShardMove(f"p{i}", 0, (i,)) for i in range(n)]), coords)
        await until(lambda: len(started) == n)  # all in flight at once
        gate.set()
        await ex.drain()
    run(main())
