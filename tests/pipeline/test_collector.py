"""The collector against a fake generate: admission bound, staleness, retries, progress,
accounting. No servers (the real-engine test is test_collector_engine.py)."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from rlix.config.models import LengthTail, RolloutConfig
from rlix.envs import PatternTask
from rlix.errors import CollectorError, InvalidRequestError
from rlix.inference.router.router import Generation, VersionSpan
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.collector import TrajectoryCollector, length_limit, parse_versions, sample_seed
from rlix.pipeline.hooks import ProgressThrottle


class Tok:
    def encode(self, text, add_special_tokens=False):  # type: ignore[no-untyped-def]
        return [ord(c) % 250 + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return "".join("a" if i % 2 else "b" for i in ids)


class Hooks:
    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.reports: list[tuple[int, int, int]] = []
        self.demands: list = []
        self.pending: list[bool] = []
        self.fail, self.delay = fail, delay

    async def report_progress(self, demand, step, shard_load=None, pending_work=False, **_):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("scheduler gone")
        self.reports.append((demand.collected, demand.target, step))
        self.demands.append(demand)
        self.pending.append(pending_work)


class FakeEngine:
    """Answers after a random delay with the version it serves (optionally switching version
    mid-response, as a re-dispatched request does); can fail."""

    def __init__(self, fail_first: int = 0, error: Exception | None = None, delay=(0.001, 0.01),
                 split: bool = False, version_label=None) -> None:  # type: ignore[no-untyped-def]
        self.version, self.calls = 0, 0
        self.fail_first, self.error = fail_first, error
        self.delay, self.split, self.version_label = delay, split, version_label
        self.rng = random.Random(0)
        self.seen: list[tuple[tuple[int, ...], int, str | None]] = []
        self.limits: dict[int, int] = {}  # sampling seed -> the request's max_tokens
        self.ignore_eos: set[object] = set()  # what the requests said of ignore_eos
        self.on_call = None
        self.hold_after: int | None = None  # calls after this many wait for `gate`
        self.gate = asyncio.Event()

    async def __call__(self, ids, params, session):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.seen.append((tuple(ids), params.seed, session))
        self.limits[params.seed] = params.max_tokens
        self.ignore_eos.add(params.ignore_eos)
        if self.on_call is not None:
            self.on_call()
        if self.error is not None and self.calls <= self.fail_first:
            raise self.error
        if self.hold_after is not None and self.calls > self.hold_after:
            await self.gate.wait()
        v0 = self.version
        await asyncio.sleep(self.rng.uniform(*self.delay))
        n = params.max_tokens
        toks = [random.Random(params.seed + k).randrange(1, 200) for k in range(n)]
        if self.split:  # the first two tokens on the old weights, the rest on newer ones
            spans = [{"version": str(v0), "start": 0, "end": 2}, {"version": str(v0 + 1), "start": 2, "end": n}]
        else:
            spans = [{"version": self.version_label or str(v0), "start": 0, "end": n}]
        return Generation.from_answer({
            "choices": [{"token_ids": toks, "finish_reason": "length",
                         "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in toks]},
                         "weight_versions": spans}]})


def collector(engine, buffer, hooks, **kw):  # type: ignore[no-untyped-def]
    rollout = dict(group_size=4, groups_per_step=3, max_new_tokens=5, temperature=1.0, concurrency=8,
                   length_tail=None, ignore_eos=False)
    rollout.update({k: kw.pop(k) for k in list(kw) if k in rollout})
    settings = dict(max_age=1, seed=7, retry_delay_s=0.001)
    settings.update(kw)
    return TrajectoryCollector(engine, Tok(), PatternTask(["a"], 4), buffer, hooks,
                               RolloutConfig(**rollout), **settings)


def test_admission_bounds_generation_to_what_the_trainer_can_use_and_accounting_holds():
    async def main() -> None:
        buf, hooks, engine = ReplayBuffer(), Hooks(), FakeEngine()
        col = collector(engine, buf, hooks)
        limit = 3 * (1 + 1)
        worst = []
        engine.on_call = lambda: worst.append(buf.valid_groups(col.version, 1) + col.groups_in_flight())
        col.start()
        for step in range(4):
            await col.wait_for(3)
            await asyncio.sleep(0.05)  # it would run ahead here if admission let it
            assert buf.valid_groups(step, 1) + col.groups_in_flight() <= limit
            groups = buf.take(3, step, 1)
            buf.check_conservation(col.in_flight())
            assert all(g.version >= step - 1 for g in groups)
            for g in groups:
                assert len({t.group_id for t in g.trajectories}) == 1 and len(g) == 4
                for t in g.trajectories:
                    assert len(t.behaviour_logprobs) == len(t.response_ids) == 5
                    assert t.prompt_ids == Tok().encode("Repeat: a\n") and 0 <= t.reward <= 1
                    assert t.versions == [t.version] and t.finished_at >= t.started_at
            engine.version = step + 1
            col.set_version(step + 1)
        await asyncio.sleep(0.01)  # the reporter runs beside the loop
        await col.stop()
        assert max(worst) <= limit and col.stats()["peak_admitted"] <= limit
        buf.check_conservation()
        acc = buf.accounting()
        assert acc["trained"] == 48 and acc["started"] == acc["trained"] + sum(acc["dropped"].values())
        assert hooks.reports and all(t == 12 for _, t, _ in hooks.reports)
        assert {s for _, _, s in hooks.reports} == {0, 1, 2, 3, 4}  # every version change is heard
        assert col.stats()["tokens"] > 0 and col.stats()["groups"] >= 12
    asyncio.run(main())


def test_pending_work_is_groups_in_flight_or_the_trainer_waiting_and_goes_with_reports():
    async def main() -> None:
        buf, hooks, engine = ReplayBuffer(), Hooks(), FakeEngine()
        engine.hold_after = 0  # every request waits at the gate: groups stay in flight
        col = collector(engine, buf, hooks)
        assert not col.pending_work()
        col.start()
        waiter = asyncio.ensure_future(col.wait_for(3))
        await asyncio.sleep(0.02)
        assert col.groups_in_flight() > 0 and col.pending_work()
        engine.gate.set()
        await waiter
        await asyncio.sleep(0.02)
        await col.stop()
        assert not col.pending_work()  # nothing in flight and nobody waits
        # the reports made while groups were in flight said so
        assert hooks.pending and any(hooks.pending)
    asyncio.run(main())


def test_concurrency_caps_groups_in_flight_and_sessions_are_group_ids():
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine(delay=(0.02, 0.03))
        col = collector(engine, buf, Hooks(), concurrency=2, groups_per_step=10)
        peak = []
        engine.on_call = lambda: peak.append(col.groups_in_flight())
        col.start()
        await col.wait_for(4)
        await col.stop()
        assert max(peak) <= 2
        sessions = {}
        for _, _, session in engine.seen:
            sessions[session] = sessions.get(session, 0) + 1
        assert all(n <= 4 for n in sessions.values()) and all(s.startswith("g7-") for s in sessions)
        buf.check_conservation()
    asyncio.run(main())


def test_in_flight_cap_is_per_awake_shard_and_a_woken_shard_is_given_work_at_once():
    """Two awake shards get twice the groups in flight (not one shard's worth split in two);
    a shard woken while everything in flight waits is filled at once, not at the next answer;
    none awake still keeps one shard's worth queued; max_staleness still bounds the total."""
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        engine.hold_after = 0  # every request waits: what is in flight stays in flight
        shards = [0]
        col = collector(engine, buf, Hooks(), concurrency=2, groups_per_step=4, max_age=1,
                        active_shards=lambda: shards[0])
        col.start()
        await asyncio.sleep(0.05)
        assert col.groups_in_flight() == 2  # none awake: one shard's worth
        shards[0] = 2
        await asyncio.sleep(0.05)
        assert col.groups_in_flight() == 2  # nothing told it yet, and nothing finished
        col.shards_changed()
        await asyncio.sleep(0.05)
        assert col.groups_in_flight() == 4
        shards[0] = 8  # more shards than the staleness bound leaves work for
        col.shards_changed()
        await asyncio.sleep(0.05)
        assert col.groups_in_flight() == 4 * (1 + 1)
        engine.gate.set()
        await col.wait_for(4)
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_same_seed_same_prompts_and_sampling_seeds():
    async def run(seed: int) -> list:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = collector(engine, buf, Hooks(), seed=seed, concurrency=1, groups_per_step=1, max_age=0)
        col.start()
        await col.wait_for(1)
        await col.stop()
        return sorted(engine.seen)[:4]
    a, b, c = (asyncio.run(run(s)) for s in (3, 3, 4))
    assert a == b and a != c
    assert len({seed for _, seed, _ in a}) == 4  # a distinct seed per sample


def test_groups_that_finish_too_old_are_dropped_as_stale():
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        engine.hold_after = 12  # three groups finish, the next three wait
        col = collector(engine, buf, Hooks())
        col.start()
        await col.wait_for(3)
        while engine.calls < 24:
            await asyncio.sleep(0.001)
        assert col.groups_in_flight() == 3 and len(buf) == 12
        col.set_version(5)  # the trainer jumped ahead: everything buffered or in flight is too old
        assert buf.valid_groups(5, 1) == 0 and buf.accounting()["dropped"]["stale"] == 12
        engine.gate.set()
        while col.stats()["groups"] < 6:  # those in flight finish (engine still on version 0)
            await asyncio.sleep(0.001)
        assert buf.accounting()["dropped"]["stale"] >= 24
        assert len(buf) == 0  # nothing stale ever entered the buffer
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_a_response_spanning_two_versions_is_as_old_as_its_oldest_token():
    buf_holder = {}

    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine(split=True)
        engine.version = 2
        col = collector(engine, buf, Hooks(), max_age=2)
        col.set_version(3)
        col.start()
        await col.wait_for(1)
        buf_holder["g"] = buf.take(1, 3, 2)[0]
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())
    t = buf_holder["g"].trajectories[0]
    assert t.version == 2 and t.versions == [2, 3]


def test_unprovable_versions_drop_the_group():
    with pytest.raises(Exception, match="cover 3 of 5"):
        parse_versions([VersionSpan(1, 0, 3)], 5)
    assert parse_versions([VersionSpan(1, 0, 3), VersionSpan(2, 3, 5)], 5) == [1, 2]
    assert parse_versions([], 0) == []

    async def main() -> dict:
        buf = ReplayBuffer()
        col = collector(FakeEngine(version_label="unknown"), buf, Hooks())
        col.start()
        await asyncio.sleep(0.1)
        await col.stop()
        buf.check_conservation()
        return buf.accounting()
    acc = asyncio.run(main())
    assert acc["trained"] == 0 and any("unknown weight version" in r for r in acc["dropped"]), acc


def test_failed_requests_are_retried_then_the_group_is_dropped_with_the_reason():
    async def main() -> None:
        buf = ReplayBuffer()
        col = collector(FakeEngine(fail_first=2, error=ConnectionError("blip")), buf, Hooks())
        col.start()
        await col.wait_for(3)  # two failures were retried away
        await col.stop()
        assert not any(r.startswith("generate failed") for r in buf.accounting()["dropped"])
        assert col.stats()["retries"] == 2
        buf.check_conservation()

        buf2, engine = ReplayBuffer(), FakeEngine(fail_first=10**9, error=ConnectionError("shard went away"))
        col2 = collector(engine, buf2, Hooks(), max_retries=1, concurrency=1)
        col2.start()
        await asyncio.sleep(0.2)
        await col2.stop()
        dropped = buf2.accounting()["dropped"]
        failed = [r for r in dropped if "generate failed" in r]
        assert failed and "ConnectionError: shard went away" in failed[0], dropped
        assert dropped[failed[0]] % 4 == 0  # the whole group goes
        assert any("shard went away" in e for e in col2.stats()["errors"])
        buf2.check_conservation()
    asyncio.run(main())


