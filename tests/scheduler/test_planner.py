"""Behaviour of the planner on hand-built situations."""

from __future__ import annotations

import pytest

from rlix.errors import LedgerError
from rlix.scheduler.planning.planner import PlannerParams, plan, rollout_demand
from rlix.scheduler.planning.shares import Demand, rollout_targets
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import GpuRequest, PipelineSpec, Progress, Role, Stage, Topology

PARAMS = PlannerParams(dwell_s=30.0, aging_s=60.0)


def make(nodes=2, per_node=4, *specs: PipelineSpec) -> Ledger:
    led = Ledger(Topology.uniform(nodes, per_node))
    for s in specs:
        led.register(s)
    return led


def step(led: Ledger, now: float, requests=(), progress=None):
    p = plan(led, list(requests), progress or {}, now, PARAMS)
    led.apply(p, now)
    return p


def shard_counts(led: Ledger) -> dict[str, int]:
    return {n: len(led.shards_of(n)) for n in led.pipelines}


def test_idle_cluster_is_shared_evenly_and_fully():
    led = make(2, 4, PipelineSpec("a", max_shards=8), PipelineSpec("b", max_shards=8))
    step(led, 0.0)
    assert shard_counts(led) == {"a": 4, "b": 4}
    assert led.idle_gpus() == []


def test_training_request_preempts_rollout_and_release_gives_it_back():
    led = make(2, 4, PipelineSpec("a", train_gpus=4, max_shards=8), PipelineSpec("b", max_shards=8))
    step(led, 0.0)
    p = step(led, 100.0, [GpuRequest(1, "a", Stage.TRAIN, 4, 100.0)])
    assert [len(g.gpus) for g in p.grants] == [4]
    assert p.shrinks, "a training request on a full cluster must shrink shards"
    held = led.stage_holding("a", Stage.TRAIN)
    assert len({led.node_of[g] for g in held.gpus}) == 1, "4 GPUs fit on one node: keep them together"
    assert sum(shard_counts(led).values()) == 4
    led.release("a", Stage.TRAIN)
    p = step(led, 200.0)
    assert len(p.expands) == 4 and led.idle_gpus() == []


def test_stage_order_init_before_train_before_logprob():
    led = make(1, 4, *(PipelineSpec(n, train_gpus=4) for n in ("a", "b", "c")))
    reqs = [GpuRequest(1, "a", Stage.LOGPROB, 4, 0.0), GpuRequest(2, "b", Stage.TRAIN, 4, 1.0),
            GpuRequest(3, "c", Stage.INIT, 4, 2.0)]
    p = step(led, 3.0, reqs)
    assert [(g.pipeline, g.stage) for g in p.grants] == [("c", Stage.INIT)]
    led.release("c", Stage.INIT)
    p = step(led, 4.0, reqs[:2])
    assert [(g.pipeline, g.stage) for g in p.grants] == [("b", Stage.TRAIN)]


def test_priority_tier_served_first_then_weight_within_tier():
    led = make(2, 4, PipelineSpec("hi", priority=1, max_shards=8, min_shards=0),
               PipelineSpec("lo1", max_shards=8, weight=3.0), PipelineSpec("lo2", max_shards=8))
    step(led, 0.0, progress={"hi": Progress("hi", remaining=8 * 3, target=24)})
    counts = shard_counts(led)
    assert counts["hi"] == 3  # its whole demand, before the lower tier
    assert counts["lo1"] + counts["lo2"] == 5 and counts["lo1"] > counts["lo2"] >= 1


def test_demand_shares_are_proportional_to_remaining_demand():
    targets = rollout_targets([Demand("a", 12, 1, 0, 1.0, 0, 0), Demand("b", 4, 1, 0, 1.0, 0, 0)], 8)
    assert targets == {"a": 6, "b": 2}
    # demand below its fair share is capped and the rest flows to the others
    targets = rollout_targets([Demand("a", 12, 1, 0, 1.0, 0, 0), Demand("b", 1, 1, 0, 1.0, 0, 0)], 8)
    assert targets == {"a": 7, "b": 1}


def test_every_pipeline_with_demand_gets_a_shard_even_in_a_low_tier():
    led = make(1, 4, PipelineSpec("hi", priority=5, max_shards=8),
               PipelineSpec("lo", priority=0, max_shards=8))
    step(led, 0.0)
    assert shard_counts(led) == {"hi": 3, "lo": 1}


def test_pipeline_without_progress_report_keeps_its_place():
    spec = PipelineSpec("silent", max_shards=3)
    assert rollout_demand(spec, None) == 3
    led = make(1, 4, spec, PipelineSpec("chatty", max_shards=4))
    step(led, 0.0, progress={"chatty": Progress("chatty", remaining=100)})
    assert shard_counts(led)["silent"] >= 1


