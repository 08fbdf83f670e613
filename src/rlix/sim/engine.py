"""The event loop, and domains: a ledger plus the real planner, driven by simulated pipelines.

A `Domain` is one scheduler's world: the RLix policy has one for the whole cluster; every
baseline pipeline gets its own over its own GPUs (same planner, one pipeline registered), so
the only difference between policies is sharing. A domain re-plans whenever something it
plans on changes (a request, a release, a progress report, `plan.wake_at`), applies each plan
to its ledger with `Ledger.apply` and enacts it with per-GPU ordering: every action on a GPU
starts only once earlier actions on the same GPU are done (`busy_until`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from rlix.scheduler.planning import planner as planner_mod
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import GpuRequest, Progress, Stage, Topology

from rlix.sim.account import HoldAccount
from rlix.sim.pipeline import PipelineRun
from rlix.sim.trace import SimTrace


class Clock:
    """Simulated time and the event heap. Events are (time, seq, fn, args); seq breaks ties
    in insertion order, which keeps runs deterministic."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple] = []
        self._seq = 0
        self._dirty: dict["Domain", None] = {}
        self.events = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def mark_dirty(self, domain: "Domain") -> None:
        self._dirty[domain] = None

    def _flush(self) -> None:
        dirty = self._dirty
        while dirty:
            domain = next(iter(dirty))
            del dirty[domain]
            domain.replan()

    def run(self, until: float = float("inf")) -> None:
        heap = self._heap
        self._flush()
        while heap:
            if heap[0][0] > until:
                break
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
            if self._dirty:
                self._flush()


