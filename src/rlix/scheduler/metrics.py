"""The scheduler's Prometheus metrics, in a registry of their own (never the global one).

Bookkeeping only: `SchedulerMetrics` is fed by whoever drives a `SchedulerCore` (the service's
`AsyncScheduler`, or a test by hand). `replan(core, reason)` runs the core's plan and records what
it did: each grant with how long its request waited, each shard put to sleep (a preemption) with
where its GPUs went, each shard woken, the planner's time. `refresh(core)` takes the ledger's
holdings and the pending requests after any change. Counters and histograms are prometheus_client's
(thread-safe); the gauges are served from a snapshot replaced whole at every refresh, because the
HTTP server scrapes from its own thread while the scheduler's loop changes the ledger.

Names (all `rlix_`): rlix_gpus{state}, rlix_gpus_held{pipeline,role}, rlix_gpu_share{pipeline},
rlix_pipelines, rlix_pending_requests, rlix_pending_wait_seconds{pipeline,stage},
rlix_request_wait_seconds{pipeline,stage} (histogram), rlix_grants_total{pipeline,stage},
rlix_preemptions_total{pipeline,to}, rlix_shard_wakes_total{pipeline},
rlix_plan_seconds (histogram), rlix_plans_total{outcome}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.types import Plan, Role

#: a non-rollout request's wait for its GPUs: from immediate to past the default ageing (60 s)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 900.0)
#: one planner pass: well under a millisecond for a few pipelines, more for large clusters
PLAN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class _Snapshot:
    """The gauges' values at the last refresh (replaced whole, never changed)."""

    gpus: dict[str, int] = field(default_factory=dict)  # state -> count
    held: dict[tuple[str, str], int] = field(default_factory=dict)  # (pipeline, role) -> GPUs
    share: dict[str, float] = field(default_factory=dict)  # pipeline -> held / usable GPUs
    pipelines: int = 0
    pending: tuple[tuple[str, str, float], ...] = ()  # (pipeline, stage, submitted_at)