def test_new_shards_are_not_shrunk_within_dwell_time_but_training_overrides():
    led = make(1, 4, PipelineSpec("a", train_gpus=2, max_shards=4), PipelineSpec("b", max_shards=4))
    step(led, 0.0, progress={"a": Progress("a", remaining=0)})
    assert shard_counts(led) == {"a": 0, "b": 4}  # no demand, no shard; b takes the idle GPUs
    # a's demand comes back 10 s later: b's shards are fresh, so a gets only its first shard
    # (the floor overrides dwell) and the rest waits for the dwell time to pass...
    prog = {"a": Progress("a", remaining=32)}
    p = step(led, 10.0, progress=prog)
    assert shard_counts(led) == {"a": 1, "b": 3} and p.wake_at == pytest.approx(30.0)
    # ...after it the shares are rebalanced...
    p = step(led, 31.0, progress=prog)
    assert shard_counts(led) == {"a": 2, "b": 2} and len(p.shrinks) == 1
    # ...and a training request takes fresh shards at once.
    p = step(led, 32.0, [GpuRequest(7, "a", Stage.TRAIN, 2, 32.0)], progress=prog)
    assert p.grants and p.shrinks


def test_preempts_least_loaded_shards_first():
    led = make(1, 4, PipelineSpec("a", train_gpus=1, max_shards=4), PipelineSpec("b", max_shards=4))
    prog = {"b": Progress("b", remaining=100, shard_load={})}
    step(led, 0.0, progress=prog)
    b_shards = led.shards_of("b")
    loads = {rank: 10 for rank in b_shards}
    idle_rank = min(b_shards)
    loads[idle_rank] = 0
    a_ranks = list(led.shards_of("a"))
    prog = {"b": Progress("b", remaining=100, shard_load=loads),
            "a": Progress("a", remaining=100, shard_load={r: 50 for r in a_ranks})}
    p = step(led, 100.0, [GpuRequest(1, "a", Stage.TRAIN, 1, 100.0)], progress=prog)
    # No idle GPU: a's own shard (partial overlap) is the cheapest to sleep for its training;
    # the fair share then moves one of b's shards to a, and it is b's idle one.
    assert [(s.pipeline, s.dp_rank) for s in p.shrinks] == [("a", a_ranks[0]), ("b", idle_rank)]


def test_aged_request_is_not_starved_by_a_stream_of_small_ones():
    """Without ageing, 'big' (8 GPUs) never sees 8 free GPUs: 'x' and 'y' alternate 4-GPU holds."""
    params = PlannerParams(dwell_s=0.0, aging_s=50.0)
    led = make(2, 4, PipelineSpec("big", train_gpus=8), PipelineSpec("x", train_gpus=4),
               PipelineSpec("y", train_gpus=4))
    pending = {"big": GpuRequest(0, "big", Stage.TRAIN, 8, 0.0)}
    rid, now, granted_at = 1, 0.0, None
    led.apply(plan(led, [], {}, now, params), now)
    pending["x"] = GpuRequest(rid, "x", Stage.INIT, 4, now)  # INIT outranks big's TRAIN
    rid += 1
    while now < 400 and granted_at is None:
        p = plan(led, list(pending.values()), {}, now, params)
        led.apply(p, now)
        for g in p.grants:
            del pending[g.pipeline]
            if g.pipeline == "big":
                granted_at = now
        now += 10.0
        # x and y keep overlapping 4-GPU holds of 20 s, each re-requesting right after release
        for name in ("x", "y"):
            h = led.stage_holding(name, Stage.INIT)
            if h is not None and now - h.since >= 20.0:
                led.release(name, Stage.INIT)
            if led.stage_holding(name, Stage.INIT) is None and name not in pending:
                pending[name] = GpuRequest(rid, name, Stage.INIT, 4, now)
                rid += 1
    assert granted_at is not None, "the 8-GPU request starved"
    assert granted_at <= params.aging_s + 3 * 20.0 + 10.0


def test_training_waits_until_aged_rather_than_take_a_peers_last_shard():
    """Rollout floor reservation: same tier waits (bounded by aging_s), a higher tier does not."""
    led = make(1, 4, PipelineSpec("a", train_gpus=4, max_shards=4), PipelineSpec("b", max_shards=4))
    step(led, 0.0)
    req = GpuRequest(1, "a", Stage.TRAIN, 4, 100.0)
    p = step(led, 100.0, [req])
    assert not p.grants and p.wake_at == pytest.approx(100.0 + PARAMS.aging_s)
    p = step(led, 100.0 + PARAMS.aging_s, [req])
    assert [g.pipeline for g in p.grants] == ["a"] and not led.shards_of("b")

    led = make(1, 4, PipelineSpec("a", priority=1, train_gpus=4, max_shards=4),
               PipelineSpec("b", max_shards=4))
    step(led, 0.0)
    assert [g.pipeline for g in step(led, 100.0, [req]).grants] == ["a"]