def test_a_bad_request_is_not_retried():
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine(fail_first=10**9, error=InvalidRequestError("prompt too long"))
        col = collector(engine, buf, Hooks(), concurrency=1, max_retries=5, group_size=2)
        col.start()
        await asyncio.sleep(0.05)
        await col.stop()
        assert col.stats()["retries"] == 0 and engine.calls == col.stats()["requests"]
        assert any("prompt too long" in r for r in buf.accounting()["dropped"])
        buf.check_conservation()
    asyncio.run(main())


def test_progress_is_throttled_to_2_percent_steps():
    async def main() -> None:
        buf, hooks = ReplayBuffer(), Hooks()
        # target 200 trajectories, two per group: each finished group is 1%
        col = collector(FakeEngine(delay=(0.0005, 0.002)), buf, hooks, group_size=2, groups_per_step=100,
                        max_age=0, concurrency=16)
        col.start()
        await col.wait_for(100)
        await asyncio.sleep(0.05)
        await col.stop()
        collected = [c for c, t, _ in hooks.reports]
        assert collected[0] == 0 and collected[-1] == 200 and collected == sorted(collected)
        bands = [ProgressThrottle().band(c, 200) for c in collected]
        assert len(set(bands)) == len(bands)  # never two reports in one 2% band
        assert 10 <= len(collected) <= 51, collected
        buf.check_conservation()
    asyncio.run(main())


