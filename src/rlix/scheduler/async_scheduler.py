"""The scheduler's event loop around `SchedulerCore`, without Ray.

`AsyncScheduler` re-plans after every call and when a plan's `wake_at` passes, hands plans to
the executor, and resolves the callers waiting in `request()`. Its Ray face is
`rlix.scheduler.service.SchedulerService`; tests drive it directly with in-process coordinators.
Plans are logged at INFO on the `rlix.scheduler` logger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from rlix.errors import SchedulerError, UnknownPipelineError
from rlix.scheduler.core import LostGpus, PlanFn, SchedulerCore, parse_stage
from rlix.scheduler.dashboard import DashboardFeed
from rlix.scheduler.executor import PlanExecutor, ReassertFn, ResizeFn
from rlix.scheduler.metrics import SchedulerMetrics
from rlix.scheduler.persistence import SchedulerPersistence, ServiceState
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import (
    GpuRequest,
    Grant,
    Holding,
    PipelineSpec,
    Plan,
    Progress,
    ShardMove,
    Stage,
    Topology,
)

log = logging.getLogger("rlix.scheduler")


class AsyncScheduler:
    """Scheduler state plus the asyncio machinery to act on it; one event loop, no locks
    (every state change happens between awaits). `is_fatal(exc)` says whether a failed
    coordinator call means the pipeline is dead."""

    def __init__(self, topology: Topology, params: PlannerParams | None = None, *,
                 clock: Callable[[], float] = time.monotonic, plan_fn: PlanFn | None = None,
                 is_fatal: Callable[[BaseException], bool] = lambda exc: False,
                 call_timeout_s: float | None = None, min_timer_s: float = 0.05,
                 real_gpus: bool = False, persistence: SchedulerPersistence | None = None) -> None:
        self.core = SchedulerCore(topology, params, clock=clock, plan_fn=plan_fn)
        self.metrics = SchedulerMetrics(clock=self.core.clock)  # Prometheus; refreshed at every change
        self.metrics.refresh(self.core)
        # the dashboard's frame; off (free) until the service serves the page
        self.dashboard = DashboardFeed(clock=self.core.clock)
        # saved at every change (`_save`); None: the state lives in this process only
        self.persistence = persistence
        # real GPUs: a GPU is handed on only once its holder's memory is free, so a pipeline
        # whose shards can only pause (spec.frees_memory False) cannot share them
        self.real_gpus = real_gpus
        self.executor = PlanExecutor(self._on_grant, self._on_call_error, call_timeout_s)
        self.is_fatal = is_fatal
        self.min_timer_s = min_timer_s
        self._coordinators: dict[str, ResizeFn] = {}
        self._waiters: dict[int, tuple[str, asyncio.Future]] = {}  # request id -> waiter
        self._changed = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self.holding = False
        self._hold_for: set[str] | None = None  # hold() lifts itself once these have registered
        self.failures: deque[dict] = deque(maxlen=20)
        self.errors: deque[dict] = deque(maxlen=20)
        self.restarts = 0  # how often this scheduler's state was restored
        # after a restore only: what calls re-sent by Ray (their answer was lost with the old
        # instance) attach to or are answered with; each is used once
        self._recovered_ids: set[int] = set()  # requests pending or granted before the restart
        self._retry_releases: dict[str, dict] = {}  # pipeline -> its last release
        self._retry_unregisters: dict[str, list[int]] = {}  # departed pipeline -> its freed GPUs

    # ------------------------------------------------------------------ persistence
    def _save(self) -> None:
        """Persist the state now (called at the end of every change, before any await, so no
        caller or coordinator ever acts on a state that a restart could lose)."""
        if self.persistence is None:
            return
        try:
            self.persistence.save(self.core, ServiceState(self.holding, list(self.failures),
                                                          list(self.errors), self.restarts))
        except Exception as exc:  # noqa: BLE001 - the store's failure must not fail the call
            log.exception("could not save the scheduler's state")
            self.errors.append({"what": "save state", "error": repr(exc)[:500], "at": self.core.clock()})

    def restore(self) -> bool:
        """Load the persisted state into this (fresh) scheduler; False if none is stored.
        Coordinators are attached (`attach`) and re-asserted (`reconcile`) by the caller."""
        if self.persistence is None:
            return False
        state = self.persistence.load(self.core)
        if state is None:
            return False
        self.holding = state.holding
        self.failures.extend(state.failures)
        self.errors.extend(state.errors)
        self.restarts = state.restarts + 1
        self._recovered_ids = set(self.core.pending) | {
            h.request_id for h in self.core.ledger.holdings.values() if h.request_id is not None}
        self._retry_releases = {n: dict(r) for n, r in self.core.last_release.items()}
        self._retry_unregisters = {n: list(d["freed"]) for n, d in self.core.departed.items()}
        self._save()
        self.metrics.refresh(self.core)
        self.dashboard.refresh(self.core, self.failures, self.restarts)
        return True

    def attach(self, name: str, resize: ResizeFn) -> None:
        """The coordinator of a restored pipeline."""
        self.core.require(name)
        self._coordinators[name] = resize

    def reconcile(self, reasserts: Mapping[str, ReassertFn],
                  departed: Mapping[str, ReassertFn] | None = None) -> None:
        """After a restore, before anything new is handed out: each pipeline's coordinator is
        told which of its shards the ledger has awake (the old instance's last calls may or may
        not have reached it), in two rounds: first every shard the ledger does not have awake is
        put to sleep, then the ones it has are woken where they are not. A wake waits for the
        sleeps on its GPUs, and every action planned from here on for the re-assertions on its
        GPUs and ranks, so no GPU gets a second awake holder. Pipelines that left just before
        the restart (`departed`) are told to keep nothing awake. A pipeline without a
        coordinator here cannot be told anything: it is failed. Then the first plan."""
        ledger = self.core.ledger
        rounds: list[tuple[str, set[int], range, ReassertFn, dict[int, list[int]]]] = []
        for name, spec in self.core.pipelines.items():
            fn = reasserts.get(name)
            if fn is None:
                continue
            shards = {rank: list(gpus) for rank, gpus in self.core.shard_gpus(name).items()}
            gpus = set(ledger.gpus_of(name)) | {g for (p, _), gs in ledger.last_shard_gpus.items()
                                                if p == name for g in gs}
            rounds.append((name, gpus, range(spec.max_shards), fn, shards))
            self.executor.submit_call("reassert", name, gpus, range(spec.max_shards),
                                      lambda fn=fn, shards=shards: fn(shards, False))
        for name, fn in (departed or {}).items():
            info = self.core.departed.get(name)
            if info is None or name in self.core.pipelines:
                continue
            self.executor.submit_call("reassert", name, {*info["gpus"], *info["freed"]}, (),
                                      lambda fn=fn: fn({}, False), report=False)
        for name, gpus, ranks, fn, shards in rounds:
            if shards:
                self.executor.submit_call("reassert", name, gpus, ranks,
                                          lambda fn=fn, shards=shards: fn(shards, True))
        for name in [n for n in self.core.pipelines if n not in reasserts]:
            self.pipeline_failed(name, "its coordinator was not restored after the scheduler's restart")
        self._replan("recovered")

    # ------------------------------------------------------------------ calls
    def register(self, spec: PipelineSpec, resize: ResizeFn, setting_up: bool = False) -> list[int]:
        """Returns the pipeline's training home (its trainer's GPUs), [] if it has none.
        `setting_up`: no GPUs for its shards until its `ready` (Progress.setting_up)."""
        if not spec.frees_memory and self.real_gpus:
            raise SchedulerError(f"pipeline {spec.name!r}: its shards cannot give GPU memory back when "
                                 "preempted (their engine refuses sleep mode here), so they cannot "
                                 "time-share real GPUs; use an engine that sleeps, or standalone mode")
        if not spec.frees_memory:
            log.info("pipeline %s: its preempted shards pause and keep their memory (fake GPUs: "
                     "nothing to hand over)", spec.name)
        self.core.register(spec, setting_up=setting_up)
        self._retry_unregisters.pop(spec.name, None)
        self._coordinators[spec.name] = resize
        if self._hold_for is not None:
            self._hold_for.discard(spec.name)
            if not self._hold_for:  # the last awaited registration: plan from here on
                self._hold_for = None
                self.holding = False
        self._replan(f"register {spec.name}")
        return sorted(self.core.ledger.train_home.get(spec.name, ()))

    def unregister(self, name: str) -> list[int]:
        """A live pipeline leaves: its shards are put to sleep before others get its GPUs. Its
        unregister re-sent after a restart (the old instance had done it) gets the same answer."""
        if name not in self.core.pipelines and name in self._retry_unregisters:
            return self._retry_unregisters.pop(name)
        gone = self.core.unregister(name)
        resize = self._coordinators.pop(name, None)
        if gone.shards and resize is not None:
            self.executor.submit(Plan(shrinks=gone.shards), {name: resize})
        self._fail_waiters(name, f"pipeline {name!r} was unregistered")
        self._replan(f"unregister {name}")
        return gone.freed_gpus

    def pipeline_failed(self, name: str, reason: str) -> None:
        """A pipeline's coordinator is dead: drop it without calling it, free its GPUs."""
        if name not in self.core.pipelines:
            return
        gone = self.core.unregister(name, "failure")
        self._coordinators.pop(name, None)
        self.failures.append({"pipeline": name, "reason": reason, "at": self.core.clock(),
                              "freed_gpus": gone.freed_gpus})
        log.warning("pipeline %s failed (%s); GPUs %s return to the pool",
                    name, reason, gone.freed_gpus)
        self._fail_waiters(name, f"pipeline {name!r} failed: {reason}")
        self._replan(f"{name} failed")

    def gpus_lost(self, gpus: list[int], reason: str) -> LostGpus:
        """A node left the cluster with these GPUs: they leave the ledger for good. Pipelines
        that had shards there are told to forget them (their processes went with the node);
        those whose training home was there can never train again and fail; the rest carry on."""
        lost = self.core.gpus_lost(gpus)
        shards: dict[str, list[ShardMove]] = {}
        for move in lost.shards:
            shards.setdefault(move.pipeline, []).append(move)
        for name, moves in shards.items():
            resize = self._coordinators.get(name)
            if resize is not None:
                self.executor.submit(Plan(shrinks=moves), {name: resize})
        for name in lost.homeless:
            self.pipeline_failed(name, f"its training GPUs were lost ({reason})")
        self._replan(f"GPUs {sorted(gpus)} lost")
        return lost

    async def request(self, pipeline: str, stage: Stage | str | int, gpus: int,
                      progress: Progress | None = None) -> list[int]:
        """Wait for GPUs for a stage. For rollout: wait until the pipeline has >= 1 awake
        shard and return all its shard GPUs. `progress` (e.g. "batch complete") is applied
        with the request, so the one re-plan that follows sees both."""
        stage = parse_stage(stage)
        if progress is not None:
            self.core.report_progress(progress)
        if stage is Stage.ROLLOUT:
            self._save()
            return await self._await_rollout(pipeline)
        self._retry_releases.pop(pipeline, None)
        recovered = self._recovered(pipeline, stage, gpus)
        if isinstance(recovered, Holding):
            self._save()  # the progress that came with it
            return await self._grant_again(recovered)
        return await self._wait_for_grant(pipeline, stage, gpus, recovered, "request")

    async def cycle(self, pipeline: str, stage: Stage | str | int, gpus: int,
                    progress: Progress | None = None) -> list[int]:
        """Release a stage and ask for it again, in one re-plan: a pipeline whose next batch is
        complete when a train step ends trains again without its GPUs being seen free in
        between (where the planner would lend them to another pipeline's rollouts, and the
        request that follows a moment later would wait for that shard's start or wake and its
        sleep). Other pending requests compete for them as usual. A stage not held (a restart
        lost it) is simply requested."""
        stage = parse_stage(stage)
        if stage is Stage.ROLLOUT:
            raise SchedulerError("rollout shards are placed by the planner, not cycled")
        if progress is not None:
            self.core.report_progress(progress)
        self._retry_releases.pop(pipeline, None)
        if self.core.ledger.stage_holding(pipeline, stage) is not None:
            try:
                self.core.release(pipeline, stage)
            except SchedulerError:
                self._save()
                raise
        return await self._wait_for_grant(pipeline, stage, gpus, None, "cycle")

    async def _wait_for_grant(self, pipeline: str, stage: Stage, gpus: int, recovered: GpuRequest | None,
                              why: str) -> list[int]:
        try:
            req = recovered or self.core.submit_request(pipeline, stage, gpus)
        except SchedulerError:
            self._save()  # the progress that came with it
            raise
        fut = asyncio.get_running_loop().create_future()
        self._waiters[req.id] = (pipeline, fut)
        self._replan(f"{why} {pipeline}/{stage.name.lower()} x{gpus}")
        try:
            return await fut
        except asyncio.CancelledError:
            self._abandon(req.id, pipeline, stage)
            raise
        finally:
            self._waiters.pop(req.id, None)

    def release(self, pipeline: str, stage: Stage | str | int, progress: Progress | None = None
                ) -> list[int]:
        """Free a stage's GPUs; `progress` (the pipeline's new demand) is applied first, so the
        one re-plan that follows sees both. A release re-sent after a restart (the old instance
        had done it) gets the same answer instead of "holds no GPUs"."""
        if progress is not None:
            self.core.report_progress(progress)
        stage = parse_stage(stage)
        retry = self._retry_releases.pop(pipeline, None)
        if (retry is not None and retry["stage"] == stage.name.lower()
                and pipeline in self.core.pipelines
                and self.core.ledger.stage_holding(pipeline, stage) is None):
            log.info("release of %s/%s came again after the restart: already done", pipeline,
                     retry["stage"])
            self._replan(f"progress {pipeline}")
            return list(retry["freed"])
        try:
            freed = self.core.release(pipeline, stage)
        except SchedulerError:
            self._save()
            raise
        self._replan(f"release {pipeline}/{stage.name.lower()}")
        return freed

    def ready(self, pipeline: str, engines_starting: frozenset[int] = frozenset()) -> None:
        """The pipeline finished setting up: planned for from now on, each pipeline as soon as
        it is ready (one waiting for the slowest to set up would idle the GPUs meanwhile).
        `engines_starting`: GPUs where its engines are still starting (`Progress`)."""
        if self.core.ready(pipeline, engines_starting):
            self._replan(f"ready {pipeline}")

    def report_progress(self, progress: Progress) -> None:
        self.core.report_progress(progress)
        self._replan(f"progress {progress.pipeline}")

    def shard_ranks(self, pipeline: str) -> list[int]:
        """The dp ranks of `pipeline`'s shards the plan places now (the ledger, as planned)."""
        return sorted(self.core.ledger.shards_of(pipeline))

    def role_changes(self, since: int = 0) -> list[dict]:
        return self.core.role_changes(since)

    def snapshot(self) -> dict:
        snap = self.core.snapshot()
        snap["in_flight"] = self.executor.in_flight()
        snap["busy_gpus"] = self.executor.busy_gpus()
        snap["failures"] = list(self.failures)
        snap["errors"] = list(self.errors)
        snap["timer_armed"] = self._timer is not None and not self._timer.done()
        snap["restarts"] = self.restarts
        # pipelines whose preempted shards keep their memory (pause, no sleep)
        snap["pause_only"] = sorted(n for n, spec in self.core.pipelines.items() if not spec.frees_memory)
        return snap

    async def settle(self) -> None:
        """Wait until every coordinator call so far has finished (tests, shutdown)."""
        await self.executor.drain()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for name in list(self._coordinators):
            self._fail_waiters(name, "scheduler is shutting down")
        await self.executor.close()

    # ------------------------------------------------------------------ internals
    def hold(self, until_registered: list[str] | None = None) -> None:
        """Plan nothing until `resume`, or until every pipeline named in `until_registered` has
        registered: lets several pipelines register before the first plan, so each one's training
        home is known (no other pipeline's shard goes where a trainer is still loading) before
        any pipeline that is ready gets GPUs. After that, each pipeline is planned for from its
        own `ready`: the first one set up does not wait for the last."""
        self.holding = True
        waiting = set(until_registered or ()) - set(self.core.pipelines)
        self._hold_for = waiting if until_registered is not None else None
        if until_registered is not None and not waiting:
            self.resume()
            return
        self._save()

    def resume(self) -> None:
        self.holding = False
        self._hold_for = None
        self._replan("resume")

    def _replan(self, reason: str) -> None:
        """Plan, persist, then start the plan's calls (they run only after this returns, so
        the state they act on is saved first)."""
        try:
            self._plan(reason)
        finally:
            self._save()
            self.metrics.refresh(self.core)
            self.dashboard.refresh(self.core, self.failures, self.restarts)

    def _plan(self, reason: str) -> None:
        if self.holding:
            return
        try:
            plan = self.metrics.replan(self.core, reason)
        except SchedulerError as exc:  # rejected by the ledger; core logged it
            self._record_error(reason, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a planner bug must not kill the service
            log.exception("planner failed (%s)", reason)
            self._record_error(reason, exc)
            return
        if not plan.is_empty():
            self.executor.submit(plan, self._coordinators)
            self._notify()
        self._arm_timer(plan.wake_at)

    def _arm_timer(self, wake_at: float | None) -> None:
        if self._timer is not None and not self._timer.done():
            self._timer.cancel()
        self._timer = None
        if wake_at is not None:
            delay = max(self.min_timer_s, wake_at - self.core.clock())
            self._timer = asyncio.get_running_loop().create_task(self._fire(delay))

    async def _fire(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._timer = None  # so the re-plan below does not cancel this running task
        self._replan("timer")

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def _on_grant(self, grant: Grant) -> None:
        entry = self._waiters.get(grant.request_id)
        if entry is not None and not entry[1].done():
            entry[1].set_result(list(grant.gpus))

    def _on_call_error(self, pipeline: str, exc: BaseException) -> None:
        if self.is_fatal(exc):
            self.pipeline_failed(pipeline, f"coordinator call failed: {exc!r}"[:500])
        else:
            self._record_error(f"resize_inference of {pipeline}", exc)

    def _record_error(self, what: str, exc: BaseException) -> None:
        self.errors.append({"what": what, "error": repr(exc)[:500], "at": self.core.clock()})

    def _fail_waiters(self, pipeline: str, message: str) -> None:
        for _, (name, fut) in list(self._waiters.items()):
            if name == pipeline and not fut.done():
                fut.set_exception(SchedulerError(message))
        self._notify()  # rollout waiters re-check and find the pipeline gone

    def _recovered(self, pipeline: str, stage: Stage, gpus: int) -> GpuRequest | Holding | None:
        """A request re-sent after a restart: the same request, still pending (the caller waits
        for it again), or its holding if it was granted before the restart (`_grant_again`);
        None for a new request."""
        if not self._recovered_ids or pipeline not in self.core.pipelines:
            return None
        self._recovered_ids &= set(self.core.pending) | {
            h.request_id for h in self.core.ledger.holdings.values() if h.request_id is not None}
        for rid in sorted(self._recovered_ids):
            req = self.core.pending.get(rid)
            if req is not None and (req.pipeline, req.stage, req.gpus) == (pipeline, stage, gpus):
                self._recovered_ids.discard(rid)
                log.info("request %d of %s/%s came again after the restart: waiting for it again",
                         rid, pipeline, stage.name.lower())
                return req
        held = self.core.ledger.stage_holding(pipeline, stage)
        if held is not None and held.request_id in self._recovered_ids and len(held.gpus) == gpus:
            self._recovered_ids.discard(held.request_id)
            return held
        return None

    async def _grant_again(self, held: Holding) -> list[int]:
        """A grant made before the restart, asked for again: its GPUs once every call on them
        (the re-assertions of their former holders) has finished, as a first grant would be."""
        pipeline, stage, rid = held.pipeline, held.stage, held.request_id
        log.info("request %s of %s/%s came again after the restart: it was granted GPUs %s",
                 rid, pipeline, stage.name.lower(), list(held.gpus))
        try:
            await self.executor.settled(held.gpus)
        except asyncio.CancelledError:
            if rid is not None:
                self._abandon(rid, pipeline, stage)
            raise
        self._require(pipeline)
        now = self.core.ledger.stage_holding(pipeline, stage)
        if now is None or now.request_id != rid:
            raise SchedulerError(f"{pipeline}: its {stage.name.lower()} GPUs granted before the "
                                 f"scheduler's restart were taken back meanwhile")
        return list(now.gpus)

    def _abandon(self, request_id: int, pipeline: str, stage: Stage) -> None:
        """The caller stopped waiting: drop the request, or give back what it was granted."""
        if self.core.cancel_request(request_id) is not None:
            self._replan(f"cancel {pipeline}/{stage.name.lower()}")
            return
        held = (self.core.ledger.stage_holding(pipeline, stage)
                if pipeline in self.core.pipelines else None)
        if held is not None and held.request_id == request_id:
            self.release(pipeline, stage)

    async def _await_rollout(self, pipeline: str) -> list[int]:
        while True:
            self._require(pipeline)
            shards = self.core.shard_gpus(pipeline)
            if not shards:
                await self._changed.wait()
                continue
            await self.executor.settled(g for gpus in shards.values() for g in gpus)
            if pipeline in self.core.pipelines and self.core.shard_gpus(pipeline) == shards:
                return sorted(g for gpus in shards.values() for g in gpus)

    def _require(self, pipeline: str) -> None:
        if pipeline not in self.core.pipelines:
            why = next((f["reason"] for f in reversed(self.failures) if f["pipeline"] == pipeline),
                       None)
            suffix = f" (it failed: {why})" if why else ""
            raise UnknownPipelineError(f"pipeline {pipeline!r} is not registered{suffix}")