def test_a_replan_timed_for_an_ageing_deadline_finds_it_aged_in_floats():
    """The deadline submitted_at + aging_s computed in floats can come out a hair short of
    aging_s again; the re-plan at that instant must grant, not plan a timer for `now` (a timer
    not in the future is never armed, and one due later was lost behind it)."""
    submitted = 86.55341358101067
    now = submitted + PARAMS.aging_s
    assert now - submitted < PARAMS.aging_s  # the float case itself
    led = make(1, 4, PipelineSpec("a", train_gpus=4, max_shards=4), PipelineSpec("b", max_shards=4))
    step(led, 0.0)
    req = GpuRequest(1, "a", Stage.TRAIN, 4, submitted)
    assert not step(led, submitted, [req]).grants
    p = step(led, now, [req])
    assert [g.pipeline for g in p.grants] == ["a"]
    assert p.wake_at is None or p.wake_at > now


def test_a_peers_last_shard_on_the_trainers_home_moves_to_an_idle_gpu_at_once():
    """The floor reservation protects a pipeline from having no shard, not a GPU: when idle
    GPUs elsewhere can take that shard in the same plan, a fixed-home training request does not
    wait for aging (agentic bench: 10 s waits beside an idle GPU)."""
    led = make(1, 2, PipelineSpec("a", train_gpus=1, max_shards=1, fixed_trainer=True),
               PipelineSpec("b", max_shards=2, fixed_trainer=True))
    prog = {"a": Progress("a", remaining=0, target=8), "b": Progress("b", remaining=8, target=8)}
    led.last_shard_gpus[("b", 0)] = (0,)  # b's engine was last on a's home: it wakes there
    step(led, 0.0, progress=prog)
    assert led.train_home["a"] == frozenset({0}) and [h.gpus for h in led.shards_of("b").values()] == [(0,)]
    p = step(led, 100.0, [GpuRequest(1, "a", Stage.TRAIN, 1, 100.0)], prog)
    assert [(g.pipeline, g.gpus) for g in p.grants] == [("a", (0,))]
    assert [h.gpus for h in led.shards_of("b").values()] == [(1,)]  # b keeps a shard, on GPU 1
    # with no idle GPU to go to, the reservation still holds until the request ages
    led = make(1, 2, PipelineSpec("a", train_gpus=1, max_shards=1, fixed_trainer=True),
               PipelineSpec("b", max_shards=1, fixed_trainer=True), PipelineSpec("c", max_shards=1))
    prog["c"] = Progress("c", remaining=8, target=8)
    step(led, 0.0, progress=prog)
    if [h.gpus for h in led.shards_of("b").values()] == [(0,)]:
        assert not step(led, 100.0, [GpuRequest(2, "a", Stage.TRAIN, 1, 100.0)], prog).grants


def test_a_training_pipeline_yields_its_shard_to_the_peer_whose_last_shard_sits_on_its_home():
    """Two pipelines, two GPUs, one shard each, crossed: b's only shard on a's home, a's on b's.
    a asks to train: its own shard (it stops generating to train anyway) makes way for b's, so
    the grant is immediate instead of waiting aging_s (agentic CPU bench: 6-10 s waits a step)."""
    spec = dict(train_gpus=1, max_shards=1, fixed_trainer=True)
    led = make(1, 2, PipelineSpec("a", **spec), PipelineSpec("b", **spec))
    prog = {n: Progress(n, remaining=8, target=8) for n in ("a", "b")}
    home_a, home_b = next(iter(led.train_home["a"])), next(iter(led.train_home["b"]))
    led.last_shard_gpus[("a", 0)] = (home_b,)  # each engine was last on the other's home
    led.last_shard_gpus[("b", 0)] = (home_a,)
    step(led, 0.0, progress=prog)
    assert [h.gpus for h in led.shards_of("b").values()] == [(home_a,)]
    assert [h.gpus for h in led.shards_of("a").values()] == [(home_b,)]
    p = step(led, 100.0, [GpuRequest(1, "a", Stage.TRAIN, 1, 100.0)], prog)
    assert [(g.pipeline, g.gpus) for g in p.grants] == [("a", (home_a,))]
    assert [h.gpus for h in led.shards_of("b").values()] == [(home_b,)]  # b keeps generating
    assert not led.shards_of("a")  # a trains; it gets a shard back when it releases
    led.release("a", Stage.TRAIN)
    step(led, 110.0, progress=prog)
    assert shard_counts(led) == {"a": 1, "b": 1}