def test_a_failing_or_slow_control_plane_does_not_disturb_collection():
    async def main() -> None:
        for hooks in (Hooks(fail=True), Hooks(delay=0.5)):
            buf = ReplayBuffer()
            col = collector(FakeEngine(), buf, hooks)
            col.start()
            await asyncio.wait_for(col.wait_for(6), 5)
            await col.stop()
            buf.check_conservation()
            assert buf.accounting()["dropped"].keys() <= {"shutdown", "unused at shutdown"}
    asyncio.run(main())


def test_stop_counts_in_flight_groups_as_dropped_at_shutdown_and_wakes_waiters():
    async def main() -> None:
        buf = ReplayBuffer()
        col = collector(FakeEngine(delay=(0.05, 0.1)), buf, Hooks(), concurrency=2)
        col.start()
        waiter = asyncio.create_task(col.wait_for(100))
        await asyncio.sleep(0.01)
        assert col.in_flight() == 8
        buf.check_conservation(col.in_flight())
        await col.stop()
        await col.stop()  # idempotent
        assert buf.accounting()["dropped"]["shutdown"] == 8
        assert col.in_flight() == 0
        buf.check_conservation()
        with pytest.raises(CollectorError, match="stopped"):
            await waiter
        with pytest.raises(CollectorError):
            col.start()
    asyncio.run(main())