class Domain:
    """One ledger + the planner over a set of GPUs, with the pipelines registered on it."""

    def __init__(self, clock: Clock, topology: Topology, params: PlannerParams,
                 gpu_ids: list[int] | None = None,
                 on_finish: Callable[[PipelineRun], None] | None = None,
                 trace: SimTrace | None = None) -> None:
        self.clock = clock
        self.ledger = Ledger(topology)
        self.params = params
        self.gpu_ids = gpu_ids if gpu_ids is not None else list(range(topology.num_gpus))
        self.busy_until = [0.0] * topology.num_gpus
        self.claimed_from = [0.0] * topology.num_gpus  # when the latest action's holder got it
        self.pending: dict[int, GpuRequest] = {}
        self.progress: dict[str, Progress] = {}
        self.runs: dict[str, PipelineRun] = {}
        self.on_finish = on_finish
        self._next_id = 1
        self._wakes: set[float] = set()
        self.plan_calls = 0
        self.transition_gpu_s = 0.0  # GPU-seconds of moves: sleeps, wakes, syncs, process starts,
        #                             trainer reloads and offloads
        self.trace = trace  # records the run for its timeline (rlix sim --out)
        self.account = HoldAccount()  # GPU-seconds held per pipeline and role

    # ------------------------------------------------------------------ pipelines' calls
    def add(self, run: PipelineRun, resume: bool = False) -> None:
        self.ledger.register(run.spec)
        self.runs[run.name] = run
        if resume:
            run.resume()
        else:
            run.start()
        self.clock.mark_dirty(self)

    def crash(self, run: PipelineRun) -> None:
        """Its processes died: the scheduler drops it (as `SchedulerService` drops a dead
        coordinator); its GPUs are free once the actions before its own on them are done."""
        self.account.advance(self.clock.now)
        for g in self.ledger.gpus_of(run.name):
            self.busy_until[g] = max(self.clock.now, min(self.busy_until[g], self.claimed_from[g]))
        for rid in [rid for rid, r in self.pending.items() if r.pipeline == run.name]:
            del self.pending[rid]
        self.ledger.unregister(run.name)
        self.progress.pop(run.name, None)
        del self.runs[run.name]
        self._changed()
        self._note("crash")
        self.clock.mark_dirty(self)

    def submit(self, run: PipelineRun, stage: Stage, gpus: int) -> int:
        rid = self._next_id
        self._next_id += 1
        self.pending[rid] = GpuRequest(rid, run.name, stage, gpus, self.clock.now)
        self.clock.mark_dirty(self)
        return rid

    def release(self, run: PipelineRun, stage: Stage) -> None:
        self.account.advance(self.clock.now)
        self.ledger.release(run.name, stage)
        self._changed()
        self._note("release")
        self.clock.mark_dirty(self)

    def report(self, progress: Progress) -> None:
        self.progress[progress.pipeline] = progress
        self.clock.mark_dirty(self)

    def unregister(self, run: PipelineRun) -> None:
        """A finished pipeline exits: its processes end and its GPUs are free at once."""
        self.account.advance(self.clock.now)
        self.ledger.unregister(run.name)
        del self.runs[run.name]
        self._changed()
        self._note("unregister")
        self.progress.pop(run.name, None)
        self.clock.mark_dirty(self)
        if self.on_finish is not None:
            self.on_finish(run)

    def _changed(self) -> None:
        """After a ledger change: recount the holdings, and who now waits without a shard."""
        self.account.recount(self.ledger, self._label)
        for run in self.runs.values():
            run.track_shardless()

    def _label(self, pipeline: str) -> str:
        run = self.runs.get(pipeline)
        return run.phase_label if run is not None else "train"

    def _note(self, reason: str | None) -> None:
        if self.trace is not None:
            self.trace.note_roles(self.ledger, self.gpu_ids, self.clock.now, reason)

    def _event(self, run: PipelineRun, at: float, kind: str, rank: int, seconds: float) -> None:
        if self.trace is not None:
            self.trace.event(run.name, at, kind, [rank], seconds)

    # ------------------------------------------------------------------ planning
    def _ready_at(self, gpus: tuple[int, ...]) -> float:
        return max([self.clock.now] + [self.busy_until[g] for g in gpus])

    def replan(self) -> None:
        now = self.clock.now
        if not self.runs:
            return
        self.plan_calls += 1
        plan = planner_mod.plan(self.ledger, list(self.pending.values()), dict(self.progress),
                                now, self.params)
        if not plan.is_empty():
            self.account.advance(now)
            # where a rank's process is not (read before the plan moves it there): it starts anew
            last = self.ledger.last_shard_gpus
            cold = {(m.pipeline, m.dp_rank) for m in plan.expands
                    if not self.runs[m.pipeline].setup.resident_engines
                    and last.get((m.pipeline, m.dp_rank)) != tuple(m.gpus)}
            self.ledger.apply(plan, now)
            self._changed()
            self._note(None)
            touched: dict[str, PipelineRun] = {}
            # Canonical order: the planner's lists may follow set iteration (string hashes
            # differ per process), and the order turns are re-queued in must not.
            by_shard = lambda m: (m.pipeline, m.dp_rank)  # noqa: E731
            for move in sorted(plan.shrinks, key=by_shard):
                run = self.runs[move.pipeline]
                run.on_shrink(move.dp_rank)
                sleep = run.costs.sleep_s
                free_at = self._ready_at(move.gpus) + sleep
                for g in move.gpus:
                    self.busy_until[g] = free_at
                self.transition_gpu_s += sleep * len(move.gpus)
                self._event(run, free_at, "sleep", move.dp_rank, sleep)
                touched[run.name] = run
            for grant in sorted(plan.grants, key=lambda g: g.request_id):
                del self.pending[grant.request_id]
                run = self.runs[grant.pipeline]
                start = self._ready_at(grant.gpus)
                for g in grant.gpus:
                    self.busy_until[g] = start + run.hold_s
                    self.claimed_from[g] = start
                self.transition_gpu_s += (run.reload_s + run.offload_s) * len(grant.gpus)
                run.on_grant(start)
            for move in sorted(plan.expands, key=by_shard):
                run = self.runs[move.pipeline]
                costs = run.costs
                begin = self._ready_at(move.gpus)
                if (move.pipeline, move.dp_rank) in cold:  # its process starts here first
                    up = begin + costs.cold_start_s
                    self._event(run, begin, "start", move.dp_rank, 0.0)
                else:  # its engine sleeps here (or the set-up is still starting it)
                    up = max(begin, run.engines_ready_at)
                ready = up + costs.wake_s
                for g in move.gpus:
                    self.busy_until[g] = ready
                    self.claimed_from[g] = begin
                self.transition_gpu_s += (ready - begin) * len(move.gpus)
                synced = ready - costs.sync_s
                self._event(run, synced, "wake", move.dp_rank, synced - begin)
                self._event(run, ready, "sync", move.dp_rank, costs.sync_s)
                run.on_expand(move.dp_rank, move.gpus, ready)
                touched[run.name] = run
            for run in touched.values():
                run.dispatch()
        wake = plan.wake_at
        if wake is not None and wake > now and wake not in self._wakes:
            self._wakes.add(wake)
            self.clock.at(wake, self._wake, wake)

    def _wake(self, t: float) -> None:
        self._wakes.discard(t)
        if self.runs:
            self.clock.mark_dirty(self)