def test_a_new_shard_avoids_other_pipelines_training_homes():
    """A shard placed on a peer's training home is preempted by every one of that peer's train
    steps; given the choice, a shard goes where no trainer lives, then to its own home."""
    led = make(1, 2, PipelineSpec("a", max_shards=1, fixed_trainer=True),
               PipelineSpec("b", max_shards=1, fixed_trainer=True))
    step(led, 0.0)
    for name in ("a", "b"):
        assert [h.gpus for h in led.shards_of(name).values()] == [tuple(led.train_home[name])]
    # a GPU outside every home goes first
    led = make(1, 3, PipelineSpec("a", max_shards=1, fixed_trainer=True),
               PipelineSpec("b", max_shards=1, fixed_trainer=True))
    homes = led.train_home["a"] | led.train_home["b"]
    step(led, 0.0, progress={"a": Progress("a", remaining=8, target=8), "b": Progress("b", remaining=0, target=8)})
    assert [set(h.gpus) & homes for h in led.shards_of("a").values()] == [set()]


def test_a_pipeline_whose_only_shards_sit_on_peers_homes_moves_one_home_when_its_own_is_free():
    """Three fixed homes on four GPUs. a's only shard sits on b's home (a trained meanwhile): b's
    next train step would preempt it mid-generation, with a's own home lent to a third pipeline.
    Once a's home is free, a's shard moves home, waking the engine a has there; a shard a borrows
    beside one at home, or one on the GPU that is nobody's home, stays where it is."""
    from rlix.scheduler.types import Plan, ShardMove

    spec = dict(train_gpus=1, max_shards=2, fixed_trainer=True)
    led = make(1, 4, PipelineSpec("a", **spec), PipelineSpec("b", **spec), PipelineSpec("c", **spec))
    home = {n: next(iter(led.train_home[n])) for n in "abc"}
    free = (set(range(4)) - set(home.values())).pop()  # nobody's home
    led.last_shard_gpus[("a", 0)] = (home["a"],)  # a's engine at home sleeps there
    led.apply(Plan(expands=[ShardMove("a", 1, (home["b"],)), ShardMove("b", 0, (free,)),
                            ShardMove("c", 0, (home["c"],))]), 0.0)
    prog = {n: Progress(n, remaining=8, target=8) for n in "abc"}  # one shard's worth each
    assert step(led, 10.0, progress=prog).shrinks == []  # woken within dwell_s: it stays
    p = step(led, 100.0, progress=prog)
    assert [(m.pipeline, m.gpus) for m in p.shrinks] == [("a", (home["b"],))]
    assert ("a", 0, (home["a"],)) in [(m.pipeline, m.dp_rank, m.gpus) for m in p.expands]
    assert [h.gpus for h in led.shards_of("a").values()] == [(home["a"],)]
    # at home, nothing moves again; a shard on nobody's home never moves for this
    assert step(led, 200.0, progress=prog).shrinks == []
    led = make(1, 4, PipelineSpec("a", **spec), PipelineSpec("b", **spec), PipelineSpec("c", **spec))
    led.apply(Plan(expands=[ShardMove("a", 1, (free,)), ShardMove("b", 0, (home["b"],)),
                            ShardMove("c", 0, (home["c"],))]), 0.0)
    assert step(led, 100.0, progress=prog).shrinks == []


def test_pending_work_keeps_one_shard_whatever_the_figure_says():
    led = make(1, 2, PipelineSpec("a", max_shards=2), PipelineSpec("b", max_shards=2))
    step(led, 0.0)
    busy = {"a": Progress("a", remaining=64), "b": Progress("b", remaining=0, pending_work=True)}
    for t in (100.0, 200.0, 300.0):  # long past the dwell time
        step(led, t, progress=busy)
        assert shard_counts(led) == {"a": 1, "b": 1}
    step(led, 400.0, progress={**busy, "b": Progress("b", remaining=0)})  # without the evidence
    assert shard_counts(led) == {"a": 2, "b": 0}
    assert rollout_demand(PipelineSpec("c", max_shards=4),
                          Progress("c", remaining=0, pending_work=True)) == 1


def test_a_stale_report_counts_as_none_and_the_plan_wakes_when_it_goes_stale():
    params = PlannerParams(dwell_s=0.0, aging_s=60.0, report_stale_s=50.0)
    led = make(1, 2, PipelineSpec("a", max_shards=2), PipelineSpec("b", max_shards=2))
    reports = {"a": Progress("a", remaining=64, reported_at=0.0),
               "b": Progress("b", remaining=0, reported_at=10.0)}
    p = plan(led, [], reports, 20.0, params)
    led.apply(p, 20.0)
    assert shard_counts(led) == {"a": 2, "b": 0} and p.wake_at == pytest.approx(60.0)
    led.apply(plan(led, [], reports, 61.0, params), 61.0)  # b's "0" is 51 s old: unknown
    assert shard_counts(led) == {"a": 1, "b": 1}
    spec = PipelineSpec("c", max_shards=4)
    old = Progress("c", remaining=0, reported_at=0.0)
    assert rollout_demand(spec, old, 49.0, 50.0) == 0 and rollout_demand(spec, old, 51.0, 50.0) == 4


def test_the_floor_rotates_after_rotate_s_and_ties_go_by_registration_not_name():
    params = PlannerParams(dwell_s=10.0, aging_s=60.0, rotate_s=100.0)
    specs = [PipelineSpec(n) for n in ("z", "y", "x")]  # registered z, y, x: names reversed
    led = make(1, 2, *specs)
    want = {n: Progress(n, remaining=8) for n in ("z", "y", "x")}
    p = plan(led, [], want, 0.0, params)
    led.apply(p, 0.0)
    assert shard_counts(led) == {"z": 1, "y": 1, "x": 0} and p.wake_at == pytest.approx(100.0)
    led.apply(plan(led, [], want, 50.0, params), 50.0)
    assert shard_counts(led) == {"z": 1, "y": 1, "x": 0}  # holders keep theirs within rotate_s
    led.apply(plan(led, [], want, 100.0, params), 100.0)
    # both spells are over; x (waiting longest) takes the shard of the later-registered holder
    assert shard_counts(led) == {"z": 1, "y": 0, "x": 1}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prices_kept_across_passes_give_the_same_plans_as_pricing_from_scratch(seed):
    """NodePrices re-prices only the nodes that changed: every plan of a random stream must be
    what a planner without that memory decides."""
    import random

    def stream(fresh: bool) -> list[str]:
        rng = random.Random(seed)
        led = Ledger(Topology.uniform(6, 4))
        for i in range(10):
            led.register(PipelineSpec(f"p{i}", priority=rng.choice([0, 0, 1]), train_gpus=rng.choice([2, 4, 8]),
                                      tp=rng.choice([1, 1, 2]), max_shards=rng.choice([2, 4, 8]),
                                      partial_overlap=rng.random() < 0.8, seqs_per_shard=4))
        now, rid, out = 0.0, 0, []
        pending: dict[str, GpuRequest] = {}
        progress: dict[str, Progress] = {}
        for _ in range(300):
            now += rng.expovariate(1.0)
            kind, name = rng.choice(["progress"] * 3 + ["request", "release"]), rng.choice(list(led.pipelines))
            if kind == "progress":
                progress[name] = Progress(name, remaining=rng.randint(0, 40), reported_at=now,
                                          shard_load={r: rng.randint(0, 9) for r in led.shards_of(name)})
            elif kind == "request" and name not in pending and led.stage_holding(name, Stage.TRAIN) is None:
                pending[name] = GpuRequest(rid, name, Stage.TRAIN, led.pipelines[name].train_gpus, now)
                rid += 1
            elif kind == "release":
                held = sorted((h.pipeline, h.stage) for h in led.holdings.values() if h.role is Role.TRAIN)
                if held:
                    led.release(*rng.choice(held))
            if fresh:
                led.price_cache = None
            p = plan(led, list(pending.values()), progress, now, PARAMS)
            led.apply(p, now)
            out.append(p.summary() + f" wake={p.wake_at}")
            for g in p.grants:
                pending.pop(g.pipeline, None)
        return out

    kept, scratch = stream(False), stream(True)
    assert kept == scratch
    assert sum("grant" in s for s in kept) > 10 and sum("shrink" in s for s in kept) > 10