def test_demand_for_release_is_the_next_steps_demand_and_is_not_reported_again():
    async def main() -> None:
        buf, hooks = ReplayBuffer(), Hooks()
        engine = FakeEngine()
        engine.hold_after = 12  # the first step's 3 groups x 4 finish, then generation holds
        col = collector(engine, buf, hooks)
        col.start()
        await asyncio.wait_for(col.wait_for(3), 5)
        await asyncio.sleep(0.05)  # the reporter loop has sent "12 of 12"
        buf.take(3, 0, 1)
        col.set_version(1)
        before = len(hooks.reports)
        demand = col.demand_for_release()
        collected, target = demand.collected, demand.target
        assert collected < target == 12  # the next step's demand
        # the window (3 groups x 4 x (max_staleness 1 + 1)) less what is buffered valid
        assert demand.outstanding == 24 - buf.valid_count(1, 1) and demand.remaining == demand.outstanding
        await asyncio.sleep(0.1)
        # the reporter loop, woken by set_version, does not send the same demand again
        assert (collected, target, 1) not in hooks.reports[before:], hooks.reports
        engine.gate.set()
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_a_complete_next_batch_still_reports_the_window_it_can_use():
    """The next step's batch is in and the trainer busy: the demand says the batch after is
    still wanted (in flight or not started), so the scheduler keeps its shards generating
    instead of taking them, and their work, for another pipeline."""
    async def main() -> None:
        buf, hooks = ReplayBuffer(), Hooks()
        col = collector(FakeEngine(), buf, hooks, concurrency=3, groups_per_step=3, group_size=4, max_age=1)
        col.start()
        await asyncio.wait_for(col.wait_for(3), 5)
        demand = col.demand()
        assert demand.complete and demand.for_next_step == 0
        assert demand.outstanding == 2 * 12 - buf.valid_count(0, 1) > 0 and demand.remaining == demand.outstanding
        await col.wait_for(6)  # the whole window is in: nothing more it could use
        assert col.demand().remaining == 0
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_no_group_is_generated_past_the_last_step():
    """With `steps`, the window ends at the last step: one step left, one batch; none left, none."""
    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = collector(engine, buf, Hooks(), concurrency=8, groups_per_step=3, max_age=1, steps=2)
        col.set_version(1)
        col.start()
        await asyncio.wait_for(col.wait_for(3), 5)
        await asyncio.sleep(0.05)
        assert buf.accounting()["started"] == 3 * 4  # one batch, not max_staleness + 1
        assert col.demand().remaining == 0
        buf.take(3, 1, 1)
        col.set_version(2)
        await asyncio.sleep(0.05)
        assert buf.accounting()["started"] == 3 * 4 and col.groups_in_flight() == 0
        await col.stop()
        buf.check_conservation()
    asyncio.run(main())


def test_with_shards_to_spare_no_group_is_generated_for_a_batch_already_taken():
    """The trainer's loop as async_grpo runs it, with four shards' worth in flight (generation
    outruns training): taking a batch shortens the window by it, and no group starts while the
    shards are refit. Nothing goes stale; every started group is trained or in the window."""
    async def main() -> None:
        buf, hooks, engine = ReplayBuffer(), Hooks(), FakeEngine(delay=(0.001, 0.003))
        col = collector(engine, buf, hooks, concurrency=3, groups_per_step=3, max_age=1,
                        active_shards=lambda: 4)
        calls_while_held = []
        col.start()
        for step in range(5):
            await asyncio.wait_for(col.wait_for(3), 5)
            col.take(3)
            await asyncio.sleep(0.05)  # training: the shards have time for far more than a batch
            assert buf.valid_groups(step, 1) + col.groups_in_flight() <= 3  # one batch ahead only
            assert col.demand().outstanding == 3 * 4 - buf.valid_count(step, 1)
            col.set_version(step + 1, held=True)
            before = engine.calls
            await asyncio.sleep(0.02)  # the refit of the active shards
            calls_while_held.append(engine.calls - before)
            engine.version = step + 1
            col.open_admission()
        await col.stop()
        acc = buf.accounting()
        assert acc["trained"] == 5 * 3 * 4
        assert "stale" not in acc["dropped"], acc["dropped"]
        assert calls_while_held == [0] * 5
        buf.check_conservation()
    asyncio.run(main())


def test_a_verifier_that_raises_stops_the_pipeline_after_max_failed_groups_with_its_reason():
    """Every reward raises: each group is dropped (counted under its reason), and after
    max_failed_groups in a row the waiting loop gets PipelineStalledError naming the pipeline
    and the reason, instead of waiting forever."""
    from rlix.errors import PipelineStalledError

    class Broken(PatternTask):
        def reward(self, prompt, text):  # type: ignore[no-untyped-def]
            return 1 / 0

    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = TrajectoryCollector(engine, Tok(), Broken(["a"], 4), buf, Hooks(),
                                  RolloutConfig(group_size=4, groups_per_step=3, max_new_tokens=5,
                                                concurrency=2), max_age=1, seed=1, max_failed_groups=5,
                                  pipeline="math")
        col.start()
        with pytest.raises(PipelineStalledError) as err:
            await asyncio.wait_for(col.wait_for(3), 10)
        await col.stop()
        msg = str(err.value)
        assert msg.startswith("pipeline math: 5 groups in a row failed") and "ZeroDivisionError" in msg
        dropped = buf.accounting()["dropped"]
        assert dropped.get("reward failed: ZeroDivisionError: division by zero", 0) >= 5 * 4
        buf.check_conservation()
    asyncio.run(main())


def test_one_good_group_resets_the_failure_streak():
    from rlix.errors import PipelineStalledError

    class Flaky(PatternTask):
        groups, last = 0, None

        def reward(self, prompt, text):  # type: ignore[no-untyped-def]
            if prompt is not Flaky.last:  # groups run one at a time (concurrency 1)
                Flaky.groups, Flaky.last = Flaky.groups + 1, prompt
            if Flaky.groups % 3 == 0:  # every third group succeeds: two fail in a row at most
                return 0.5
            raise ValueError("flaky verifier")

    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = TrajectoryCollector(engine, Tok(), Flaky(["a"], 4), buf, Hooks(),
                                  RolloutConfig(group_size=4, groups_per_step=2, max_new_tokens=5,
                                                concurrency=1), max_age=1, seed=1, max_failed_groups=3)
        col.start()
        try:
            await asyncio.wait_for(col.wait_for(2), 10)  # two good groups arrive: no stall
        except PipelineStalledError:
            pytest.fail("a streak interrupted by good groups must not stop the pipeline")
        finally:
            await col.stop()
    asyncio.run(main())


# -- rollout.length_tail: each sample's generation limit from a heavy-tailed distribution -------
LOGNORMAL = LengthTail(dist="lognormal", median=64, sigma=1.0, min=8)  # the documented example


def draws(tail: LengthTail, seed: int, cap: int = 1024, groups: int = 2500, size: int = 8) -> list[int]:
    return [length_limit(tail, cap, seed, g, i) for g in range(1, groups + 1) for i in range(size)]


