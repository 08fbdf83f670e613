"""The scheduler as a service: an event loop around `SchedulerCore`, and its Ray actor.

`AsyncScheduler` is the event-driven part without Ray: it re-plans after every call and when
a plan's `wake_at` passes, hands plans to the executor, and resolves the callers waiting in
`request()`. `SchedulerService` is the thin Ray actor ("rlix:scheduler" in namespace "rlix")
around it; it adds Ray handles and the coordinator liveness check. Plans are logged at INFO
on the `rlix.scheduler` logger.

Surviving its own death: the state is saved (rlix.scheduler.persistence) to Ray's GCS key-value
store at every change, before any coordinator call or answer that depends on it goes out. Ray
restarts the actor (max_restarts) and re-sends the calls that were in flight (max_task_retries);
the new instance loads the state, re-asserts every pipeline's shards to its coordinator before
anything new is handed out, and answers the re-sent calls as the old one would have.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlix import env
from rlix.errors import SchedulerError, SchedulerStateError, UnknownPipelineError
from rlix.scheduler.core import LostGpus, PlanFn, SchedulerCore, parse_stage
from rlix.scheduler.executor import PlanExecutor, ReassertFn, ResizeFn, ray_reassert, ray_resize
from rlix.scheduler.metrics import SchedulerMetrics
from rlix.scheduler.persistence import SchedulerPersistence, ServiceState
from rlix.scheduler.planner import PlannerParams
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

ACTOR_NAME = "rlix:scheduler"
NAMESPACE = "rlix"
#: the scheduler's keys in Ray's GCS key-value store (namespace NAMESPACE); a fresh scheduler
#: deletes everything under it, a restarted one reads its own actor id's part
STATE_PREFIX = "rlix:scheduler:state:"
#: handles kept of pipelines that left (their last sleeps may be in flight at a restart)
DEPARTED_HANDLES_KEPT = 16


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
    def register(self, spec: PipelineSpec, resize: ResizeFn) -> list[int]:
        """Returns the pipeline's training home (its trainer's GPUs), [] if it has none."""
        if not spec.frees_memory and self.real_gpus:
            raise SchedulerError(f"pipeline {spec.name!r}: its shards cannot give GPU memory back when "
                                 "preempted (their engine refuses sleep mode here), so they cannot "
                                 "time-share real GPUs; use an engine that sleeps, or standalone mode")
        if not spec.frees_memory:
            log.info("pipeline %s: its preempted shards pause and keep their memory (fake GPUs: "
                     "nothing to hand over)", spec.name)
        self.core.register(spec)
        self._retry_unregisters.pop(spec.name, None)
        self._coordinators[spec.name] = resize
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
        try:
            req = recovered or self.core.submit_request(pipeline, stage, gpus)
        except SchedulerError:
            self._save()  # the progress that came with it
            raise
        fut = asyncio.get_running_loop().create_future()
        self._waiters[req.id] = (pipeline, fut)
        self._replan(f"request {pipeline}/{stage.name.lower()} x{gpus}")
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

    def report_progress(self, progress: Progress) -> None:
        self.core.report_progress(progress)
        self._replan(f"progress {progress.pipeline}")

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
    def hold(self) -> None:
        """Plan nothing until `resume`: lets several pipelines register before the first plan
        (placed shards start where that plan puts them; a plan per registration would start one
        pipeline's shards only to move them for the next)."""
        self.holding = True
        self._save()

    def resume(self) -> None:
        self.holding = False
        self._replan("resume")

    def _replan(self, reason: str) -> None:
        """Plan, persist, then start the plan's calls (they run only after this returns, so
        the state they act on is saved first)."""
        try:
            self._plan(reason)
        finally:
            self._save()
            self.metrics.refresh(self.core)

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


# ---------------------------------------------------------------------- Ray
def _is_dead(exc: BaseException) -> bool:
    """A coordinator is dead for good; a restarting one (unavailable) is not."""
    return isinstance(exc, RayActorError) and not isinstance(exc, ActorUnavailableError)


class RayKVStore:
    """Ray's GCS key-value store as a `StateStore`: it lives as long as the Ray cluster, not the
    scheduler's worker process."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace

    def get(self, key: str) -> bytes | None:
        return internal_kv._internal_kv_get(key, namespace=self.namespace)

    def put(self, key: str, value: bytes) -> None:
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=self.namespace)

    def delete(self, key: str) -> None:
        internal_kv._internal_kv_del(key, namespace=self.namespace)

    def delete_prefix(self, prefix: str) -> None:
        internal_kv._internal_kv_del(prefix, del_by_prefix=True, namespace=self.namespace)


@ray.remote(num_cpus=0)
class SchedulerService:
    """The Ray face of `AsyncScheduler`. Start it with `start_scheduler` (which has Ray restart
    it if its worker dies; a restarted instance carries on from the persisted state)."""

    def __init__(self, topology: Topology, params: PlannerParams | None = None,
                 liveness_interval_s: float = 2.0, ping_timeout_s: float = 3.0,
                 call_timeout_s: float | None = None, real_gpus: bool = False,
                 metrics_port: int | None = None) -> None:
        if not log.handlers and log.level == logging.NOTSET:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False  # one line per event even if Ray configured the root logger
        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's own use of a deprecated property inside it
            warnings.simplefilter("ignore", DeprecationWarning)
            reconstructed = ctx.was_current_actor_reconstructed
        store = RayKVStore()
        self._persistence = SchedulerPersistence(store, f"{STATE_PREFIX}{ctx.get_actor_id()}:")
        self._sched = AsyncScheduler(topology, params, is_fatal=_is_dead,
                                     call_timeout_s=call_timeout_s, real_gpus=real_gpus,
                                     persistence=self._persistence)
        self._handles: dict[str, object] = {}
        # pipelines that left, newest last: after a restart they are told to keep nothing awake
        self._departed: OrderedDict[str, object] = OrderedDict()
        self._liveness_interval_s = liveness_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._liveness: asyncio.Task | None = None
        self._broken: str | None = None  # a restart whose state could not be read
        self._to_reconcile = False
        self._metrics = self._serve_metrics(metrics_port)
        if reconstructed:
            self._recover()
        else:
            store.delete_prefix(STATE_PREFIX)  # a scheduler that died for good left its state
            self._sched._save()  # from now on a restart finds a state, even an empty one

    def _serve_metrics(self, port: int | None) -> dict:
        """The Prometheus registry over HTTP on 127.0.0.1 (a thread of this process); port 0
        picks a free one. A port it cannot listen on is reported, not raised: the scheduler works
        without its metrics, and `rlix run` says so and stops."""
        if port is None:
            return {"url": None, "error": None}
        try:
            bound = self._sched.metrics.serve(port)
        except OSError as exc:
            log.error("scheduler metrics: cannot listen on 127.0.0.1:%d: %s", port, exc.strerror or exc)
            return {"url": None, "error": f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}"}
        url = f"http://127.0.0.1:{bound}/metrics"
        log.info("scheduler metrics at %s", url)
        return {"url": url, "error": None}

    # ------------------------------------------------------------------ restart
    def _recover(self) -> None:
        """Ray restarted this actor: load the state and the coordinators' handles. The
        coordinators are re-asserted by the first call (`_start`: it needs the event loop)."""
        try:
            restored = self._sched.restore()
            handles = self._load_handles()
        except SchedulerStateError as exc:
            self._broken = str(exc)
            log.error("scheduler restarted but cannot go on: %s", exc)
            return
        if not restored:
            log.error("scheduler restarted but found no saved state (deleted by another "
                      "scheduler's start?): starting empty")
            return
        core = self._sched.core
        self._handles = {n: h for n, h in handles.get("registered", {}).items() if n in core.pipelines}
        self._departed = OrderedDict((n, h) for n, h in handles.get("departed", {}).items()
                                     if n in core.departed and n not in core.pipelines)
        for name, handle in self._handles.items():
            self._sched.attach(name, ray_resize(handle))
        self._to_reconcile = True
        log.warning("scheduler restarted (restart %d): %d pipeline(s), %d holding(s), %d pending "
                    "request(s), %d role change(s) restored", self._sched.restarts,
                    len(core.pipelines), len(core.ledger.holdings), len(core.pending), core.role_seq)

    def _load_handles(self) -> dict:
        blob = self._persistence.get_blob("handles")
        if blob is None:
            return {}
        try:
            return ray.cloudpickle.loads(blob)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same
            raise SchedulerStateError(f"the scheduler's saved coordinator handles are unreadable: "
                                      f"{type(exc).__name__}: {exc}") from None

    def _save_handles(self, extra: Mapping[str, object] | None = None) -> None:
        """The coordinators' handles (a handle pickles to its actor id; it works in the
        restarted process), saved before the state that names their pipelines."""
        registered = {**self._handles, **(extra or {})}
        self._persistence.put_blob("handles", ray.cloudpickle.dumps(
            {"registered": registered, "departed": dict(self._departed)}))

    def _start(self) -> None:
        """Every call starts here: a broken restart refuses it; the first call after a restart
        re-asserts the coordinators before its own work; the liveness check runs."""
        if self._broken is not None:
            raise SchedulerStateError(self._broken)
        if self._to_reconcile:
            self._to_reconcile = False
            self._sched.reconcile({n: ray_reassert(h) for n, h in self._handles.items()},
                                  {n: ray_reassert(h) for n, h in self._departed.items()})
        if self._liveness is None or self._liveness.done():
            self._liveness = asyncio.get_running_loop().create_task(self._check_liveness())

    # ------------------------------------------------------------------ calls
    async def ping(self) -> dict:
        self._start()
        return {"gpus_per_node": list(self._sched.core.ledger.topology.gpus_per_node)}

    async def metrics_endpoint(self) -> dict:
        """{"url", "error"} of the Prometheus endpoint (url None: not served; error: why not)."""
        return dict(self._metrics)

    async def pid(self) -> int:
        """The worker process's PID (what a fault test kills)."""
        return os.getpid()

    async def register(self, spec: PipelineSpec, coordinator) -> list[int]:
        """Returns the pipeline's training home (where a bound trainer is placed). The same
        registration again (same spec, same coordinator actor: a call re-sent after a restart)
        gets the same answer."""
        self._start()
        if not isinstance(coordinator, ray.actor.ActorHandle):
            raise SchedulerError(f"register {getattr(spec, 'name', spec)!r}: coordinator must be "
                                 f"a Ray actor handle, got {type(coordinator).__name__}")
        core = self._sched.core
        known = self._handles.get(getattr(spec, "name", None))
        if (known is not None and core.pipelines.get(spec.name) == spec
                and known._actor_id == coordinator._actor_id):
            return sorted(core.ledger.train_home.get(spec.name, ()))
        self._save_handles(extra={spec.name: coordinator})
        try:
            home = self._sched.register(spec, ray_resize(coordinator))
        except BaseException:
            self._save_handles()
            raise
        self._handles[spec.name] = coordinator
        self._departed.pop(spec.name, None)
        return home

    async def unregister(self, name: str) -> list[int]:
        self._start()
        handle = self._handles.pop(name, None)
        if handle is not None:
            self._departed[name] = handle
            while len(self._departed) > DEPARTED_HANDLES_KEPT:
                self._departed.popitem(last=False)
            self._save_handles()
        return self._sched.unregister(name)

    async def pipeline_failed(self, name: str, reason: str) -> None:
        """The run found this pipeline dead or hung: drop it without calling it; its GPUs go
        back to the pool now (not at the next liveness round)."""
        self._start()
        self._drop_handle(name)
        self._sched.pipeline_failed(name, reason)

    async def gpus_lost(self, gpus: list[int], reason: str) -> LostGpus:
        """The run saw a node leave with these GPUs (see AsyncScheduler.gpus_lost)."""
        self._start()
        lost = self._sched.gpus_lost(gpus, reason)
        for name in lost.homeless:
            self._drop_handle(name)
        return lost

    def _drop_handle(self, name: str) -> None:
        if self._handles.pop(name, None) is not None or self._departed.pop(name, None) is not None:
            self._save_handles()

    async def request(self, pipeline: str, stage: Stage | str | int, gpus: int = 0,
                      progress: Progress | None = None) -> list[int]:
        self._start()
        return await self._sched.request(pipeline, stage, gpus, progress)

    async def release(self, pipeline: str, stage: Stage | str | int,
                      progress: Progress | None = None) -> list[int]:
        self._start()
        return self._sched.release(pipeline, stage, progress)

    async def report_progress(self, progress: Progress) -> None:
        self._start()
        self._sched.report_progress(progress)

    async def hold(self) -> None:
        self._start()
        self._sched.hold()

    async def resume(self) -> None:
        self._start()
        self._sched.resume()

    async def role_changes(self, since: int = 0) -> list[dict]:
        """Every GPU role/owner change numbered after `since` (what `rlix run` logs); the
        numbering goes on across a restart."""
        self._start()
        return self._sched.role_changes(since)

    async def snapshot(self) -> dict:
        self._start()
        return self._sched.snapshot()

    async def audit(self) -> dict:
        """The ledger's invariants checked now, and who holds what (after a failure, the run
        records that the dead pipeline holds nothing)."""
        self._start()
        ledger = self._sched.core.ledger
        try:
            ledger.check_invariants()
            error = None
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a check
            error = f"{type(exc).__name__}: {exc}"
        holders = sorted({h.pipeline for h in ledger.holdings.values()})
        return {"ok": error is None, "error": error, "pipelines": sorted(self._sched.core.pipelines),
                "holders": holders, "restarts": self._sched.restarts}

    async def settle(self) -> None:
        self._start()
        await self._sched.settle()

    async def _check_liveness(self) -> None:
        """Every few seconds ping each coordinator; a dead one takes its pipeline with it.
        A ping that merely times out (a busy actor) is not death."""
        while True:
            await asyncio.sleep(self._liveness_interval_s)
            try:
                for name in [n for n in self._handles if n not in self._sched.core.pipelines]:
                    del self._handles[name]  # already gone through another path
                handles = dict(self._handles)
                results = await asyncio.gather(*(self._ping(h) for h in handles.values()))
                for (name, handle), dead in zip(handles.items(), results):
                    if dead is not None and self._handles.get(name) is handle:
                        self._drop_handle(name)
                        self._sched.pipeline_failed(name, dead)
            except Exception:  # noqa: BLE001 - keep checking whatever one round hit
                log.exception("liveness check failed")

    async def _ping(self, handle) -> str | None:
        async def once():
            return await handle.__ray_ready__.remote()

        try:
            await asyncio.wait_for(once(), self._ping_timeout_s)
        except asyncio.TimeoutError:
            return None
        except Exception as exc:  # noqa: BLE001
            if _is_dead(exc):
                return f"coordinator actor died: {type(exc).__name__}"
            log.warning("liveness ping failed: %r", exc)
        return None