def test_a_free_gpu_gets_a_rank_that_never_ran_not_the_one_sleeping_on_a_busy_gpu():
    """b's rank 0 sleeps on GPU 0, which b's trainer holds; GPU 1 comes free. A shard process
    cannot change devices: moving rank 0 would start it anew on GPU 1 and lose the engine that
    wakes in ~30 ms on GPU 0 once b has trained. Rank 1 (never ran) starts on GPU 1 instead, and
    rank 0 wakes in place afterwards. With slices (one device) the move keeps its process."""
    for slices, expect in ((1, 1), (2, 0)):
        led = Ledger(Topology((2,), slices=slices))
        led.register(PipelineSpec("b", max_shards=2))
        led.register(PipelineSpec("a", max_shards=1))
        prog = {"b": Progress("b", remaining=16, target=16), "a": Progress("a", remaining=0, target=8)}
        led.last_shard_gpus[("b", 0)] = (0,)
        step(led, 0.0, [GpuRequest(1, "b", Stage.TRAIN, 1, 0.0)], prog)
        assert led.stage_holding("b", Stage.TRAIN).gpus == (0,)
        assert [(r, h.gpus) for r, h in led.shards_of("b").items()] == [(expect, (1,))], slices
        if slices == 1:
            led.release("b", Stage.TRAIN)
            step(led, 10.0, progress=prog)
            assert sorted((r, h.gpus) for r, h in led.shards_of("b").items()) == [(0, (0,)), (1, (1,))]


# ---------------------------------------------------------------------- move costs (issue 35)
# Default table: a move (sleep 0.3 + wake 0.1 + graph recapture 0.6) costs 1 s, x margin 2: a
# move must buy 2 shard-seconds of work; with a process start (15 s) 32.
COSTS = PARAMS.move_costs


def rated(name: str, remaining: int, spt: float | None, at: float = 0.0) -> Progress:
    return Progress(name, remaining=remaining, target=remaining, reported_at=at,
                    seconds_per_trajectory=spt)


def two_on_four(b_spt: float | None, a_spt: float | None = 1.0, a_left: int = 64):
    """a holds 3 of 4 GPUs, b one (its floor); b's demand wants a second shard of a's."""
    led = make(1, 4, PipelineSpec("a", max_shards=4), PipelineSpec("b", max_shards=4))
    step(led, 0.0, progress={"a": rated("a", 64, a_spt), "b": rated("b", 0, b_spt)})
    assert shard_counts(led) == {"a": 4, "b": 0}
    prog = {"a": rated("a", a_left, a_spt, 10.0), "b": rated("b", 32, b_spt, 10.0)}
    step(led, 10.0, progress=prog)  # b's first shard: the floor, whatever it costs
    assert shard_counts(led) == {"a": 3, "b": 1}
    return led, prog


def test_move_costs_defaults_and_the_work_a_move_needs():
    assert (COSTS.sleep_s, COSTS.wake_sync_s, COSTS.cold_start_s, COSTS.margin) == (0.3, 0.1, 15.0, 2.0)
    assert COSTS.margin * (COSTS.sleep_s + COSTS.wake_s) == pytest.approx(2.0)
    assert rated("x", 10, 0.5).work_s() == pytest.approx(5.0) and rated("x", 10, None).work_s() is None


def test_a_shard_is_not_taken_for_less_work_than_the_move_costs():
    # b: 32 trajectories x 0.1 s = 3.2 shard-s over 2 shards = 1.6 s < margin x 1 s: no move
    led, prog = two_on_four(b_spt=0.1)
    p = step(led, 100.0, progress=prog)
    assert p.is_empty() and shard_counts(led) == {"a": 3, "b": 1}
    # rate unknown: today's behaviour, the fair share moves a shard at once
    led, prog = two_on_four(b_spt=None)
    p = step(led, 100.0, progress=prog)
    assert len(p.shrinks) == 1 and shard_counts(led) == {"a": 2, "b": 2}


def test_a_shard_is_taken_when_the_work_repays_the_move_and_a_start_only_when_it_repays_that():
    # 32 x 0.2 s over 2 shards = 3.2 s: repays a wake (2 s) but not a process start (32 s);
    # b's rank 1 never ran, so it would start anew: refused
    led, prog = two_on_four(b_spt=0.2)
    assert step(led, 100.0, progress=prog).is_empty()
    # ... unless one of its ranks has an engine on a GPU of a's: that one is woken there
    led, prog = two_on_four(b_spt=0.2)
    gpu = sorted(h.gpus for h in led.shards_of("a").values())[-1]
    led.last_shard_gpus[("b", 1)] = gpu
    p = step(led, 100.0, progress=prog)
    assert [s.gpus for s in p.shrinks] == [gpu] and [(e.dp_rank, e.gpus) for e in p.expands] == [(1, gpu)]
    # 32 x 2.5 s over 2 shards = 40 s: repays even a process start
    led, prog = two_on_four(b_spt=2.5)
    p = step(led, 100.0, progress=prog)
    assert len(p.shrinks) == 1 and shard_counts(led) == {"a": 2, "b": 2}


