"""The collector against a fake generate: admission bound, staleness, retries, accounting."""

from __future__ import annotations

import asyncio
import random

import pytest

from rlix.envs import PatternTask
from rlix.pipeline.buffer import ReplayBuffer
from rlix.pipeline.collector import TrajectoryCollector


class Tok:
    def encode(self, text, add_special_tokens=False):  # type: ignore[no-untyped-def]
        return [ord(c) % 250 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return "".join("a" if i % 2 else "b" for i in ids)


class Hooks:
    def __init__(self) -> None:
        self.reports: list[tuple[int, int, int]] = []

    async def report_progress(self, collected, target, step, shard_load=None):  # type: ignore[no-untyped-def]
        self.reports.append((collected, target, step))


class FakeEngine:
    """Answers after a random delay with the version it was told to serve; can fail."""

    def __init__(self, fail_first: int = 0, always_fail: bool = False) -> None:
        self.version, self.calls, self.in_flight, self.peak = 0, 0, 0, 0
        self.fail_first, self.always_fail = fail_first, always_fail
        self.rng = random.Random(0)

    async def __call__(self, ids, params, session):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.always_fail or self.calls <= self.fail_first:
            raise ConnectionError("shard went away")
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.rng.uniform(0.001, 0.01))
        self.in_flight -= 1
        toks = [self.rng.randrange(1, 200) for _ in range(params["max_tokens"])]
        return {"choices": [{"token_ids": toks, "finish_reason": "length",
                             "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in toks]},
                             "weight_versions": [{"version": str(self.version), "start": 0, "end": len(toks)}]}]}


def collector(engine, buffer, hooks, **kw):  # type: ignore[no-untyped-def]
    settings = dict(group_size=4, groups_per_step=3, max_new_tokens=5, temperature=1.0, max_age=1,
                    concurrency=8, seed=7, retry_delay_s=0.001)
    settings.update(kw)
    return TrajectoryCollector(engine, Tok(), PatternTask(["a"], 4), buffer, hooks, **settings)


def test_admission_bounds_generation_to_what_the_trainer_can_use_and_accounting_holds():
    async def main() -> None:
        buf, hooks, engine = ReplayBuffer(), Hooks(), FakeEngine()
        col = collector(engine, buf, hooks)
        col.start()
        await col.wait_for(3)
        await asyncio.sleep(0.2)  # it would run ahead here if admission let it
        assert buf.valid_groups(0, 1) + len(col._inflight) <= 3 * 2
        for step in range(3):
            await col.wait_for(3)
            groups = buf.take(3, step, 1)
            assert all(g.version >= step - 1 for g in groups)
            assert all(len(t.behaviour_logprobs) == len(t.response_ids) == 5 for g in groups
                       for t in g.trajectories)
            engine.version = step + 1
            col.set_version(step + 1)
        await col.stop()
        buf.check_conservation()
        acc = buf.accounting()
        assert acc["trained"] == 36 and acc["started"] == acc["trained"] + sum(acc["dropped"].values())
        assert hooks.reports and all(t == 12 for _, t, _ in hooks.reports)
        assert col.stats()["tokens"] > 0
    asyncio.run(main())


def test_groups_that_finish_too_old_are_dropped_as_stale():
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = collector(engine, buf, Hooks())
        col.start()
        await col.wait_for(3)
        col.set_version(5)  # the trainer jumped ahead: everything buffered is too old
        assert buf.valid_groups(5, 1) == 0 and buf.accounting()["dropped"]["stale"] >= 12
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_failed_requests_are_retried_then_the_group_is_dropped_with_the_reason():
    async def main() -> None:
        buf = ReplayBuffer()
        col = collector(FakeEngine(fail_first=2), buf, Hooks())
        col.start()
        await col.wait_for(3)  # two failures were retried away
        await col.stop()
        assert not any(r.startswith("generate failed") for r in buf.accounting()["dropped"])
        buf.check_conservation()

        buf2 = ReplayBuffer()
        col2 = collector(FakeEngine(always_fail=True), buf2, Hooks(), max_retries=1)
        col2.start()
        await asyncio.sleep(0.3)
        await col2.stop()
        dropped = buf2.accounting()["dropped"]
        assert any("generate failed" in r and "shard went away" in r for r in dropped), dropped
        buf2.check_conservation()
    asyncio.run(main())


def test_stop_counts_in_flight_groups_as_dropped_at_shutdown():
    async def main() -> None:
        buf = ReplayBuffer()
        col = collector(FakeEngine(), buf, Hooks(), concurrency=2)
        col.start()
        await asyncio.sleep(0.005)
        await col.stop()
        assert buf.accounting()["dropped"].get("shutdown", 0) > 0
        buf.check_conservation()
    asyncio.run(main())