class SchedulerMetrics:
    """See module doc. `clock` is the core's (pending waits are measured on it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        self._snap = _Snapshot()
        self._server: Any = None  # the HTTP server of `serve`
        r = self.registry
        self.request_wait = Histogram(
            "rlix_request_wait_seconds", "How long a non-rollout request waited for its GPUs (at its grant).",
            ["pipeline", "stage"], buckets=WAIT_BUCKETS, registry=r)
        self.grants = Counter("rlix_grants", "Non-rollout requests granted.", ["pipeline", "stage"], registry=r)
        self.preemptions = Counter(
            "rlix_preemptions", "Shards put to sleep by a plan; `to`: what their GPUs went to "
            "(train: a non-rollout stage, shard: another shard, idle: nothing yet).",
            ["pipeline", "to"], registry=r)
        self.wakes = Counter("rlix_shard_wakes", "Shards woken (placed) by a plan.", ["pipeline"], registry=r)
        self.plan_seconds = Histogram("rlix_plan_seconds", "Time of one planner pass (plan + apply to the ledger).",
                                      buckets=PLAN_BUCKETS, registry=r)
        self.plans = Counter("rlix_plans", "Planner passes by outcome (changed, unchanged, rejected).",
                             ["outcome"], registry=r)
        r.register(_Gauges(self))

    # ------------------------------------------------------------------ events
    def replan(self, core: SchedulerCore, reason: str = "") -> Plan:
        """`core.replan(reason)`, timed and recorded; what it raises is re-raised (counted as a
        rejected plan)."""
        waiting = {r.id: r.submitted_at for r in core.pending.values()}
        now = core.clock()
        t0 = time.perf_counter()
        try:
            plan = core.replan(reason)
        except Exception:
            self.plan_seconds.observe(time.perf_counter() - t0)
            self.plans.labels("rejected").inc()
            raise
        self.plan_seconds.observe(time.perf_counter() - t0)
        self.plans.labels("unchanged" if plan.is_empty() else "changed").inc()
        self.observe_plan(plan, waiting, now)
        return plan

    def observe_plan(self, plan: Plan, submitted_at: dict[int, float], now: float) -> None:
        """A plan applied at `now`; `submitted_at`: request id -> when it was made."""
        granted = {g for grant in plan.grants for g in grant.gpus}
        woken = {g for move in plan.expands for g in move.gpus}
        for grant in plan.grants:
            stage = grant.stage.name.lower()
            self.grants.labels(grant.pipeline, stage).inc()
            if grant.request_id in submitted_at:
                self.request_wait.labels(grant.pipeline, stage).observe(
                    max(0.0, now - submitted_at[grant.request_id]))
        for move in plan.shrinks:
            gpus = set(move.gpus)
            to = "train" if gpus & granted else "shard" if gpus & woken else "idle"
            self.preemptions.labels(move.pipeline, to).inc()
        for move in plan.expands:
            self.wakes.labels(move.pipeline).inc()

    def refresh(self, core: SchedulerCore) -> None:
        """The gauges from the ledger and the pending requests as they are now."""
        ledger = core.ledger
        held: dict[tuple[str, str], int] = {}
        for name in ledger.pipelines:
            for role in Role:
                held[(name, role.value)] = 0
        for h in ledger.holdings.values():
            key = (h.pipeline, h.role.value)
            held[key] = held.get(key, 0) + len(h.gpus)
        lost = len(ledger.lost)
        usable = ledger.topology.num_gpus - lost
        busy = sum(held.values())
        per_pipeline: dict[str, int] = {}
        for (name, _), n in held.items():
            per_pipeline[name] = per_pipeline.get(name, 0) + n
        self._snap = _Snapshot(
            gpus={"idle": len(ledger.idle_gpus()), "held": busy, "lost": lost},
            held=held,
            share={n: (k / usable if usable else 0.0) for n, k in per_pipeline.items()},
            pipelines=len(ledger.pipelines),
            pending=tuple((r.pipeline, r.stage.name.lower(), r.submitted_at) for r in core.pending.values()))

    # ------------------------------------------------------------------ exposition
    def text(self) -> str:
        """The registry in Prometheus' text format (what the HTTP endpoint serves)."""
        return generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the registry over HTTP on a thread of this process; returns the port (0: a free
        one is chosen). OSError if it cannot listen there."""
        self.close()
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (if it was)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Gauges:
    """The snapshot's gauges, at scrape time (prometheus_client's collector protocol)."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap, now = self.metrics._snap, self.metrics.clock()
        g = GaugeMetricFamily("rlix_gpus", "Scheduled GPUs by state (idle, held, lost with their node).",
                              labels=["state"])
        for state in ("idle", "held", "lost"):
            g.add_metric([state], snap.gpus.get(state, 0))
        yield g
        g = GaugeMetricFamily("rlix_gpus_held", "GPUs a pipeline holds, by role (train: a non-rollout "
                                                "stage; generate: its inference shards).",
                              labels=["pipeline", "role"])
        for (name, role), n in sorted(snap.held.items()):
            g.add_metric([name, role], n)
        yield g
        g = GaugeMetricFamily("rlix_gpu_share", "Fraction of the usable GPUs a pipeline holds.", labels=["pipeline"])
        for name, share in sorted(snap.share.items()):
            g.add_metric([name], share)
        yield g
        yield GaugeMetricFamily("rlix_pipelines", "Registered pipelines.", value=snap.pipelines)
        yield GaugeMetricFamily("rlix_pending_requests", "Non-rollout requests waiting for GPUs.",
                                value=len(snap.pending))
        g = GaugeMetricFamily("rlix_pending_wait_seconds", "How long each pending request has waited so far.",
                              labels=["pipeline", "stage"])
        for name, stage, submitted in snap.pending:
            g.add_metric([name, stage], max(0.0, now - submitted))
        yield g