def p(values: list[int], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@pytest.mark.parametrize("tail, tail_ratio", [
    (LOGNORMAL, 4.0),  # exp(2.33 sigma) = 10.2 uncapped
    (LengthTail(dist="pareto", median=64, alpha=1.5, min=8), 4.0),  # 50^(1/alpha) = 13.6 uncapped
])
def test_length_limits_are_reproducible_bounded_and_heavy_tailed(tail, tail_ratio):
    a, b, c = draws(tail, 7), draws(tail, 7), draws(tail, 8)
    assert a == b and a != c  # the seed decides them, nothing else
    assert min(a) >= 8 and max(a) <= 1024 and 1024 in a  # within [min, max_new_tokens], the cap reached
    assert 48 <= statistics.median(a) <= 80  # median near 64
    assert p(a, 99) / p(a, 50) >= tail_ratio  # most short, a few very long
    assert sum(x <= 128 for x in a) / len(a) >= 0.7
    # no tail: every sample may run to max_new_tokens
    assert {length_limit(None, 1024, 7, g, i) for g in range(5) for i in range(8)} == {1024}
    # a small cap clips the whole distribution into [min, cap]
    assert set(draws(tail, 7, cap=16, groups=50)) <= set(range(8, 17))


def test_requests_carry_their_drawn_length_limits_reproducibly():
    async def run(tail, seed=7, ignore_eos=False):  # type: ignore[no-untyped-def]
        buf, engine = ReplayBuffer(), FakeEngine()
        col = collector(engine, buf, Hooks(), seed=seed, max_new_tokens=300, length_tail=tail,
                        ignore_eos=ignore_eos)
        col.start()
        await col.wait_for(3)
        groups = buf.take(3, 0, 1)
        await col.stop()
        return engine, groups, col.stats()

    engine, groups, stats = asyncio.run(run(LOGNORMAL))
    # every request's max_tokens is the draw for its sample's place (seed -> group index, sample)
    expected = {sample_seed(7, g, i): length_limit(LOGNORMAL, 300, 7, g, i) for g in range(1, 50) for i in range(4)}
    assert engine.limits and all(engine.limits[s] == expected[s] for s in engine.limits)
    assert len(set(engine.limits.values())) > 3 and all(8 <= v <= 300 for v in engine.limits.values())
    for g in groups:  # the fake engine generates up to the limit: the trajectories are that long
        for t in g.trajectories:  # ids "g{seed}-{group index}-{sample}"
            index, i = (int(x) for x in t.id.split("-")[1:])
            assert len(t.response_ids) == length_limit(LOGNORMAL, 300, 7, index, i)
    assert stats["length_limits"]["n"] == len(engine.limits) and stats["length_limits"]["max"] <= 300
    again, _, _ = asyncio.run(run(LOGNORMAL))
    assert {s: v for s, v in again.limits.items() if s in engine.limits} == \
        {s: v for s, v in engine.limits.items() if s in again.limits}
    assert engine.ignore_eos == {False}  # the model may still end a sample before its limit
    plain, _, plain_stats = asyncio.run(run(None))  # no tail: today's requests
    assert set(plain.limits.values()) == {300} and "length_limits" not in plain_stats
    # rollout.ignore_eos: every request says so (samples run to their limit)
    assert asyncio.run(run(LOGNORMAL, ignore_eos=True))[0].ignore_eos == {True}


# -- the dataset task through the collector: chat-templated prompt ids, the row at the reward ----

def test_dataset_prompts_reach_the_engine_chat_templated_and_the_reward_sees_the_row(tmp_path, tiny_model_dir):
    import json

    from transformers import AutoTokenizer

    from rlix.envs import make_task

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rows = [{"question": f"What is {a}+{a}?", "answer": 2 * a, "bonus": a} for a in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rw.py").write_text("SEEN = []\n"
                                    "async def reward(response, row):\n"
                                    "    SEEN.append(row)\n"
                                    "    return row['bonus'] / 10\n")
    task = make_task({"name": "dataset", "path": str(tmp_path / "rows.jsonl"), "prompt_column": "question",
                      "system_prompt": "Be brief.", "reward": f"{tmp_path / 'rw.py'}:reward"})
    plain = make_task({"name": "dataset", "path": str(tmp_path / "rows.jsonl"), "prompt_column": "question",
                       "chat_template": False, "reward": f"{tmp_path / 'rw.py'}:reward"})

    async def main(task) -> list:  # type: ignore[no-untyped-def]
        buf, engine = ReplayBuffer(), FakeEngine()
        col = TrajectoryCollector(engine, tokenizer, task, buf, Hooks(),
                                  RolloutConfig(group_size=2, groups_per_step=2, max_new_tokens=3, concurrency=2),
                                  max_age=0, seed=3)
        col.start()
        await asyncio.wait_for(col.wait_for(2), 10)
        groups = buf.take(2, 0, 0)
        await col.stop()
        return groups, [list(ids) for ids, _, _ in engine.seen]

    def templated(question: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))

    seen = task.score.fn.__globals__["SEEN"]  # type: ignore[attr-defined]
    groups, sent = asyncio.run(main(task))
    assert sent and all(ids in [templated(r["question"]) for r in rows] for ids in sent)  # what the engine got
    for g in groups:
        row = next(r for r in rows if r["question"] == g.prompt)
        text = tokenizer.decode(templated(g.prompt))
        assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
        for t in g.trajectories:
            assert t.prompt_ids == templated(g.prompt)  # and what is trained
            assert t.reward == row["bonus"] / 10  # from the row's extra field
    assert seen and all(set(r) == {"question", "answer", "bonus"} for r in seen)
    groups, sent = asyncio.run(main(plain))  # chat_template: false: the text as it is
    assert all(ids in [tokenizer.encode(r["question"], add_special_tokens=False) for r in rows] for ids in sent)