def test_an_idle_gpu_is_filled_however_little_work_it_gets():
    led = make(1, 4, PipelineSpec("a", max_shards=2), PipelineSpec("b", max_shards=4))
    prog = {"a": rated("a", 64, 1.0), "b": rated("b", 16, 0.001)}
    step(led, 0.0, progress=prog)
    assert shard_counts(led) == {"a": 2, "b": 2} and led.idle_gpus() == []


def test_a_pipeline_about_to_finish_keeps_its_shards_but_not_a_peers_first_one():
    # a: 8 trajectories x 0.5 s = 4 s over its 3 shards (1.3 s each) ends before a move repays
    led, prog = two_on_four(b_spt=2.5, a_left=8, a_spt=0.5)
    assert step(led, 100.0, progress=prog).is_empty()
    # a's rate unknown: a's shard goes to b as before
    led, prog = two_on_four(b_spt=2.5, a_left=8, a_spt=None)
    assert len(step(led, 100.0, progress=prog).shrinks) == 1
    # b's first shard is the floor: taken from a even though a is about to finish
    led = make(1, 2, PipelineSpec("a", max_shards=2), PipelineSpec("b", max_shards=2))
    step(led, 0.0, progress={"a": rated("a", 64, 1.0), "b": rated("b", 0, 1.0)})
    p = step(led, 100.0, progress={"a": rated("a", 2, 0.5, 100.0), "b": rated("b", 16, 1.0, 100.0)})
    assert shard_counts(led) == {"a": 1, "b": 1} and len(p.shrinks) == 1


def test_a_busy_shard_is_not_taken_for_a_peers_second_shard_until_idle_or_held_rotate_s():
    # b wants a second shard of a's and its work repays the move (32 x 2.5 s over 2 shards)
    led, prog = two_on_four(b_spt=2.5)
    a_ranks = sorted(h.dp_rank for h in led.shards_of("a").values())
    busy = dict(prog, a=Progress("a", remaining=64, target=64, reported_at=10.0, seconds_per_trajectory=1.0,
                                 shard_load={r: 8 for r in a_ranks}))
    p = plan(led, [], busy, 100.0, PARAMS)
    assert p.shrinks == [] and p.expands == []  # every shard of a has requests running
    held_since = min(h.since for h in led.shards_of("a").values())
    assert p.wake_at == pytest.approx(held_since + PARAMS.rotate_s)  # the bound: then it may go
    # one of a's shards went idle: that one is lent
    idle = dict(busy, a=Progress("a", remaining=64, target=64, reported_at=20.0, seconds_per_trajectory=1.0,
                                 shard_load={r: (0 if r == a_ranks[-1] else 8) for r in a_ranks}))
    p = step(led, 100.0, progress=idle)
    assert [s.dp_rank for s in p.shrinks] == [a_ranks[-1]] and shard_counts(led) == {"a": 2, "b": 2}
    # held for rotate_s, a busy shard goes too; and a higher tier never waits for it
    led, prog = two_on_four(b_spt=2.5)
    p = step(led, held_since + PARAMS.rotate_s, progress=busy)
    assert len(p.shrinks) == 1 and shard_counts(led) == {"a": 2, "b": 2}
    led = make(1, 4, PipelineSpec("a", max_shards=4), PipelineSpec("b", max_shards=4, priority=1))
    step(led, 0.0, progress={"a": rated("a", 64, 1.0), "b": rated("b", 0, 2.5)})
    step(led, 10.0, progress={"a": rated("a", 64, 1.0, 10.0), "b": rated("b", 32, 2.5, 10.0)})
    p = step(led, 100.0, progress=dict(busy, b=rated("b", 64, 2.5, 10.0)))
    assert shard_counts(led)["b"] > 1 and p.shrinks


def test_a_training_home_about_to_be_wanted_back_is_not_filled_and_the_plan_wakes_after():
    def run(t_spt):
        led = make(1, 3, PipelineSpec("t", train_gpus=1, max_shards=1, fixed_trainer=True),
                   PipelineSpec("c", max_shards=2))
        home = next(iter(led.train_home["t"]))
        others = [g for g in range(3) if g != home]
        # t generates on another GPU and has 1 trajectory x 0.5 s left: its train step comes
        # within a move's worth, and a second shard of c's on its home would sleep again at once
        led.last_shard_gpus[("t", 0)] = (others[0],)
        led.last_shard_gpus[("c", 0)] = (others[1],)
        step(led, 0.0, progress={"t": rated("t", 64, t_spt), "c": rated("c", 8, 1.0)})
        assert shard_counts(led) == {"t": 1, "c": 1} and led.idle_gpus() == [home]
        prog = {"t": rated("t", 1, t_spt, 5.0), "c": rated("c", 64, 1.0, 5.0)}
        return led, home, step(led, 5.0, progress=prog)

    led, home, p = run(0.5)
    assert shard_counts(led) == {"t": 1, "c": 1} and led.idle_gpus() == [home]
    assert p.wake_at == pytest.approx(5.0 + 0.5 + 2.0)  # when that estimate has run out
    led, home, p = run(None)  # t's rate unknown: the idle GPU is filled, as before
    assert shard_counts(led) == {"t": 1, "c": 2} and led.idle_gpus() == []


