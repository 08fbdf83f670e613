"""The scheduler as a service: an event loop around `SchedulerCore`, and its Ray actor.

`AsyncScheduler` is the event-driven part without Ray: it re-plans after every call and when
a plan's `wake_at` passes, hands plans to the executor, and resolves the callers waiting in
`request()`. `SchedulerService` is the thin Ray actor ("rlix:scheduler" in namespace "rlix")
around it; it adds Ray handles and the coordinator liveness check. Plans are logged at INFO
on the `rlix.scheduler` logger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from rlix import env
from rlix.errors import SchedulerError, UnknownPipelineError
from rlix.scheduler.core import PlanFn, SchedulerCore, parse_stage
from rlix.scheduler.executor import PlanExecutor, ResizeFn, ray_resize
from rlix.scheduler.planner import PlannerParams
from rlix.scheduler.types import Grant, PipelineSpec, Plan, Progress, Stage, Topology

log = logging.getLogger("rlix.scheduler")

ACTOR_NAME = "rlix:scheduler"
NAMESPACE = "rlix"


class AsyncScheduler:
    """Scheduler state plus the asyncio machinery to act on it; one event loop, no locks
    (every state change happens between awaits). `is_fatal(exc)` says whether a failed
    coordinator call means the pipeline is dead."""

    def __init__(self, topology: Topology, params: PlannerParams | None = None, *,
                 clock: Callable[[], float] = time.monotonic, plan_fn: PlanFn | None = None,
                 is_fatal: Callable[[BaseException], bool] = lambda exc: False,
                 call_timeout_s: float | None = None, min_timer_s: float = 0.05,
                 real_gpus: bool = False) -> None:
        self.core = SchedulerCore(topology, params, clock=clock, plan_fn=plan_fn)
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
        self._coordinators[spec.name] = resize
        self._replan(f"register {spec.name}")
        return sorted(self.core.ledger.train_home.get(spec.name, ()))

    def unregister(self, name: str) -> list[int]:
        """A live pipeline leaves: its shards are put to sleep before others get its GPUs."""
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
        gone = self.core.unregister(name)
        self._coordinators.pop(name, None)
        self.failures.append({"pipeline": name, "reason": reason, "at": self.core.clock(),
                              "freed_gpus": gone.freed_gpus})
        log.warning("pipeline %s failed (%s); GPUs %s return to the pool",
                    name, reason, gone.freed_gpus)
        self._fail_waiters(name, f"pipeline {name!r} failed: {reason}")
        self._replan(f"{name} failed")

    async def request(self, pipeline: str, stage: Stage | str | int, gpus: int,
                      progress: Progress | None = None) -> list[int]:
        """Wait for GPUs for a stage. For rollout: wait until the pipeline has >= 1 awake
        shard and return all its shard GPUs. `progress` (e.g. "batch complete") is applied
        with the request, so the one re-plan that follows sees both."""
        stage = parse_stage(stage)
        if progress is not None:
            self.core.report_progress(progress)
        if stage is Stage.ROLLOUT:
            return await self._await_rollout(pipeline)
        req = self.core.submit_request(pipeline, stage, gpus)
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
        one re-plan that follows sees both."""
        if progress is not None:
            self.core.report_progress(progress)
        freed = self.core.release(pipeline, stage)
        self._replan(f"release {pipeline}/{parse_stage(stage).name.lower()}")
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

    def resume(self) -> None:
        self.holding = False
        self._replan("resume")

    def _replan(self, reason: str) -> None:
        if self.holding:
            return
        try:
            plan = self.core.replan(reason)
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