def test_a_model_without_a_chat_template_drops_the_group_with_the_reason(tmp_path):
    from rlix.envs import Prompt

    class NoTemplate(Tok):
        def apply_chat_template(self, messages, **kw):  # type: ignore[no-untyped-def]
            raise ValueError("tokenizer.chat_template is not set")

    class Chat(PatternTask):
        def sample_prompt(self, rng):  # type: ignore[no-untyped-def]
            return Prompt("hi", "a", {}, [{"role": "user", "content": "hi"}])

    async def main() -> None:
        buf, engine = ReplayBuffer(), FakeEngine()
        col = TrajectoryCollector(engine, NoTemplate(), Chat(["a"], 4), buf, Hooks(),
                                  RolloutConfig(group_size=2, groups_per_step=1, concurrency=1),
                                  max_age=0, seed=1, max_failed_groups=2)
        col.start()
        with pytest.raises(Exception, match="chat template failed: ValueError: tokenizer.chat_template is not set"):
            await asyncio.wait_for(col.wait_for(1), 10)
        await col.stop()
        assert engine.calls == 0
    asyncio.run(main())


def test_stop_strings_end_samples_in_the_embedded_engine_and_cut_the_rewarded_text(tiny_model_dir):
    """The same seeds twice, through the engine server's generate (in-process, the embedded
    engine): without stop strings, then with one taken from the first run's text. The sample
    ends where its text first holds it (finish `stop`, its ids a prefix of the first run's),
    and the reward sees the text before it."""
    import httpx

    from rlix.inference.engine.engine import TorchEngine
    from rlix.inference.router.router import Generation
    from rlix.inference.server.app import create_app

    engine = TorchEngine.from_pretrained(tiny_model_dir, max_num_seqs=4)
    tokenizer = engine.tokenizer
    texts: list[str] = []

    class Recording(PatternTask):
        def reward(self, prompt, text):  # type: ignore[no-untyped-def]
            texts.append(text)
            return 0.5

    async def run(stop: list[str]) -> list:  # type: ignore[no-untyped-def]
        app = create_app(engine, tokenizer, "tiny", "k")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"Authorization": "Bearer k"}) as http:
            async def generate(ids, params, session):  # type: ignore[no-untyped-def]
                body = {"token_ids": ids, "sampling_params": params.model_dump(exclude_unset=True)}
                r = await http.post("/inference/v1/generate", json=body)
                assert r.status_code == 200, r.text
                return Generation.from_answer(r.json())

            buf = ReplayBuffer()
            col = TrajectoryCollector(generate, tokenizer, Recording(["a"], 4), buf, Hooks(),
                                      RolloutConfig(group_size=2, groups_per_step=1, max_new_tokens=40,
                                                    temperature=0.001, concurrency=1, ignore_eos=True,
                                                    stop=stop),
                                      max_age=0, seed=5)
            col.start()
            await asyncio.wait_for(col.wait_for(1), 60)
            groups = buf.take(1, 0, 0)
            await col.stop()
            return groups[0].trajectories

    try:
        full = asyncio.run(run([]))
        full_texts = list(texts)
        first = full_texts[0]
        stop = next(first[i:i + 2] for i in range(len(first) // 3, len(first) - 2) if first[i:i + 2].strip())
        texts.clear()
        cut = asyncio.run(run([stop, "\x00never"]))
    finally:
        engine.close()
    assert all(t.finish_reason == "length" and len(t.response_ids) == 40 for t in full)
    assert cut[0].finish_reason == "stop" and texts[0] == first[:first.find(stop)]
    assert cut[0].response_ids == full[0].response_ids[:len(cut[0].response_ids)] and len(cut[0].response_ids) < 40
    assert stop in tokenizer.decode(cut[0].response_ids, skip_special_tokens=True)
    for t, text in zip(cut, texts):  # every sample: cut before its first stop string
        assert stop not in text