def test_a_trainers_request_is_not_delayed_by_move_costs():
    led, prog = two_on_four(b_spt=0.1)
    p = step(led, 100.0, [GpuRequest(1, "b", Stage.TRAIN, 2, 100.0)], progress=prog)
    assert [(g.pipeline, len(g.gpus)) for g in p.grants] == [("b", 2)]


def test_a_rate_that_is_not_a_positive_number_is_refused():
    from rlix.errors import SchedulerError
    from rlix.scheduler.core import SchedulerCore

    core = SchedulerCore(Topology.uniform(1, 2))
    core.register(PipelineSpec("a"))
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(SchedulerError, match="seconds_per_trajectory"):
            core.report_progress(Progress("a", remaining=4, seconds_per_trajectory=bad))
    core.report_progress(Progress("a", remaining=4, seconds_per_trajectory=0.25))


def test_the_cost_table_is_read_from_a_file_and_a_bad_one_names_the_field(tmp_path):
    from rlix.errors import ConfigError
    from rlix.scheduler.costs import MoveCosts, load_move_costs, save_move_costs

    path = save_move_costs(tmp_path / "costs.json", MoveCosts(sleep_s=0.05, cold_start_s=11.0), "test")
    assert load_move_costs(path) == MoveCosts(sleep_s=0.05, cold_start_s=11.0)
    (tmp_path / "bad.yaml").write_text("costs:\n  sleep_s: 0.1\n  wake_s: 0.2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: costs.wake_s: unknown field"):
        load_move_costs(tmp_path / "bad.yaml")
    (tmp_path / "neg.yaml").write_text("costs:\n  margin: -1\n")
    with pytest.raises(ConfigError, match=r"costs.margin: Input should be greater than or equal to 0"):
        load_move_costs(tmp_path / "neg.yaml")
    (tmp_path / "top.yaml").write_text("costs: {}\nwhen: today\n")
    with pytest.raises(ConfigError, match=r"top.yaml: when: unknown field"):
        load_move_costs(tmp_path / "top.yaml")
    # read with the config's bounded loader: a duplicate key and an alias bomb are refused
    (tmp_path / "dup.yaml").write_text("costs:\n  sleep_s: 0.1\n  sleep_s: 0.2\n")
    with pytest.raises(ConfigError, match=r"sleep_s"):
        load_move_costs(tmp_path / "dup.yaml")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    (tmp_path / "bomb.yaml").write_text(bomb + "costs: {}\n")
    with pytest.raises(ConfigError):
        load_move_costs(tmp_path / "bomb.yaml")


def test_no_further_shard_goes_where_the_pipelines_engine_is_still_starting():
    """A pipeline alone on 4 idle GPUs whose engines on GPUs 2 and 3 are still starting gets its
    first shard anywhere and further ones only on GPUs 0 and 1 (a shard on 2 or 3 would hold
    the GPU without generating until the start ends); once the report says they are up, it
    gets them too."""
    led = make(1, 4, PipelineSpec("a", max_shards=4))
    led.note_engines_starting("a", frozenset({2, 3}))
    step(led, 0.0, progress={"a": Progress("a", remaining=64, target=64, engines_starting=frozenset({2, 3}))})
    assert sorted(g for h in led.shards_of("a").values() for g in h.gpus) == [0, 1]
    led.note_engines_starting("a", frozenset())
    step(led, 1.0, progress={"a": Progress("a", remaining=64, target=64)})
    assert sorted(g for h in led.shards_of("a").values() for g in h.gpus) == [0, 1, 2, 3]
    # the first shard is never held back: its pipeline would otherwise have nothing
    led = make(1, 2, PipelineSpec("b", max_shards=2))
    led.note_engines_starting("b", frozenset({0, 1}))
    step(led, 0.0)
    assert shard_counts(led) == {"b": 1}


def test_engines_starting_on_gpus_that_do_not_exist_are_refused():
    led = make(1, 2, PipelineSpec("a", max_shards=2))
    with pytest.raises(LedgerError, match="do not exist"):
        led.note_engines_starting("a", frozenset({5}))
    assert led.engines_starting == {}
