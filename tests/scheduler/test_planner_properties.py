"""Stateful property test of the scheduler core (ledger + planner + request bookkeeping).

Random registrations, non-rollout requests, releases, progress reports, pipeline deaths and
time passing. The harness plans after every event (as the service does) and at the plan's
`wake_at`. After every step: the ledger's invariants hold, no GPU leaks, rollout is
work-conserving, every pipeline with demand has a shard when the cluster can hold one each,
and no request has waited longer than the documented bound aging_s + P * H.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.planning.planner import PlannerParams, rollout_demand
from rlix.scheduler.types import PipelineSpec, Progress, Role, Stage, Topology

NODES, PER_NODE = 2, 4
TOTAL = NODES * PER_NODE
MAX_PIPELINES = 5
HOLD_S = 50.0  # the harness's pipelines hold a non-rollout stage at most this long
PARAMS = PlannerParams(dwell_s=15.0, aging_s=40.0)
NAMES = [f"p{i}" for i in range(8)]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core = SchedulerCore(Topology.uniform(NODES, PER_NODE), PARAMS, clock=lambda: self.now)
        self.ledger = self.core.ledger
        self.wake_at: float | None = None
        self.max_pipelines_seen = 0
        self.worst_wait = 0.0

    # ------------------------------------------------------------------ harness
    def replan(self) -> None:
        pending = dict(self.core.pending)
        p = self.core.replan("property test")
        for g in p.grants:
            req = pending[g.request_id]
            assert (req.pipeline, req.gpus) == (g.pipeline, len(g.gpus))
            assert g.request_id not in self.core.pending
            self.worst_wait = max(self.worst_wait, self.now - req.submitted_at)
        self.wake_at = p.wake_at
        self.check_after_plan()

    def advance(self, dt: float) -> None:
        """Move the clock, stopping at every forced release and every wake-up the plan asked for."""
        end = self.now + dt
        while True:
            deadlines = [h.since + HOLD_S for h in self.ledger.holdings.values() if h.role is Role.TRAIN]
            if self.wake_at is not None and self.wake_at > self.now:
                deadlines.append(self.wake_at)
            nxt = min([t for t in deadlines if t <= end], default=None)
            if nxt is None:
                self.now = end
                return
            self.now = max(self.now, nxt)
            for h in list(self.ledger.holdings.values()):
                if h.role is Role.TRAIN and h.since + HOLD_S <= self.now:
                    self.core.release(h.pipeline, h.stage)
            self.replan()

    def bound(self) -> float:
        return PARAMS.aging_s + max(1, self.max_pipelines_seen) * HOLD_S

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.ledger.pipelines) < MAX_PIPELINES)
    @rule(idx=st.integers(0, len(NAMES) - 1), priority=st.integers(0, 2),
          weight=st.sampled_from([0.5, 1.0, 2.0]), train=st.integers(1, TOTAL),
          tp=st.sampled_from([1, 1, 2]), max_shards=st.integers(1, 6),
          min_shards=st.integers(0, 2), overlap=st.booleans(), per_shard=st.integers(1, 8))
    def register(self, idx, priority, weight, train, tp, max_shards, min_shards, overlap, per_shard):
        name = NAMES[idx]
        if name in self.ledger.pipelines:
            return
        if not overlap and train > TOTAL - tp:
            train = TOTAL - PER_NODE  # leave a node for its shards
        spec = PipelineSpec(name, priority=priority, weight=weight, train_gpus=train, tp=tp,
                            min_shards=min(min_shards, max_shards), max_shards=max_shards,
                            partial_overlap=overlap, seqs_per_shard=per_shard)
        self.core.register(spec)
        self.max_pipelines_seen = max(self.max_pipelines_seen, len(self.ledger.pipelines))
        self.replan()

    @precondition(lambda self: self.ledger.pipelines)
    @rule(data=st.data(), stage=st.sampled_from([Stage.INIT, Stage.TRAIN, Stage.LOGPROB]))
    def request(self, data, stage):
        name = data.draw(st.sampled_from(sorted(self.ledger.pipelines)))
        spec = self.ledger.pipelines[name]
        busy = any(r.pipeline == name for r in self.core.pending.values()) or any(
            h.pipeline == name and h.role is Role.TRAIN for h in self.ledger.holdings.values())
        if busy:
            return  # the core refuses a second non-rollout stage; test_core.py checks that
        gpus = spec.train_gpus if name in self.ledger.train_home else data.draw(st.integers(1, TOTAL))
        self.core.submit_request(name, stage, gpus)
        self.replan()

    @precondition(lambda self: any(h.role is Role.TRAIN for h in self.ledger.holdings.values()))
    @rule(data=st.data())
    def release(self, data):
        held = sorted((h.pipeline, h.stage) for h in self.ledger.holdings.values() if h.role is Role.TRAIN)
        name, stage = data.draw(st.sampled_from(held))
        self.core.release(name, stage)
        self.replan()

    @precondition(lambda self: self.ledger.pipelines)
    @rule(data=st.data(), remaining=st.integers(0, 40), loads=st.lists(st.integers(0, 9), max_size=6))
    def report_progress(self, data, remaining, loads):
        name = data.draw(st.sampled_from(sorted(self.ledger.pipelines)))
        ranks = sorted(self.ledger.shards_of(name))
        self.core.report_progress(Progress(name, remaining=remaining, target=40,
                                           shard_load=dict(zip(ranks, loads))))
        self.replan()

    @precondition(lambda self: self.ledger.pipelines)
    @rule(data=st.data())
    def die(self, data):
        name = data.draw(st.sampled_from(sorted(self.ledger.pipelines)))
        gone = self.core.unregister(name)
        assert all(self.ledger.owner[g] is None for g in gone.freed_gpus)
        assert not any(r.pipeline == name for r in self.core.pending.values())
        self.replan()

    @rule(dt=st.floats(0.5, 60.0))
    def tick(self, dt):
        self.advance(dt)
        self.replan()

    # ------------------------------------------------------------------ checks
    def check_after_plan(self) -> None:
        led = self.ledger
        led.check_invariants()
        held = sum(len(h.gpus) for h in led.holdings.values())
        assert held + len(led.idle_gpus()) == TOTAL, "a GPU leaked"
        free_on_node = [sum(1 for g in led.topology.node_gpus(n) if led.owner[g] is None)
                        for n in range(NODES)]
        for name, spec in led.pipelines.items():
            want = rollout_demand(spec, self.core.progress.get(name))
            have = len(led.shards_of(name))
            if have < want:
                home = led.train_home.get(name, frozenset())
                for n in range(NODES):
                    room = sum(1 for g in led.topology.node_gpus(n) if led.owner[g] is None and g not in home)
                    assert room < spec.tp, (
                        f"work conservation: {name} wants {want} shards, has {have}, "
                        f"node {n} has {free_on_node[n]} idle GPUs")
        # Floor: every pipeline with demand has a shard when the cluster can hold one each.
        demanding = [n for n, s in led.pipelines.items() if rollout_demand(s, self.core.progress.get(n)) > 0]
        unlocked = TOTAL - sum(len(h.gpus) for h in led.holdings.values() if h.role is Role.TRAIN)
        simple = all(s.tp == 1 and s.partial_overlap for s in led.pipelines.values())
        if simple and len(demanding) <= unlocked:
            for n in demanding:
                assert led.shards_of(n), f"{n} has demand but no shard ({len(demanding)} <= {unlocked})"

    @invariant()
    def requests_wait_within_bound(self):
        assert self.worst_wait <= self.bound() + 1e-6
        for r in self.core.pending.values():
            waited = self.now - r.submitted_at
            assert waited <= self.bound() + 1e-6, (
                f"request {r} waited {waited:.1f}s > bound {self.bound():.1f}s")


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase

