"""ExternalRunner: a pipeline whose training loop is another program (`external:` in its config).

rlix does for it what it does for its own loop, except the trainer and the rollouts: it reserves
the pipeline with the scheduler, starts its shards and router, and owns its weight path; then it
starts the program, which connects with rlix.client and drives its steps through the hooks
(start, before_training, after_training, report_progress, clear_progress), each a method of the
pipeline's actor that lands here. Every call is checked against the pipeline's state: a call out
of order raises ClientOrderError and changes nothing.

The program ends the pipeline: exit 0 is done, any other exit fails it (its log's tail is the
reason), as does a step that holds the training GPUs longer than `after_training_timeout_s`, a
program that never calls start() within `start_timeout_s`, or a shard hand-off that failed. Its
GPUs go back as a native pipeline's do (leave).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
import torch
from transformers import AutoConfig

from rlix.client.types import Handoff, PipelineInfo, StepDone, TrainingGrant, VersionSlot
from rlix.config.models import PipelineConfig
from rlix.env import ClientTarget
from rlix.errors import ClientOrderError, PipelineEndedError, PipelineFailedError
from rlix.inference.fleet.backends import make_backend
from rlix.inference.router.router import Router
from rlix.models.presets import resolve_model
from rlix.pipeline.external.program import ProgramProcess
from rlix.pipeline.external.publisher import ClientPublisher
from rlix.pipeline.hooks import RLixHooks
from rlix.pipeline.reporting.metrics_file import write_metrics
from rlix.pipeline.rollout.types import RolloutDemand
from rlix.pipeline.runner import REWARD_WINDOW, SHARD_WATCH_S, PipelineRunner, reward_windows
from rlix.pipeline.shard_engine import served_dtype, shard_engine
from rlix.weights.api import PublishedVersion
from rlix.weights.refit import WeightPath

log = logging.getLogger(__name__)

#: how often run() looks at the program and the timeouts
WATCH_S = 0.2


class ExternalRunner(PipelineRunner):
    """See module doc. `actor_name`: the pipeline actor's Ray name, which the program's
    environment carries (with the cluster's address and namespace) for rlix.client.connect()."""

    def __init__(self, cfg: PipelineConfig, hooks: RLixHooks, *, actor_name: str, **kwargs: Any) -> None:
        super().__init__(cfg, hooks, **kwargs)
        if cfg.external is None:
            raise ValueError(f"{cfg.name}: ExternalRunner needs `external:` in the pipeline's config")
        self.external = cfg.external
        self.actor_name = actor_name
        self.publisher = ClientPublisher()
        self.info: PipelineInfo | None = None
        self.weights: WeightPath | None = None
        self.router: Router | None = None  # the program's generation goes through it (info.base_url)
        self.program: ProgramProcess | None = None
        self.train_gpus: list[int] = []  # its training home: where the program's own CUDA work goes
        self.version = 0  # what the pipeline's newest published weights are (steps done)
        self.training: int | None = None  # the step holding the training GPUs
        self.granted_at = 0.0
        self.started_client = False
        self.checksums: dict[int, dict] = {}  # version -> the client's per-tensor checksums (audit)
        self.taken: int | None = None  # the version the step holding the GPUs published (client_publish)
        self.beside: list[int] = []  # shards synced to it from the program's GPU copy
        self.handoffs: list[dict] = []  # the program's state leaving its GPUs, measured (memory_log)
        self._published_s = 0.0
        self._publishing: asyncio.Future[PublishedVersion] | None = None
        self._calls = asyncio.Lock()  # one hook call at a time: each checks, then changes, the state
        self._ended: str | None = None  # why no more calls are taken

    # ------------------------------------------------------------------ setup
    async def setup(self) -> dict:
        """Reserve, start the shards and the router, make the weight path and the coordinator;
        the program is started by run(). The scheduler places shards once the program's
        start() published the first weights."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        cfg = self.cfg
        path = str(resolve_model(cfg.model))
        engine_cfg = shard_engine(cfg, self.devices, path, self.vllm_python, self.dir / "generations")
        backend = make_backend(engine_cfg)
        self.teardown.add("leave", self.hooks.leave)
        t = time.perf_counter()
        train_gpus = await self.hooks.reserve(cfg, frees_memory=backend.supports_sleep)
        self.train_gpus = list(train_gpus)
        phases["reserve"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        data_plane, router, fleet = await self._start_engines(engine_cfg, backend, train_gpus)
        self.weights = WeightPath(self.publisher, api_key=self.api_key, engine=cfg.engine)
        self.teardown.add("weight path", self.weights.close)
        coordinator, ranks = await self._start_coordinator(
            self._audit if cfg.audit_weights else None, self.weights, fleet, backend)
        base_url = await data_plane.serve_router(router)
        self.router = router
        phases["engines"] = round(time.perf_counter() - t, 2)
        self.trainer_placement = {"gpus": list(train_gpus), "pid": None, "node_id": None, "visible_devices": None,
                                  "memory_share": self.devices.memory_share, "ranks": []}
        self.info = PipelineInfo(name=cfg.name, base_url=base_url, api_key=self.api_key, model_path=path,
                                 served_dtype=self._served_dtype(path),
                                 device=self.devices.device, steps=cfg.steps, audit_weights=cfg.audit_weights,
                                 beside_trainer=coordinator.syncs_on_device,
                                 release_timeout_s=self.devices.release_timeout_s)
        fleet.setup_done = True
        self.setup_s = time.perf_counter() - t0
        self.setup_phases_s = phases
        return {"pipeline": cfg.name, "shards": ranks, "start_step": 0, "resumed_from": None,
                "setup_s": round(self.setup_s, 2), "phases_s": dict(phases)}

    def _served_dtype(self, path: str) -> str:
        """The dtype the shards hold their weights in: vLLM is told one (served_dtype); rlix's
        engine takes the run's `dtype`, else keeps the checkpoint's."""
        if self.cfg.engine == "vllm" or self.devices.dtype:
            return served_dtype(self.devices)
        saved = AutoConfig.from_pretrained(path).dtype
        return str(saved or torch.float32).removeprefix("torch.")

    async def _audit(self, version: int) -> dict:
        if version not in self.checksums:
            raise PipelineEndedError(f"no checksums of version {version} from the client")
        return self.checksums[version]

    # ------------------------------------------------------------------ the program
    async def run(self) -> dict:
        """Start the program and follow it to its end (see module doc)."""
        cfg, ext = self.cfg, self.external
        context = ray.get_runtime_context()
        target = ClientTarget(context.gcs_address, context.namespace, self.actor_name)
        extra = target.as_env()
        if self.devices.device == "cuda" and self.devices.reservation is not None and self.train_gpus:
            extra.update(self.devices.visible_devices_env(self.train_gpus))  # it sees its training GPUs only
        self.program = program = ProgramProcess(ext.command, log_path=self.dir / "program.log",
                                                extra_env=extra, cwd=ext.cwd)
        self.teardown.add("program", lambda: asyncio.to_thread(program.stop))
        program.start()
        started_at = time.monotonic()
        watch = asyncio.ensure_future(self._watch_shards_of_program())
        try:
            while (rc := program.poll()) is None:
                self._check(started_at)
                await asyncio.sleep(WATCH_S)
            if rc != 0:
                last = next((line for line in reversed(program.log_tail().splitlines()) if line.strip()), "")
                raise PipelineFailedError(f"{cfg.name}: its program exited with code {rc}: {last.strip()[:300]} "
                                          f"(its log: {program.log_path})")
        except BaseException as exc:
            self._ended = f"the pipeline failed: {exc}"
            raise
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        self._ended = f"its program exited (code {rc})"
        self.teardown.drop("leave")
        await self._bounded("leaving the scheduler", self.hooks.leave())
        if self.started.coordinator is not None:
            await self._bounded("the shards' last sync", self.started.coordinator.quiesce())
        return self.summary()

    def _check(self, started_at: float) -> None:
        """Raise what ends the pipeline: a failed shard hand-off, or a timeout of the program."""
        coordinator = self.started.coordinator
        if coordinator is not None and coordinator.failure is not None:
            raise coordinator.failure
        now = time.monotonic()
        if not self.started_client and now - started_at > self.external.start_timeout_s:
            raise PipelineFailedError(f"{self.cfg.name}: its program did not call start() within "
                                      f"{self.external.start_timeout_s:g} s (external.start_timeout_s)")
        if self.training is not None and now - self.granted_at > self.external.after_training_timeout_s:
            raise PipelineFailedError(f"{self.cfg.name}: step {self.training} held its training GPUs "
                                      f"{now - self.granted_at:.0f} s without after_training "
                                      f"(external.after_training_timeout_s: {self.external.after_training_timeout_s:g})")

    async def _watch_shards_of_program(self) -> None:
        """Shards whose process died are replaced, as for rlix's own loop."""
        coordinator = self.started.coordinator
        while coordinator is not None and not self.closing:
            await asyncio.sleep(SHARD_WATCH_S)
            try:
                await coordinator.replace_dead()
            except Exception as exc:  # noqa: BLE001 - counted by the coordinator; tried again
                log.warning("%s: replacing a dead shard failed: %r", self.cfg.name, exc)
                if coordinator.failure is not None:
                    return

    # ------------------------------------------------------------------ the client's calls
    def client_info(self) -> PipelineInfo:
        if self.info is None:
            raise ClientOrderError(f"{self.cfg.name}: not set up yet")
        return self.info

    async def client_open_version(self, version: int, purpose: str) -> VersionSlot:
        """The client is about to write `version` into its cache for `purpose` ("start" or
        "after_training"): returns once no shard reads the slot it overwrites."""
        async with self._calls:
            self._live()
            if purpose == "start":
                self._check_start()
            want = self.training + 1 if self.training is not None else None
            if self.started_client and version != want:
                raise ClientOrderError(f"{self.cfg.name}: weights of version {version} now: expected "
                                       + (f"{want} (after_training({self.training}))" if want is not None
                                          else "none (call before_training first)"))
            if self._publishing is not None and not self._publishing.done():
                raise ClientOrderError(f"{self.cfg.name}: a version is being published already")
            assert self.weights is not None
            t0 = time.perf_counter()
            self.publisher.expect(version)
            self._publishing = asyncio.ensure_future(self.weights.publish(version, self.cfg.audit_weights))
            free = asyncio.ensure_future(self.publisher.slot_free(version))
            await asyncio.wait({free, self._publishing}, return_when=asyncio.FIRST_COMPLETED)
            if not free.done():  # the publish failed before the slot was free
                free.cancel()
                self._publishing.result()
            return VersionSlot(version, round(time.perf_counter() - t0, 4))

    async def client_start(self, step: int, published: PublishedVersion, checksums: dict | None) -> StepDone:
        """The program's first weights, as version `step`: the shards serve it from now on, and
        the scheduler may place them."""
        async with self._calls:
            self._live()
            self._check_start()
            await self._take(step, published, checksums)
            coordinator = self.started.coordinator
            assert coordinator is not None
            self.version = self.start_step = step
            coordinator.announce(step)
            await self.hooks.join(coordinator, self.cfg)
            self.started_client = True
            self.ready.set()  # the scheduler's calls are let through from here on
            return StepDone(step=step, version=step, publish_s=published.seconds, refit_s=0.0)

    async def client_before_training(self, step: int) -> TrainingGrant:
        async with self._calls:
            self._live()
            if not self.started_client:
                raise ClientOrderError(f"{self.cfg.name}: before_training({step}) before start()")
            if self.training is not None:
                raise ClientOrderError(f"{self.cfg.name}: before_training({step}) while step {self.training} holds "
                                       f"the training GPUs: call after_training({self.training}, ...) first")
            if step != self.version:
                raise ClientOrderError(f"{self.cfg.name}: before_training({step}): the weights are at step "
                                       f"{self.version}, so the next step is {self.version}")
            t0 = time.perf_counter()
            gpus = await self.hooks.before_training(step)
            self.training, self.granted_at = step, time.monotonic()
            return TrainingGrant(step=step, gpus=list(gpus), waited_s=round(time.perf_counter() - t0, 4))

    async def client_publish(self, step: int, published: PublishedVersion, checksums: dict | None) -> list[int]:
        """`step` trained and its weights are built as version step + 1 (with CUDA IPC
        references of a copy on the program's GPU when it kept one): WeightPath takes them, and
        the shards asleep on the training GPUs are synced from that copy while it exists (the
        program frees it and its state before after_training). Returns those shards. If the
        weights cannot be taken the GPUs go back and the step may be trained again."""
        async with self._calls:
            self._live()
            self._check_holds(step, "client_publish")
            if self.taken is not None:
                raise ClientOrderError(f"{self.cfg.name}: step {step}'s weights were published already "
                                       f"(version {self.taken}): call after_training({step}, ...)")
            new = step + 1
            try:
                await self._take(new, published, checksums)
            except BaseException:
                self.training = None
                await self.hooks.after_training(step)
                raise
            self.taken, self.beside, self._published_s = new, [], published.seconds
            coordinator = self.started.coordinator
            assert coordinator is not None and self.weights is not None
            if published.device_refs and coordinator.syncs_on_device:
                self.beside = await coordinator.sync_beside_trainer(new, self.train_gpus, self.weights.device_ranks)
            return list(self.beside)

    async def client_after_training(self, step: int, metrics: dict[str, float], next_batch: tuple[int, int] | None,
                                    handoff: Handoff | None) -> StepDone:
        """`step`'s weights are published (client_publish) and its state left the training GPUs
        (`handoff`, measured; None when it had none there): they go back to the scheduler, the
        active shards are refit, the step's row is written."""
        async with self._calls:
            self._live()
            self._check_holds(step, "after_training")
            new = step + 1
            if self.taken != new:
                raise ClientOrderError(f"{self.cfg.name}: after_training({step}) before its weights were published "
                                       "(client_publish)")
            coordinator = self.started.coordinator
            assert coordinator is not None
            if handoff is not None:
                self.handoffs.append({"event": "release", "holder": f"program of {self.cfg.name}",
                                      "gpus": list(self.train_gpus), "release_s": handoff.release_s,
                                      "reload_s": handoff.reload_s, **handoff.released.as_dict()})
            coordinator.announce(new)  # shards woken from here on get `new`
            demand = None if next_batch is None else RolloutDemand(
                collected=next_batch[0], target=next_batch[1], outstanding=max(next_batch[1] - next_batch[0], 0))
            t_refit = time.perf_counter()
            refit = asyncio.ensure_future(coordinator.publish(new))
            try:
                await self.hooks.after_training(step, demand=demand)
            finally:
                self.training, self.taken = None, None
                moved = await refit
            if coordinator.warm:  # synced beside the program but not given their GPU back
                await coordinator.cool(await self.hooks.shard_ranks())
            self.version = new
            published_s = self._published_s
            row = {"step": new, "reward": metrics.get("reward"), "step_s": round(time.monotonic() - self.granted_at, 4),
                   "publish_s": round(published_s, 4), "refit_s": round(time.perf_counter() - t_refit, 4),
                   "beside": list(self.beside), "finished_at": time.time(),
                   **({"release_s": handoff.release_s, "reload_s": handoff.reload_s} if handoff is not None else {}),
                   **{k: v for k, v in metrics.items() if k != "reward"}}
            self.history.append(row)
            await asyncio.to_thread(write_metrics, self.dir / "metrics.jsonl", self.history)
            return StepDone(step=step, version=new, publish_s=published_s,
                            refit_s=round(time.perf_counter() - t_refit, 4), refit=list(moved),
                            beside=list(self.beside), handoff=handoff)

    def _check_holds(self, step: int, call: str) -> None:
        if self.training != step:
            raise ClientOrderError(f"{self.cfg.name}: {call}({step}) but "
                                   + (f"step {self.training} holds the GPUs" if self.training is not None
                                      else "no step holds the GPUs (call before_training first)"))

    async def client_report_progress(self, done: int, total: int) -> None:
        self._live()
        if self.started_client:
            await self.hooks.report_progress(RolloutDemand(collected=done, target=total,
                                                           outstanding=max(total - done, 0)),
                                             self.version, pending_work=done < total)

    async def client_clear_progress(self) -> None:
        self._live()
        if self.started_client:
            await self.hooks.clear_progress()

    def _check_start(self) -> None:
        if self.started_client:
            raise ClientOrderError(f"{self.cfg.name}: start() was called already (the pipeline is at step "
                                   f"{self.version})")

    def _live(self) -> None:
        if self._ended is not None or self.closing:
            raise PipelineEndedError(f"{self.cfg.name}: the pipeline has ended ({self._ended or 'shutting down'})")

    async def _take(self, version: int, published: PublishedVersion, checksums: dict | None) -> PublishedVersion:
        """The client built `version`: hand it to the waiting WeightPath.publish."""
        if self._publishing is None or published.version != version:
            raise ClientOrderError(f"{self.cfg.name}: version {published.version} was not opened as {version}")
        if checksums is not None:
            self.checksums = {v: c for v, c in self.checksums.items() if v >= version - 1}
            self.checksums[version] = checksums
        self.publisher.deliver(published)
        return await self._publishing

    # ------------------------------------------------------------------ the scheduler's calls
    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> dict:
        await self.ready.wait()
        coordinator = self.started.coordinator
        if self.closing or coordinator is None:
            return {"skipped": "pipeline is shutting down"}
        return await coordinator.resize_inference(remove, add)

    async def reassert_shards(self, shards: dict[int, list[int]], wake: bool = True) -> dict:
        await self.ready.wait()
        coordinator = self.started.coordinator
        if self.closing or coordinator is None:
            return {"skipped": "pipeline is shutting down"}
        return await coordinator.reassert(shards, wake)

    async def save_on_exit(self) -> int | None:
        return None  # the program keeps its own checkpoints

    # ------------------------------------------------------------------ reports
    def memory_log(self) -> list[dict]:
        rows = super().memory_log() + list(self.handoffs)
        return sorted(rows, key=lambda r: r.get("at", 0.0))

    def processes(self) -> dict:
        out = super().processes()
        out["program"] = self.program.pid() if self.program is not None else None
        return out

    def progress(self, since: int | None = None) -> dict:
        last = self.history[-1] if self.history else None
        fleet, coord = self.started.fleet, self.started.coordinator
        return {"pipeline": self.cfg.name, "step": self.version, "steps": self.cfg.steps,
                "reward": last["reward"] if last else None,
                "active_shards": fleet.active_ranks() if fleet is not None else [], "buffered": 0,
                "shard_deaths": len(coord.stats.deaths) if coord else 0,
                "shard_replacements": list(coord.stats.replacements) if coord else [],
                "processes": self.processes(),
                "shard_startup": [st.as_dict() for st in fleet.startup()] if fleet is not None else [],
                "new_steps": [] if since is None else [
                    {"step": int(h["step"]), "reward": h["reward"], "step_s": h["step_s"],
                     "response_len_mean": None, "samples": []} for h in self.history if h["step"] > since]}

    def summary(self) -> dict:
        if self.started.coordinator is None:
            raise RuntimeError(f"{self.cfg.name}: no summary: set-up did not get as far as the coordinator")
        rewards = [float(h["reward"]) for h in self.history if h.get("reward") is not None]
        first, last = reward_windows(rewards)
        return {
            "pipeline": self.cfg.name, "mode": self.hooks.mode, "steps": len(self.history),
            "start_step": self.start_step, "rewards": rewards,
            "reward_first5": first, "reward_last5": last, "reward_window": min(REWARD_WINDOW, len(rewards) // 2),
            **self._shard_summary(),
            "router_redispatched": self.router.relay.redispatched if self.router is not None else 0,
        }
