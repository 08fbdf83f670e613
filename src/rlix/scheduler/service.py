"""The scheduler as a Ray service: `SchedulerService` ("rlix:scheduler" in namespace "rlix") is
the thin actor around `rlix.scheduler.async_scheduler.AsyncScheduler`; it adds Ray handles, the
coordinator liveness check, the metrics endpoint and the dashboard page (rlix.scheduler.dashboard).
`start_scheduler` / `get_scheduler` are how the rest of rlix reaches it.

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
from collections import OrderedDict
from collections.abc import Callable, Mapping

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlix import env
from rlix.errors import SchedulerError, SchedulerStateError
from rlix.scheduler.async_scheduler import AsyncScheduler
from rlix.scheduler.core import LostGpus
from rlix.scheduler.curves import JobRow
from rlix.scheduler.dashboard import DashboardServer, DashboardState
from rlix.scheduler.executor import ray_reassert, ray_resize
from rlix.scheduler.persistence import SchedulerPersistence
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Progress, Stage, Topology

log = logging.getLogger("rlix.scheduler")

ACTOR_NAME = "rlix:scheduler"
NAMESPACE = "rlix"
#: the scheduler's keys in Ray's GCS key-value store (namespace NAMESPACE); a fresh scheduler
#: deletes everything under it, a restarted one reads its own actor id's part
STATE_PREFIX = "rlix:scheduler:state:"
#: handles kept of pipelines that left (their last sleeps may be in flight at a restart)
DEPARTED_HANDLES_KEPT = 16


def _serve(what: str, port: int | None, serve: Callable[[int], int], path: str) -> dict:
    """{"url", "error"} of a server started on 127.0.0.1:port (None: not asked for)."""
    if port is None:
        return {"url": None, "error": None}
    try:
        bound = serve(port)
    except OSError as exc:
        log.error("scheduler %s: cannot listen on 127.0.0.1:%d: %s", what, port, exc.strerror or exc)
        return {"url": None, "error": f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}"}
    url = f"http://127.0.0.1:{bound}{path}"
    log.info("scheduler %s at %s", what, url)
    return {"url": url, "error": None}


def _is_dead(exc: BaseException) -> bool:
    """A coordinator is dead for good; a restarting one (unavailable) is not, and neither is
    one whose call raised an error of its own (a RayTaskError, even one wrapping the death of
    another actor it called: a shard actor on a node that just left)."""
    return (isinstance(exc, RayActorError) and not isinstance(exc, ActorUnavailableError)
            and not isinstance(exc, RayTaskError))


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
                 metrics_port: int | None = None, dashboard_port: int | None = None,
                 held: bool = False) -> None:
        init_at = time.time()
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
        feed = self._sched.dashboard
        self._dashboard_server = DashboardServer(feed.state, feed.curve_state, feed.jobs)
        if reconstructed:
            self._recover()
        else:
            store.delete_prefix(STATE_PREFIX)  # a scheduler that died for good left its state
            if held:  # before any call can reach it: nobody registers ahead of the hold
                self._sched.hold()
            self._sched._save()  # from now on a restart finds a state, even an empty one
        self._dashboard = self._serve_dashboard(dashboard_port)  # after a restore: its state shown
        #: wall-clock times of this instance's start and of each registration's arrival and
        #: answer: where a run's start-up waits on the scheduler (`startup_times`)
        self._times: dict = {"init_at": init_at, "up_at": time.time(), "registered": {}}

    def _serve_metrics(self, port: int | None) -> dict:
        """The Prometheus registry over HTTP on 127.0.0.1 (a thread of this process); port 0
        picks a free one. A port it cannot listen on is reported, not raised: the scheduler works
        without its metrics, and `rlix run` says so and stops."""
        return _serve("metrics", port, self._sched.metrics.serve, "/metrics")

    def _serve_dashboard(self, port: int | None) -> dict:
        """The dashboard page and its JSON on 127.0.0.1 (a thread of this process), as the
        metrics are: port 0 picks a free one; a port it cannot listen on is reported."""
        if port is not None:
            sched = self._sched
            sched.dashboard.start(sched.core, sched.failures, sched.restarts)
        return _serve("dashboard", port, self._dashboard_server.serve, "/")

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
        for name, path in handles.get("metrics", {}).items():
            self._sched.dashboard.curves.watch(name, path)
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
            {"registered": registered, "departed": dict(self._departed),
             "metrics": self._sched.dashboard.curves.paths()}))

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
    async def startup_times(self) -> dict:
        """{"init_at", "up_at": when this instance's constructor began and ended,
        "registered": {pipeline: [arrived, answered]}} (wall clock, seconds since the epoch)."""
        return {**self._times, "registered": dict(self._times["registered"])}

    async def ping(self) -> dict:
        self._start()
        return {"gpus_per_node": list(self._sched.core.ledger.topology.gpus_per_node)}

    async def metrics_endpoint(self) -> dict:
        """{"url", "error"} of the Prometheus endpoint (url None: not served; error: why not)."""
        return dict(self._metrics)

    async def dashboard_endpoint(self) -> dict:
        """{"url", "error"} of the dashboard page (url None: not served; error: why not)."""
        return dict(self._dashboard)

    async def show_jobs(self, rows: list[JobRow]) -> None:
        """A shared cluster's jobs now, for the dashboard's queue (the head pushes them)."""
        self._sched.dashboard.set_jobs(rows)

    async def view(self, window_s: float = 60.0) -> DashboardState:
        """The dashboard's pipelines table and GPU rows now (what `rlix status` shows); the
        dashboard's bookkeeping starts at the first call when no page is served."""
        sched = self._sched
        if not sched.dashboard.active:
            sched.dashboard.start(sched.core, sched.failures, sched.restarts)
        return sched.dashboard.state(window_s)

    async def pid(self) -> int:
        """The worker process's PID (what a fault test kills)."""
        return os.getpid()

    async def register(self, spec: PipelineSpec, coordinator, setting_up: bool = False,
                       metrics_path: str | None = None) -> list[int]:
        """Returns the pipeline's training home (where a bound trainer is placed). The same
        registration again (same spec, same coordinator actor: a call re-sent after a restart)
        gets the same answer. `setting_up`: its shards get GPUs from its `ready` on.
        `metrics_path`: its metrics.jsonl, whose reward and eval curves the dashboard draws."""
        arrived = time.time()
        self._start()
        if not isinstance(coordinator, ray.actor.ActorHandle):
            raise SchedulerError(f"register {getattr(spec, 'name', spec)!r}: coordinator must be "
                                 f"a Ray actor handle, got {type(coordinator).__name__}")
        if metrics_path is not None:
            self._sched.dashboard.curves.watch(spec.name, metrics_path)
        core = self._sched.core
        known = self._handles.get(getattr(spec, "name", None))
        if (known is not None and core.pipelines.get(spec.name) == spec
                and known._actor_id == coordinator._actor_id):
            return sorted(core.ledger.train_home.get(spec.name, ()))
        self._save_handles(extra={spec.name: coordinator})
        try:
            home = self._sched.register(spec, ray_resize(coordinator), setting_up=setting_up)
        except BaseException:
            self._save_handles()
            raise
        self._handles[spec.name] = coordinator
        self._departed.pop(spec.name, None)
        self._times["registered"][spec.name] = [arrived, time.time()]
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

    async def cycle(self, pipeline: str, stage: Stage | str | int, gpus: int = 0,
                    progress: Progress | None = None) -> list[int]:
        """Release a stage and request it again in one re-plan (AsyncScheduler.cycle)."""
        self._start()
        return await self._sched.cycle(pipeline, stage, gpus, progress)

    async def ready(self, pipeline: str, engines_starting: frozenset[int] = frozenset()) -> None:
        """The pipeline's set-up ended: plan for it now (`engines_starting`: see `Progress`)."""
        self._start()
        self._sched.ready(pipeline, engines_starting)

    async def report_progress(self, progress: Progress) -> None:
        self._start()
        self._sched.report_progress(progress)

    async def shard_ranks(self, pipeline: str) -> list[int]:
        """The pipeline's shards the plan places now (dp ranks)."""
        self._start()
        return self._sched.shard_ranks(pipeline)

    async def hold(self, until_registered: list[str] | None = None) -> None:
        """See AsyncScheduler.hold."""
        self._start()
        self._sched.hold(until_registered)

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
                    metrics_port: int | None = None, dashboard_port: int | None = None,
                    held: bool = False, wait: bool = True):
    """Start the scheduler actor, or get the running one; returns its handle once ready.
    `held`: a new scheduler plans nothing until `resume()` (several pipelines register before
    the first plan). `wait=False`: returns the handle at once, while the actor starts (a run's
    pipelines start beside it; their calls queue until it is up); the caller then calls
    `check_scheduler(handle, topology)` to confirm it.
    `real_gpus`: the GPUs are real (not fake ones on CPU), see AsyncScheduler. `metrics_port`:
    serve its Prometheus metrics on 127.0.0.1 there (0: a free port; `metrics_endpoint()` says
    which); None: not served. `dashboard_port`: the same for the dashboard page
    (`dashboard_endpoint()`).

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
        real_gpus=real_gpus, metrics_port=metrics_port, dashboard_port=dashboard_port, held=held)
    if wait:
        check_scheduler(handle, topology)
    return handle


def check_scheduler(handle, topology: Topology) -> None:  # type: ignore[no-untyped-def]
    """Wait until the scheduler answers; SchedulerError if it runs another topology (one
    started earlier, which `start_scheduler` got instead of a new one)."""
    info = ray.get(handle.ping.remote())
    if tuple(info["gpus_per_node"]) != topology.gpus_per_node:
        raise SchedulerError(f"a scheduler is already running with topology "
                             f"{info['gpus_per_node']}, not {list(topology.gpus_per_node)}")


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
