"""One pipeline, assembled: trainer actor, shard fleet + router, coordinator, buffer, collector
and the GRPO loop. `PipelineActor` (actor.py) is the thin Ray shell around it.

The run mode is the hooks object it is given (pipeline/hooks.py): it says which shards start
and on which GPUs, who places them (`join`: the scheduler, or the fixed GPUs at once), how
training GPUs are obtained, and what leaving means. Nothing here tests a mode's name.
Rollouts call the router in this process, on the data-plane thread (one HTTP hop: to a shard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import ray
from transformers import AutoTokenizer

from rlix.agents.environment import PipelineEnvironment
from rlix.config.models import LoggingConfig, PipelineConfig
from rlix.envs import make_task
from rlix.errors import ConfigError, TrainerDiedError, actor_death, one_line
from rlix.inference.fleet.api import EngineBackend
from rlix.inference.fleet.backends import make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.actors import RayLauncher
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.data_plane import DataPlaneThread
from rlix.inference.router.router import Generation, Router
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.models.presets import resolve_model
from rlix.pipeline.async_grpo import GrpoLoop, StepRecord
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.collector import TrajectoryCollector
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.pipeline.shard_engine import served_dtype, shard_engine
from rlix.pipeline.weight_audit import vllm_checksums
from rlix.weights.nodes.node_cache import NodeReplicaRoute
from rlix.weights.refit import WeightPath
from rlix.pipeline.device_plan import DevicePlan
from rlix.pipeline.reporting.experiment_log import ExperimentLog, open_experiment_log
from rlix.pipeline.hooks import RLixHooks
from rlix.pipeline.reporting.metrics_file import read_metrics, write_metrics
from rlix.training.group import TrainerGroup
from rlix.training.types import TrainSample

log = logging.getLogger("rlix.pipeline")

#: the longest one rollout request may take, holds for an active shard included
GENERATE_TIMEOUT_S = 600.0
#: how often shard processes are checked for death
SHARD_WATCH_S = 0.5
#: the trainer is pinged every this many shard checks (a death fails the pipeline)
TRAINER_WATCH_ROUNDS = 4
TRAINER_PING_TIMEOUT_S = 10.0
#: the longest one step of finishing a run (watch, collector, leaving) may take
FINISH_STEP_TIMEOUT_S = 60.0
#: the longest a checkpoint on Ctrl-C or failure may take
CHECKPOINT_ON_EXIT_S = 120.0


class PipelineRunner:
    def __init__(self, cfg: PipelineConfig, hooks: RLixHooks, *, run_dir: str | Path, api_key: str,
                 resume: bool = False, devices: DevicePlan | None = None,
                 vllm_python: str | None = None, experiment_log: LoggingConfig | None = None) -> None:
        self.cfg, self.hooks, self.api_key, self.resume = cfg, hooks, api_key, resume
        self.logging_cfg = experiment_log  # the run's `logging:` (TensorBoard, wandb); None: off
        self.experiment_log: ExperimentLog | None = None  # opened at setup, once start_step is known
        self.vllm_python = vllm_python  # engine: vllm; None: rlix.env's default
        self.devices = devices or DevicePlan()
        self.ready = asyncio.Event()  # set once the coordinator can take the scheduler's calls
        self.dir = Path(run_dir) / cfg.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_step = 0
        self.checkpointed_step = 0  # the step of the newest checkpoint (0: none, or the start)
        self.resumed_from: str | None = None  # what --resume found, said once at setup
        self.history: list[dict] = []  # every step's record, across resumes
        self.started_at = time.time()
        self.closing = False
        self.setup_s = 0.0
        self.setup_phases_s: dict[str, float] = {}  # reserve, trainer, engines, collector, join
        # built by setup(), in this order; shutdown() stops whatever exists
        self.trainer: TrainerGroup | None = None
        self.backend: EngineBackend | None = None
        self.data_plane: DataPlaneThread | None = None
        self.router: Router | None = None
        self.fleet: ShardFleet | None = None
        self.weights: WeightPath | None = None  # publishes versions, refits shards
        self.replica_routes: list[NodeReplicaRoute] = []  # several nodes: a cache replica per node
        self.coordinator: ShardCoordinator | None = None
        self.buffer = ReplayBuffer()
        self.collector: TrajectoryCollector | None = None
        self.env: PipelineEnvironment | None = None  # `env:` set: agent episodes
        self.loop: GrpoLoop | None = None
        self.joined = False
        self.trainer_placement: dict = {}
        self._steps: asyncio.Future | None = None  # the loop's run, cancelled by shutdown

    # ------------------------------------------------------------------ setup
    async def setup(self) -> dict:
        """Build the pipeline. The trainer and the engines start side by side (neither needs
        the other until the coordinator joins them): set-up takes the slower of the two, not
        their sum. `phases_s` says what each part took."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}

        async def timed(name: str, coro: Any) -> Any:
            t = time.perf_counter()
            try:
                return await coro
            finally:
                phases[name] = round(time.perf_counter() - t, 2)

        path = resolve_model(self.cfg.model)
        self.engine_cfg = shard_engine(self.cfg, self.devices, str(path), self.vllm_python,
                                       self.dir / "generations")
        self.backend = make_backend(self.engine_cfg)
        self.joined = True  # from here on, shutdown leaves (even if joining fails half-way)
        # the scheduler may place shards from now on
        train_gpus = await timed("reserve", self.hooks.reserve(self.cfg, frees_memory=self.backend.supports_sleep))
        trainer = asyncio.ensure_future(timed("trainer", self._start_trainer(str(path), train_gpus)))
        engines = asyncio.ensure_future(timed("engines", self._start_engines(train_gpus)))
        done = await asyncio.gather(trainer, engines, return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:  # shutdown() ends whatever of the two did start
            raise failed[0]
        self.experiment_log = await asyncio.to_thread(
            open_experiment_log, self.logging_cfg, pipeline=self.cfg.name, pipeline_dir=self.dir,
            start_step=self.start_step, config=self.cfg.model_dump(mode="json"))
        ranks = await self._start_coordinator()
        await timed("collector", self._start_collector(str(path)))
        # all built by now (the steps above fill them in; a failure raised before this point)
        assert self.coordinator is not None and self.fleet is not None
        assert self.trainer is not None and self.collector is not None
        await timed("join", self.hooks.join(self.coordinator, self.cfg))
        self.fleet.setup_done = True
        self.ready.set()
        self.loop = GrpoLoop(self.cfg, trainer=self.trainer, weights=self.weights, coordinator=self.coordinator,
                             collector=self.collector, buffer=self.buffer, hooks=self.hooks,
                             start_step=self.start_step, on_step=self._on_step, checkpoint=self._checkpoint,
                             release_timeout_s=self.devices.release_timeout_s,
                             record_batch=self._record_batch if self.cfg.record_rollouts else None)
        self.setup_s = time.perf_counter() - t0
        self.setup_phases_s = phases
        return {"pipeline": self.cfg.name, "shards": ranks, "start_step": self.start_step,
                "resumed_from": self.resumed_from,
                "setup_s": round(self.setup_s, 2), "phases_s": dict(phases)}

    async def _start_trainer(self, path: str, gpus: list[int]) -> None:
        """The trainer ranks, one per training GPU, each placed on its GPU's node (resumed from
        the checkpoint if asked), the first version published. On CUDA they start offloaded:
        the GPUs are not theirs until granted."""
        cfg, dev = self.cfg, self.devices
        if dev.reservation is not None and gpus:  # data-parallel ranks: one process per GPU
            devices = [(dev.reservation.slot(g).node_id, dev.reservation.slot(g).physical) for g in gpus]
            if dev.device == "cuda" and len(set(devices)) < len(devices):
                raise ConfigError(f"{cfg.name}: its {len(gpus)} trainer ranks would share a GPU (training GPUs "
                                  f"{list(gpus)} are slices of fewer devices); NCCL needs one device per "
                                  f"rank: use train_gpus: 1 with gpu_slices, or whole GPUs")
            ranks = [{"max_concurrency": 2, **dev.reservation.actor_options([g])} for g in gpus]
        else:
            ranks = [{"max_concurrency": 2}]
        extra: dict[str, Any] = {"dtype": dev.dtype} if dev.dtype else {}
        if dev.memory_share < 1:
            extra["memory_share"] = dev.memory_share
        self.trainer = TrainerGroup.start(
            path, cfg.train, ranks, seed=cfg.seed, temperature=cfg.rollout.temperature,
            cpu_threads=cfg.cpu_threads, device=dev.device, offloaded=dev.device == "cuda",
            engine=cfg.engine, served_dtype=served_dtype(self.devices), **extra)
        ckpt = self.checkpoint_dir
        metrics = self.dir / "metrics.jsonl"
        if self.resume and ckpt.exists():
            self.start_step = await self.trainer.load_checkpoint(str(ckpt))
            self.checkpointed_step = self.start_step
            self.resumed_from = f"{ckpt} at step {self.start_step}"
            rows = read_metrics(metrics)
            self.history = [h for h in rows if h["step"] <= self.start_step]
            if len(self.history) != len(rows):  # steps after the checkpoint are trained again
                write_metrics(metrics, self.history)
        else:
            if self.resume:
                self.resumed_from = f"no checkpoint in {ckpt}: starting at step 0"
            write_metrics(metrics, [])
        pids, nodes = await self.trainer.pids(), await self.trainer.node_ids()
        visible = await self.trainer.visible_devices()
        self.trainer_placement = {"gpus": list(gpus), "pid": pids[0], "node_id": nodes[0],
                                  "visible_devices": visible[0], "memory_share": dev.memory_share,
                                  "ranks": [{"rank": r, "gpu": gpus[r] if r < len(gpus) else None, "pid": pids[r],
                                             "node_id": nodes[r], "visible_devices": visible[r]}
                                            for r in range(len(pids))]}
        self.weights = WeightPath(self.trainer, api_key=self.api_key, engine=cfg.engine, trainer_node=nodes[0],
                                  # shards off the trainer's node are refitted from their node's replica
                                  replica_for=self._replica_route if dev.multi_node else None)
        await self.weights.publish(self.start_step, cfg.audit_weights)
        await self.trainer.offload()

    def _replica_route(self, node: str) -> NodeReplicaRoute:
        """The weight route to a node other than the trainer's: a replica there, filled from
        rank 0's cache."""
        assert self.trainer is not None
        route = NodeReplicaRoute(node, self.trainer.ranks[0])
        self.replica_routes.append(route)
        return route

    async def _start_engines(self, train_gpus: list[int]) -> None:
        """The router on its own thread (control calls never queue behind rollout traffic on this
        actor's loop) and the shard fleet. Engines the mode wants resident start now, asleep:
        the ones on the training home during set-up, the others in the background (a rank
        placed there later wakes one instead of starting a process). They serve the weights on
        disk (version 0) until the first sync: nothing here needs the trainer."""
        cfg = self.cfg
        self.data_plane = DataPlaneThread(f"{cfg.name}-data-plane")
        self.data_plane.start()
        self.router = Router(self.api_key, hold_timeout_s=GENERATE_TIMEOUT_S)
        dev = self.devices
        backend = self.backend
        assert backend is not None
        vllm = backend.name == "vllm"
        control = RemoteInferenceClient(None, {}, self.api_key, cfg.name)  # straight to the shards
        placed = dev.reservation is not None
        # shard logs in the run dir: a dead shard's log stays for its post-mortem, and nothing
        # is left in /tmp when the process that would clean it up is killed
        launcher: LocalLauncher | RayLauncher
        if dev.multi_node:  # each shard a Ray actor on its GPUs' node, its server bound to that node
            assert dev.reservation is not None
            launcher = RayLauncher(self.engine_cfg, self.api_key, placement=dev.reservation.host_options,
                                   process_env=dev.visible_devices_env, node_of=dev.reservation.node_of,
                                   log_dir=str(self.dir / "shard-logs"))
        else:
            launcher = LocalLauncher(backend, self.api_key, log_dir=str(self.dir / "shard-logs"),
                                     placement=dev.visible_devices_env if placed else None)
        self.fleet = ShardFleet(launcher, self.data_plane.router_control(self.router), control,
                                sleep_level=dev.sleep_level, release_timeout_s=dev.release_timeout_s,
                                holder=f"pipeline {cfg.name}", supports_sleep=backend.supports_sleep,
                                # our engine aborts what is in flight at sleep; vLLM is drained first
                                drain_before_sleep=vllm,
                                # fake GPUs: a vLLM server is not restarted (a minute) to move
                                restart_on_move=dev.device == "cuda" or not vllm)
        if placed:
            now, later = self.hooks.resident_gpu_sets(cfg, dev, train_gpus)
            await self.fleet.prestart(now, background=later)

    async def _start_coordinator(self) -> list[int]:
        """The coordinator over the fleet and the trainer (both started); unplaced shards
        (fake clusters without a reservation) start here, inactive. Returns the ranks."""
        cfg, dev = self.cfg, self.devices
        assert self.trainer is not None and self.fleet is not None and self.backend is not None
        vllm = self.backend.name == "vllm"
        placed = dev.reservation is not None
        assert self.weights is not None
        beside = dev.device == "cuda" and not vllm and not dev.multi_node
        self.coordinator = ShardCoordinator(self.fleet, self.weights, initial_version=0,
                                            wake_in_sync=True,  # our engine serves /sync_weights
                                            placed=placed,
                                            audit=self.trainer.weight_checksums if cfg.audit_weights else None,
                                            served_checksums=vllm_checksums if vllm else None,
                                            # on GPUs, our engine's shards asleep beside a trainer
                                            # rank take the new version from its GPU (CUDA IPC)
                                            beside_trainer=beside)
        ranks = sorted(self.hooks.shard_gpus(cfg))
        if not placed:  # placed shards start where and when they are first given GPUs
            await self.coordinator.start(ranks, version=0, active=False)
        self.coordinator.announce(self.start_step)
        return ranks

    async def _start_collector(self, path: str) -> None:
        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(path)
        episodes = None
        if cfg.env is not None:  # trajectories are agent episodes: gateway + environment servers
            self.env = PipelineEnvironment(cfg.env, cfg.name, self.api_key, self.dir / "env-logs")
            episodes = await self.env.start(self.data_plane, self.router, tokenizer,
                                            temperature=cfg.rollout.temperature,
                                            max_tokens=cfg.rollout.max_new_tokens,
                                            generate_timeout_s=GENERATE_TIMEOUT_S)
        self.collector = TrajectoryCollector(
            self._generate, tokenizer, make_task(cfg.task), self.buffer,
            self.hooks, cfg.rollout, max_age=cfg.max_staleness,
            seed=random.Random(cfg.seed).randrange(1 << 30) + self.start_step,
            max_failed_groups=cfg.max_failed_groups, episodes=episodes,
            active_shards=lambda: len(self.fleet.active_ranks()) if self.fleet is not None else 0,
            steps=cfg.steps, shard_load=self.router.load if self.router is not None else None,
            pipeline=cfg.name)
        self.collector.set_version(self.start_step)

    async def _generate(self, token_ids: list[int], sampling_params: GenerateSamplingParams,
                        session_id: str | None) -> Generation:
        assert self.data_plane is not None and self.router is not None
        return await self.data_plane.run(
            self.router.generate(token_ids, sampling_params, session_id, timeout_s=GENERATE_TIMEOUT_S))

    # ------------------------------------------------------------------ running
    async def run(self) -> dict:
        assert self.loop is not None and self.collector is not None, "setup() first"
        self.collector.start()
        watch = asyncio.ensure_future(self._watch_shards())
        self._steps = asyncio.ensure_future(self.loop.run())
        try:
            await self._steps
        finally:
            watch.cancel()
            await self._bounded("the shard watch to stop", asyncio.gather(watch, return_exceptions=True))
            await self._bounded("the collector to stop", self.collector.stop())
        # done: its GPUs go back now, not when the whole run ends (others may be waiting)
        self.joined = False
        await self._bounded("leaving the scheduler", self.hooks.leave())
        # a shard woken just before it left may still be syncing (and auditing): counted whole
        await self._bounded("the shards' last sync", self.coordinator.quiesce())
        await self._checkpoint(self.loop.step)
        return self.summary()

    async def _bounded(self, what: str, step: Any) -> None:
        """One step of finishing, given FINISH_STEP_TIMEOUT_S: a step that never ends is logged
        and the run goes on to end (seen once: a finished pipeline that never left)."""
        try:
            await asyncio.wait_for(step, FINISH_STEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.error("%s: waited %.0f s for %s; going on", self.cfg.name, FINISH_STEP_TIMEOUT_S, what)

    async def _watch_shards(self) -> None:
        """Every SHARD_WATCH_S: shards whose process died are replaced (or forgotten, if they
        held no GPU). A replacement that fails is tried again next time; the coordinator fails
        the pipeline when one rank keeps dying."""
        assert self.coordinator is not None
        rounds = 0
        while not self.closing:
            await asyncio.sleep(SHARD_WATCH_S)
            rounds += 1
            if rounds % TRAINER_WATCH_ROUNDS == 0 and await self._trainer_dead():
                return
            if self.env is not None and rounds % TRAINER_WATCH_ROUNDS == 0:
                failure = await self.env.check()
                if failure is not None:  # a server past its restart limit: nothing to roll out with
                    self.coordinator.fail(failure)
                    return
            try:
                await self.coordinator.replace_dead()
            except Exception as exc:  # noqa: BLE001 - counted by the coordinator; tried again
                log.warning("%s: replacing a dead shard failed: %r", self.cfg.name, exc)
                if self.coordinator.failure is not None:
                    return

    async def _trainer_dead(self) -> bool:
        """A dead trainer fails the pipeline: the loop may be waiting for a batch that no shard
        will generate (shards wake through the trainer's sync), and would wait forever. A ping
        that only times out (a busy trainer) is not death."""
        assert self.coordinator is not None
        try:
            await asyncio.wait_for(self.trainer.ping(), TRAINER_PING_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False
        except ray.exceptions.RayActorError as exc:
            if isinstance(exc, ray.exceptions.ActorUnavailableError):
                return False
            pid = self.trainer_placement.get("pid")
            self.coordinator.fail(TrainerDiedError(f"the trainer of {self.cfg.name} (pid {pid}) died: "
                                                   f"{actor_death(exc)}"))
            return True
        return False

    def processes(self) -> dict:
        """This pipeline's processes by PID (the fault tests kill them; operators look here)."""
        fleet = self.fleet
        return {"pipeline": os.getpid(), "trainer": self.trainer_placement.get("pid"),
                "trainer_ranks": [r["pid"] for r in self.trainer_placement.get("ranks", [])],
                "trainer_node": self.trainer_placement.get("node_id"),
                "shard_guards": fleet.pids() if fleet is not None else {},
                "shards": fleet.server_pids() if fleet is not None else {},
                "resident_shard_guards": fleet.resident_pids() if fleet is not None else {},
                "shard_urls": {r: i.url for r, i in self.fleet.shards.items()} if self.fleet else {},
                "shard_nodes": {r: self.fleet.node_of(r) for r in self.fleet.shards} if self.fleet else {},
                "active_shards": self.fleet.active_ranks() if self.fleet else [],
                **(self.env.processes() if self.env is not None else {})}

    def _record_batch(self, step: int, samples: list[TrainSample]) -> None:
        """record_rollouts: the batch of `step` exactly as the trainer gets it, one line per sample."""
        with (self.dir / "batches.jsonl").open("a") as fh:
            for s in samples:
                fh.write(json.dumps({"step": step, "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                                     "behaviour_logprobs": s.behaviour_logprobs, "loss_mask": s.loss_mask,
                                     "advantage": s.advantage, "version": s.version}) + "\n")

    async def _on_step(self, record: StepRecord) -> None:
        row = record.as_dict()
        self.history.append(row)
        with (self.dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.experiment_log:
            self.experiment_log.log(row)
        log.info("%s step %d reward %.3f (%.2fs)", self.cfg.name, record.step, record.reward, record.step_s)

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoint" / "trainer"

    async def _checkpoint(self, step: int) -> None:
        """Saved beside the last one, then swapped in: a save cut short (a kill, a full disk)
        leaves the previous checkpoint whole."""
        final, new, old = self.checkpoint_dir, self.dir / "checkpoint" / "trainer.new", self.dir / "checkpoint" / "trainer.old"
        shutil.rmtree(new, ignore_errors=True)
        saved = await self.trainer.save_checkpoint(str(new))
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        new.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        self.checkpointed_step = saved
        log.info("%s: checkpoint at step %d", self.cfg.name, saved)

    async def save_on_exit(self) -> int | None:
        """A checkpoint of the trainer's state now, if it is newer than the last one and the
        trainer is alive (called on Ctrl-C and on failure); the step saved, else None."""
        if self.trainer is None or self.loop is None or self.loop.step <= self.checkpointed_step:
            return None
        try:
            await asyncio.wait_for(self._checkpoint(self.loop.step), CHECKPOINT_ON_EXIT_S)
        except Exception as exc:  # noqa: BLE001 - the trainer may be what failed
            log.warning("%s: no checkpoint on exit: %s", self.cfg.name, one_line(exc))
            return None
        return self.checkpointed_step

    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> dict:
        """The scheduler's call; one that comes during setup waits until the shards can move."""
        await self.ready.wait()
        if self.closing or self.coordinator is None:
            return {"skipped": "pipeline is shutting down"}
        try:
            return await self.coordinator.resize_inference(remove, add)
        finally:
            if self.collector is not None:
                self.collector.shards_changed()

    async def reassert_shards(self, shards: dict[int, list[int]], wake: bool = True) -> dict:
        """A restarted scheduler's call (see ShardCoordinator.reassert); waits for setup like
        `resize_inference`."""
        await self.ready.wait()
        if self.closing or self.coordinator is None:
            return {"skipped": "pipeline is shutting down"}
        try:
            return await self.coordinator.reassert(shards, wake)
        finally:
            if self.collector is not None:
                self.collector.shards_changed()

    def memory_log(self) -> list[dict]:
        """Every GPU hand-off of this pipeline's holders, with the memory measured at it."""
        rows = list(self.loop.memory_log if self.loop else [])
        rows += self.fleet.memory_log if self.fleet is not None else []
        return sorted(rows, key=lambda r: r.get("at", 0.0))

    def progress(self) -> dict:
        last = self.history[-1] if self.history else None
        return {"pipeline": self.cfg.name, "step": self.loop.step if self.loop else self.start_step,
                "steps": self.cfg.steps, "reward": last["reward"] if last else None,
                "active_shards": self.fleet.active_ranks() if self.fleet is not None else [],
                "buffered": self.buffer.valid_count(self.loop.step, self.cfg.max_staleness)
                if self.loop else 0,
                "shard_deaths": len(self.coordinator.stats.deaths) if self.coordinator else 0,
                "shard_replacements": list(self.coordinator.stats.replacements) if self.coordinator else [],
                "processes": self.processes()}

    def summary(self) -> dict:
        rewards = [h["reward"] for h in self.history]
        records = self.loop.records if self.loop else []
        coord = self.coordinator
        assert coord is not None and self.collector is not None, "setup() first"
        return {
            "pipeline": self.cfg.name, "mode": self.hooks.mode, "steps": len(self.history),
            "start_step": self.start_step, "rewards": rewards,
            "reward_first5": sum(rewards[:5]) / max(len(rewards[:5]), 1),
            "reward_last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
            "records": [r.as_dict() for r in records],
            "trained_versions": self.loop.trained_versions if self.loop else [],
            "accounting": self.buffer.accounting(),
            "collector": self.collector.stats(),
            "shard_history": {r: list(v) for r, v in coord.history.items()},
            "published": sorted(coord.published),
            "version_mismatches": list(coord.stats.version_mismatches),
            "checksum_checks": coord.stats.checksum_checks,
            "checksum_mismatches": list(coord.stats.checksum_mismatches),
            "shard_deaths": list(coord.stats.deaths), "shard_replacements": list(coord.stats.replacements),
            "sync_s": coord.stats.sync_seconds, "sleep_s": coord.stats.sleep_seconds,
            "wake_s": coord.stats.wake_seconds, "setup_s": self.setup_s, "setup_phases_s": dict(self.setup_phases_s),
            "sleep_phases_ms": {k: round(v, 1) for k, v in coord.stats.sleep_phases_ms.items()},
            "device_sync_calls_ms": [round(1000 * s, 3) for s in coord.stats.device_sync_calls_s],
            "device_sync_phases_ms": [{str(r): p for r, p in one.items()} for one in coord.stats.device_sync_phases_ms],
            "events": [(e.at, e.kind, list(e.ranks), e.version, e.seconds) for e in coord.stats.events],
            "device": self.devices.device, "gpu_memory": self.memory_log(),
            "trainer_placement": self.trainer_placement,
            "shard_placements": list(self.fleet.placements) if self.fleet is not None else [],
            "shard_starts_after_setup": self.fleet.starts_after_setup if self.fleet is not None else 0,
            "replications": [r for route in self.replica_routes for r in route.replications],
            **({"env": self.env.stats()} if self.env is not None else {}),
        }

    async def shutdown(self) -> dict[str, float]:
        """Stop everything this pipeline started; returns seconds per part (slow ones show)."""
        took: dict[str, float] = {}

        async def timed(name: str, coro: Any, limit_s: float = 20.0) -> None:
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(coro, limit_s)
            except Exception as exc:  # noqa: BLE001 - keep shutting the rest down
                log.warning("%s shutdown: %s failed: %r", self.cfg.name, name, exc)
                took[f"{name} failed"] = 1.0
            took[name] = round(time.perf_counter() - t0, 3)

        self.closing = True  # the control plane's late resize calls are ignored from here on
        self.ready.set()
        if self._steps is not None and not self._steps.done():  # Ctrl-C, or another part failed
            self._steps.cancel()
            await timed("steps", asyncio.gather(self._steps, return_exceptions=True))
        t0 = time.perf_counter()
        if await self.save_on_exit() is not None:
            took["checkpoint"] = round(time.perf_counter() - t0, 3)
        if self.joined:  # the scheduler (if any) frees its GPUs
            await timed("leave", self.hooks.leave())
        if self.collector is not None:
            await timed("collector", self.collector.stop())
        if self.env is not None:
            await timed("environment", self.env.stop(self.data_plane))
        if self.data_plane is not None:
            if self.router is not None and self.data_plane.alive():
                await timed("router", self.data_plane.run(self.router.close()))
            await timed("data plane", self.data_plane.stop())
        if self.fleet is not None:
            await timed("shards", self.fleet.shutdown())
        if self.weights is not None:
            await timed("weight path", self.weights.close())
        if self.trainer is not None:
            await timed("trainer", self.trainer.close())
        if self.experiment_log:
            await timed("experiment log", asyncio.to_thread(self.experiment_log.close))
        return took
