"""Scheduler bookkeeping without Ray: the ledger, pending requests, progress, plan log.

`SchedulerCore` validates calls, runs the pure planner and applies its plan to the ledger.
It holds no policy (that is the planner's) and does no I/O (that is the executor's), so the
Ray service, the tests and any other driver share the same rules.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlix.errors import LedgerError, SchedulerError, UnknownPipelineError
from rlix.scheduler.planning import planner as planner_mod
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import (
    GpuRequest,
    PipelineSpec,
    Plan,
    Progress,
    Role,
    ShardMove,
    Stage,
    Topology,
)

log = logging.getLogger("rlix.scheduler")

#: how many departed pipelines the core remembers (what a repeated unregister answers)
DEPARTED_KEPT = 16

#: why a GPU's role changed, as each role-log entry says (`reason`). A plan's changes are told
#: apart by what the GPU became: a training stage granted, a shard woken on it (expand), or a
#: shard taken off it (preemption: the planner shrank it); the other calls name their own.
ROLE_REASONS = ("grant", "expand", "preemption", "release", "unregister", "failure", "lost")

PlanFn = Callable[[Ledger, list[GpuRequest], dict[str, Progress], float, PlannerParams], Plan]


@dataclass(frozen=True)
class Unregistered:
    """What leaving the scheduler freed: the pipeline's shards (live ones must be put to
    sleep by the caller), every GPU it held, and its pending request (now cancelled)."""

    pipeline: str
    shards: list[ShardMove]
    freed_gpus: list[int]
    cancelled: list[GpuRequest]


@dataclass(frozen=True)
class LostGpus:
    """What a node leaving took: every GPU lost so far, the shards that were on them, the
    pipelines that were training there, and those whose training home was there."""

    gpus: list[int]
    shards: list[ShardMove]
    training: list[str]
    homeless: list[str]


class SchedulerCore:
    """The scheduler's state and the rules for changing it; one instance per cluster."""

    def __init__(
        self,
        topology: Topology,
        params: PlannerParams | None = None,
        clock: Callable[[], float] = time.monotonic,
        plan_fn: PlanFn | None = None,
        log_size: int = 50,
    ) -> None:
        self.ledger = Ledger(topology)
        self.params = params or PlannerParams()
        self.clock = clock
        # Looked up at call time so a planner module reloaded or patched in tests is honoured.
        self._plan_fn = plan_fn
        self.pending: dict[int, GpuRequest] = {}  # insertion order == submission order
        self.progress: dict[str, Progress] = {}
        self.plan_log: deque[dict] = deque(maxlen=log_size)
        # every GPU role/owner change, numbered, so a poller misses none (`rlix run`'s log)
        self.role_log: deque[dict] = deque(maxlen=log_size * 200)
        self._roles: dict[int, str] = {}
        self.role_seq = 0  # number of the last role change (persisted: the numbering survives)
        self.last_error: str | None = None
        self.next_id = 1  # the next request's id (persisted: ids are never reused)
        # pipeline -> its last release {"stage", "freed"}, until it requests again: what a release
        # retried after a scheduler restart answers
        self.last_release: dict[str, dict] = {}
        # pipelines that left, newest last -> {"freed", "gpus" (its shards' last GPUs)}: what a
        # repeated unregister answers, and where a leaving pipeline's sleeps may still be in flight
        self.departed: OrderedDict[str, dict] = OrderedDict()

    # ------------------------------------------------------------------ pipelines
    def register(self, spec: PipelineSpec, setting_up: bool = False) -> None:
        """`setting_up`: it is planned for only from its `ready` on (see Progress.setting_up)."""
        if not isinstance(spec, PipelineSpec):
            raise SchedulerError(f"register needs a PipelineSpec, got {type(spec).__name__}")
        try:
            self.ledger.register(spec)
        except LedgerError as exc:
            raise SchedulerError(str(exc)) from exc
        self.departed.pop(spec.name, None)
        if setting_up:
            self.progress[spec.name] = Progress(spec.name, remaining=0, setting_up=True,
                                                reported_at=self.clock())
        log.info("registered pipeline %s (priority=%d, train_gpus=%d, tp=%d, shards %d..%d)",
                 spec.name, spec.priority, spec.train_gpus, spec.tp, spec.min_shards,
                 spec.max_shards)

    def ready(self, name: str, engines_starting: frozenset[int] = frozenset()) -> bool:
        """The pipeline finished setting up: from now on it is planned for (until its first
        report, at full demand; `engines_starting`: where its engines still start, as a report
        says). False when it was not setting up (a call repeated)."""
        self.require(name)
        self._note_engines(name, engines_starting)
        prog = self.progress.get(name)
        if prog is None or not prog.setting_up:
            return False
        del self.progress[name]
        return True

    def unregister(self, name: str, reason: str = "unregister") -> Unregistered:
        """Forget a pipeline: its GPUs become idle and its pending request is cancelled.
        `reason` goes into the role log: "unregister" (it left) or "failure" (it died)."""
        self.require(name)
        shards = [ShardMove(name, rank, h.gpus)
                  for rank, h in sorted(self.ledger.shards_of(name).items())]
        last_gpus = sorted({g for (p, _), gpus in self.ledger.last_shard_gpus.items() if p == name
                            for g in gpus})
        freed = self.ledger.unregister(name)
        self.departed.pop(name, None)
        self.departed[name] = {"freed": list(freed), "gpus": last_gpus}
        while len(self.departed) > DEPARTED_KEPT:
            self.departed.popitem(last=False)
        self.last_release.pop(name, None)
        self._note_roles(reason)
        cancelled = [r for r in self.pending.values() if r.pipeline == name]
        for r in cancelled:
            del self.pending[r.id]
        self.progress.pop(name, None)
        log.info("unregistered pipeline %s; GPUs %s return to the pool", name, freed)
        return Unregistered(name, shards, freed, cancelled)

    def gpus_lost(self, gpus: Iterable[int]) -> LostGpus:
        """GPUs whose node left the cluster: the holdings on them are dropped, and pipelines
        whose training home was there can never train again (the caller fails them)."""
        dropped = self.ledger.mark_lost(gpus)
        self._note_roles("lost")
        lost = set(self.ledger.lost)
        homeless = sorted(n for n, home in self.ledger.train_home.items() if home & lost)
        shards = [ShardMove(h.pipeline, h.dp_rank, h.gpus) for h in dropped if h.role is Role.GENERATE]
        training = sorted({h.pipeline for h in dropped if h.role is Role.TRAIN})
        log.warning("GPUs %s left the cluster: dropped %d shard(s), training of %s; homes lost: %s",
                    sorted(lost), len(shards), training, homeless)
        return LostGpus(sorted(lost), shards, training, homeless)

    def require(self, name: str) -> PipelineSpec:
        spec = self.ledger.pipelines.get(name)
        if spec is None:
            raise UnknownPipelineError(f"pipeline {name!r} is not registered")
        return spec

    @property
    def pipelines(self) -> dict[str, PipelineSpec]:
        return self.ledger.pipelines

    # ------------------------------------------------------------------ requests
    def submit_request(self, pipeline: str, stage: Stage | str | int, gpus: int) -> GpuRequest:
        """Queue a non-rollout request; it is granted by a later `replan`."""
        self.require(pipeline)
        stage = parse_stage(stage)
        if stage is Stage.ROLLOUT:
            raise SchedulerError("rollout GPUs are given as shards by the planner, not requested")
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise SchedulerError(f"{pipeline}: gpus must be a positive integer, got {gpus!r}")
        total = self.ledger.topology.num_gpus
        if gpus > total:
            raise SchedulerError(f"{pipeline}: asks for {gpus} GPUs, the cluster has {total}")
        home = self.ledger.train_home.get(pipeline)
        if home is not None and gpus > len(home):
            raise SchedulerError(
                f"{pipeline}: asks for {gpus} GPUs but it trains only on its {len(home)} home "
                f"GPUs {sorted(home)}")
        for r in self.pending.values():
            if r.pipeline == pipeline:
                raise SchedulerError(
                    f"{pipeline}: request {r.id} ({r.stage.name.lower()}) is still pending; "
                    f"one pending request per pipeline")
        held = [h.stage for h in self.ledger.holdings.values()
                if h.pipeline == pipeline and h.role is Role.TRAIN]
        if held:
            # One non-rollout stage at a time: a pipeline waiting for a second stage while it
            # holds the first could block itself, and the waiting bound assumes it cannot.
            raise SchedulerError(f"{pipeline}: already holds GPUs for {held[0].name.lower()}; "
                                 f"release them before requesting {stage.name.lower()}")
        request = GpuRequest(self.next_id, pipeline, stage, gpus, self.clock())
        self.next_id += 1
        self.pending[request.id] = request
        self.last_release.pop(pipeline, None)
        return request

    def cancel_request(self, request_id: int) -> GpuRequest | None:
        """Drop a request nobody waits for any more; None if it was not pending."""
        return self.pending.pop(request_id, None)

    def release(self, pipeline: str, stage: Stage | str | int) -> list[int]:
        self.require(pipeline)
        stage = parse_stage(stage)
        if stage is Stage.ROLLOUT:
            raise SchedulerError("rollout shards are shrunk by the planner, not released")
        if self.ledger.stage_holding(pipeline, stage) is None:
            raise SchedulerError(f"{pipeline}: holds no GPUs for {stage.name.lower()}")
        freed = self.ledger.release(pipeline, stage)
        self._note_roles("release")
        self.last_release[pipeline] = {"stage": stage.name.lower(), "freed": list(freed)}
        return freed

    def report_progress(self, progress: Progress) -> None:
        if not isinstance(progress, Progress):
            raise SchedulerError(f"report_progress needs a Progress, got {type(progress).__name__}")
        self.require(progress.pipeline)
        if progress.remaining < 0 or progress.target < 0 or (progress.for_next_step or 0) < 0:
            raise SchedulerError(f"{progress.pipeline}: remaining/target/for_next_step must be >= 0")
        spt = progress.seconds_per_trajectory
        if spt is not None and not (isinstance(spt, (int, float)) and not isinstance(spt, bool)
                                    and 0 < spt < float("inf")):
            raise SchedulerError(f"{progress.pipeline}: seconds_per_trajectory must be a positive "
                                 f"finite number or None (unknown), got {spt!r}")
        self._note_engines(progress.pipeline, progress.engines_starting)
        # Stamped with our clock: the reporter's clock is another process's.
        self.progress[progress.pipeline] = dataclasses.replace(progress, reported_at=self.clock())

    def _note_engines(self, name: str, gpus: frozenset[int]) -> None:
        try:
            self.ledger.note_engines_starting(name, frozenset(gpus))
        except (LedgerError, TypeError) as exc:
            raise SchedulerError(str(exc)) from exc

    # ------------------------------------------------------------------ planning
    def replan(self, reason: str = "") -> Plan:
        """Plan against the current state and apply it to the ledger; return it to execute.

        Granted requests leave `pending`. A plan the ledger rejects changes nothing and raises
        SchedulerError (a planner bug, reported rather than half-applied).
        """
        now = self.clock()
        fn = self._plan_fn or planner_mod.plan
        # Every registered pipeline is planned for; one without a report counts as full demand.
        plan = fn(self.ledger, list(self.pending.values()), dict(self.progress), now, self.params)
        try:
            self._check_grants(plan)
            self.ledger.apply(plan, now)
            self._note_roles(None)
        except (LedgerError, SchedulerError) as exc:
            self.last_error = f"plan rejected ({reason}): {exc}; plan was: {plan.summary()}"
            log.error("%s", self.last_error)
            raise SchedulerError(self.last_error) from exc
        for grant in plan.grants:
            del self.pending[grant.request_id]
        if not plan.is_empty():
            self.plan_log.append({"at": now, "reason": reason, "summary": plan.summary(),
                                  "grants": len(plan.grants), "shrinks": len(plan.shrinks),
                                  "expands": len(plan.expands)})
            log.info("plan (%s): %s", reason or "replan", plan.summary())
        return plan

    def _check_grants(self, plan: Plan) -> None:
        seen: set[int] = set()
        for g in plan.grants:
            req = self.pending.get(g.request_id)
            if req is None or g.request_id in seen:
                raise SchedulerError(f"grant for request {g.request_id}, which is not pending")
            if (req.pipeline, req.stage, req.gpus) != (g.pipeline, g.stage, len(g.gpus)):
                raise SchedulerError(
                    f"grant {g.pipeline}/{g.stage.name.lower()} x{len(g.gpus)} does not match "
                    f"request {req.id}: {req.pipeline}/{req.stage.name.lower()} x{req.gpus}")
            seen.add(g.request_id)

    # ------------------------------------------------------------------ queries
    def shard_gpus(self, pipeline: str) -> dict[int, tuple[int, ...]]:
        """dp rank -> GPUs of the pipeline's shards the ledger counts as active."""
        return {rank: h.gpus for rank, h in sorted(self.ledger.shards_of(pipeline).items())}

    def _note_roles(self, reason: str | None) -> None:
        """Log every GPU whose role changed, with why (`ROLE_REASONS`); None: a plan's change,
        named by what the GPU became (see `plan_reason`)."""
        roles = gpu_roles(self.ledger.snapshot())
        now = self.clock()
        for gpu in sorted(set(roles) | set(self._roles)):
            before, after = self._roles.get(gpu, "idle"), roles.get(gpu, "idle")
            if before != after:
                self.role_seq += 1
                self.role_log.append({"seq": self.role_seq, "at": now, "gpu": gpu,
                                      "before": before, "after": after,
                                      "reason": reason or plan_reason(after)})
        self._roles = roles

    def resync_roles(self) -> None:
        """Take the ledger's current GPU roles as the ones already logged (after the ledger was
        restored: the log holds every change up to it)."""
        self._roles = gpu_roles(self.ledger.snapshot())

    def role_changes(self, since: int = 0) -> list[dict]:
        """GPU role changes numbered after `since`, oldest first (the last `maxlen` are kept)."""
        return [c for c in self.role_log if c["seq"] > since]

    def snapshot(self) -> dict:
        now = self.clock()
        ledger = self.ledger.snapshot()
        return {
            "now": now,
            "ledger": ledger,
            "pipelines": {
                name: {
                    **dataclasses.asdict(spec),
                    "train_gpus_held": sorted(g for h in self.ledger.holdings.values()
                                              if h.pipeline == name and h.role is Role.TRAIN
                                              for g in h.gpus),
                    "shards": {rank: list(gpus) for rank, gpus in self.shard_gpus(name).items()},
                }
                for name, spec in self.ledger.pipelines.items()
            },
            "pending": [
                {"id": r.id, "pipeline": r.pipeline, "stage": r.stage.name.lower(),
                 "gpus": r.gpus, "submitted_at": r.submitted_at, "waiting_s": now - r.submitted_at}
                for r in self.pending.values()
            ],
            "progress": {name: dataclasses.asdict(p) for name, p in self.progress.items()},
            "plans": list(self.plan_log),
            "last_error": self.last_error,
        }


def parse_stage(stage: Stage | str | int) -> Stage:
    try:
        return Stage.parse(stage)
    except ValueError as exc:
        raise SchedulerError(str(exc)) from exc


def plan_reason(after: str) -> str:
    """Why a plan changed a GPU's role, from the role it gave it: a training stage is a grant,
    a shard an expand (a wake), nothing a preemption (its shard was shrunk)."""
    if after == "idle":
        return "preemption"
    return "grant" if after.endswith("/train") else "expand"


def gpu_roles(snapshot: dict) -> dict[int, str]:
    """GPU -> "pipeline/train" or "pipeline/generate#rank" from a ledger (or scheduler) snapshot."""
    holdings = snapshot.get("ledger", snapshot).get("holdings", [])
    out: dict[int, str] = {}
    for h in holdings:
        what = f"{h['pipeline']}/train" if h["role"] == "train" else f"{h['pipeline']}/generate#{h['dp_rank']}"
        for g in h["gpus"]:
            out[int(g)] = what
    return out