@ray.remote(num_cpus=0)
class SchedulerService:
    """The Ray face of `AsyncScheduler`. Start it with `start_scheduler`."""

    def __init__(self, topology: Topology, params: PlannerParams | None = None,
                 liveness_interval_s: float = 2.0, ping_timeout_s: float = 3.0,
                 call_timeout_s: float | None = None, real_gpus: bool = False) -> None:
        if not log.handlers and log.level == logging.NOTSET:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False  # one line per event even if Ray configured the root logger
        self._sched = AsyncScheduler(topology, params, is_fatal=_is_dead,
                                     call_timeout_s=call_timeout_s, real_gpus=real_gpus)
        self._handles: dict[str, object] = {}
        self._liveness_interval_s = liveness_interval_s
        self._ping_timeout_s = ping_timeout_s
        self._liveness: asyncio.Task | None = None

    def _start(self) -> None:
        if self._liveness is None or self._liveness.done():
            self._liveness = asyncio.get_running_loop().create_task(self._check_liveness())

    async def ping(self) -> dict:
        self._start()
        return {"gpus_per_node": list(self._sched.core.ledger.topology.gpus_per_node)}

    async def register(self, spec: PipelineSpec, coordinator) -> list[int]:
        """Returns the pipeline's training home (where a bound trainer is placed)."""
        self._start()
        if not isinstance(coordinator, ray.actor.ActorHandle):
            raise SchedulerError(f"register {getattr(spec, 'name', spec)!r}: coordinator must be "
                                 f"a Ray actor handle, got {type(coordinator).__name__}")
        home = self._sched.register(spec, ray_resize(coordinator))
        self._handles[spec.name] = coordinator
        return home

    async def unregister(self, name: str) -> list[int]:
        self._handles.pop(name, None)
        return self._sched.unregister(name)

    async def pipeline_failed(self, name: str, reason: str) -> None:
        """The run found this pipeline dead or hung: drop it without calling it; its GPUs go
        back to the pool now (not at the next liveness round)."""
        self._handles.pop(name, None)
        self._sched.pipeline_failed(name, reason)

    async def request(self, pipeline: str, stage: Stage | str | int, gpus: int = 0,
                      progress: Progress | None = None) -> list[int]:
        return await self._sched.request(pipeline, stage, gpus, progress)

    async def release(self, pipeline: str, stage: Stage | str | int,
                      progress: Progress | None = None) -> list[int]:
        return self._sched.release(pipeline, stage, progress)

    async def report_progress(self, progress: Progress) -> None:
        self._sched.report_progress(progress)

    async def hold(self) -> None:
        self._sched.hold()

    async def resume(self) -> None:
        self._sched.resume()

    async def role_changes(self, since: int = 0) -> list[dict]:
        """Every GPU role/owner change numbered after `since` (what `rlix run` logs)."""
        return self._sched.role_changes(since)

    async def snapshot(self) -> dict:
        return self._sched.snapshot()

    async def audit(self) -> dict:
        """The ledger's invariants checked now, and who holds what (after a failure, the run
        records that the dead pipeline holds nothing)."""
        ledger = self._sched.core.ledger
        try:
            ledger.check_invariants()
            error = None
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a check
            error = f"{type(exc).__name__}: {exc}"
        holders = sorted({h.pipeline for h in ledger.holdings.values()})
        return {"ok": error is None, "error": error, "pipelines": sorted(self._sched.core.pipelines),
                "holders": holders}

    async def settle(self) -> None:
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
                        del self._handles[name]
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
                    call_timeout_s: float | None = None, real_gpus: bool = False):
    """Start the scheduler actor, or get the running one; returns its handle once ready.
    `real_gpus`: the GPUs are real (not fake ones on CPU), see AsyncScheduler.

    `topology` None or "auto" reads it from Ray. An existing scheduler with another topology
    is an error, not silently reused.
    """
    _ensure_ray()
    if topology is None or topology == "auto":
        topology = topology_from_ray()
    if not isinstance(topology, Topology):
        raise SchedulerError(f"topology must be a Topology or 'auto', got {topology!r}")
    options: dict = {"name": ACTOR_NAME, "namespace": NAMESPACE, "get_if_exists": True}
    if detached:
        options["lifetime"] = "detached"
    handle = SchedulerService.options(**options).remote(
        topology, params, liveness_interval_s=liveness_interval_s, call_timeout_s=call_timeout_s,
        real_gpus=real_gpus)
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