def topology_from_ray() -> Topology:
    """GPUs per alive Ray node (for `cluster: auto`), nodes in a stable order. Fake GPUs from
    `ray.init(num_gpus=N)` count too, which is what lets tests run on CPU."""
    _ensure_ray()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    nodes.sort(key=lambda n: (n.get("NodeManagerAddress", ""), n.get("NodeID", "")))
    counts = tuple(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
    counts = tuple(c for c in counts if c > 0)
    if not counts:
        raise SchedulerError("the Ray cluster reports no GPUs (start it with --num-gpus or "
                             "ray.init(num_gpus=N) to fake some)")
    return Topology(counts)


def start_scheduler(topology: Topology | str | None = None, params: PlannerParams | None = None,
                    *, detached: bool = False, liveness_interval_s: float = 2.0,
                    call_timeout_s: float | None = None, real_gpus: bool = False,
                    metrics_port: int | None = None):
    """Start the scheduler actor, or get the running one; returns its handle once ready.
    `real_gpus`: the GPUs are real (not fake ones on CPU), see AsyncScheduler. `metrics_port`:
    serve its Prometheus metrics on 127.0.0.1 there (0: a free port; `metrics_endpoint()` says
    which); None: not served.

    `topology` None or "auto" reads it from Ray. An existing scheduler with another topology
    is an error, not silently reused.
    """
    _ensure_ray()
    if topology is None or topology == "auto":
        topology = topology_from_ray()
    if not isinstance(topology, Topology):
        raise SchedulerError(f"topology must be a Topology or 'auto', got {topology!r}")
    # Ray restarts it if its worker dies and re-sends the calls that were in flight; the new
    # instance carries on from the state saved at every change (see the module doc)
    options: dict = {"name": ACTOR_NAME, "namespace": NAMESPACE, "get_if_exists": True,
                     "max_restarts": -1, "max_task_retries": -1}
    if detached:
        options["lifetime"] = "detached"
    else:  # beside the run's driver: a lost node elsewhere leaves it be
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)
    handle = SchedulerService.options(**options).remote(
        topology, params, liveness_interval_s=liveness_interval_s, call_timeout_s=call_timeout_s,
        real_gpus=real_gpus, metrics_port=metrics_port)
    info = ray.get(handle.ping.remote())
    if tuple(info["gpus_per_node"]) != topology.gpus_per_node:
        raise SchedulerError(f"a scheduler is already running with topology "
                             f"{info['gpus_per_node']}, not {list(topology.gpus_per_node)}")
    return handle


def get_scheduler():
    """Handle of the running scheduler; SchedulerError if there is none."""
    _ensure_ray()
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        raise SchedulerError(f"no scheduler actor {ACTOR_NAME!r} in namespace {NAMESPACE!r}; "
                             f"start one with start_scheduler()") from None


def _ensure_ray() -> None:
    if not ray.is_initialized():
        ray.init(address=env.ray_address())
