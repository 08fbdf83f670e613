"""One pipeline, assembled: trainer actor, shard fleet + router, coordinator, buffer, collector
and the GRPO loop. `PipelineActor` (actor.py) is the thin Ray shell around it.

The run mode is the hooks object it is given (pipeline/hooks.py): it says which shards start
and on which GPUs, who places them (`join`: the scheduler, or the fixed GPUs at once), how
training GPUs are obtained, and what leaving means. Nothing here tests a mode's name.
Rollouts call the router in this process, on the data-plane thread (one HTTP hop: to a shard).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import ray
from transformers import AutoTokenizer

from rlix.agents.environment import PipelineEnvironment
from rlix.config.models import LoggingConfig, PipelineConfig
from rlix.envs import make_task
from rlix.errors import ConfigError, TrainerDiedError, actor_death, one_line
from rlix.inference.fleet.api import EngineBackend
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.actors import RayLauncher
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.data_plane import DataPlaneThread
from rlix.inference.router.router import Generation, Router
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.models.presets import resolve_model
from rlix.pipeline import checkpoints
from rlix.pipeline.async_grpo import GrpoLoop, StepRecord
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.collector import TrajectoryCollector
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.pipeline.shard_engine import served_dtype, shard_engine
from rlix.pipeline.weight_audit import vllm_checksums
from rlix.weights.nodes.node_cache import NodeReplicaRoute
from rlix.weights.refit import WeightPath
from rlix.pipeline.device_plan import DevicePlan
from rlix.pipeline.evaluation import PeriodicEval
from rlix.pipeline.reporting.experiment_log import ExperimentLog, open_experiment_log
from rlix.pipeline.hooks import RLixHooks
from rlix.pipeline.parts import STOP_ORDER, PipelineParts, StartedParts, Teardown
from rlix.pipeline.reporting.metrics_file import read_metrics, write_metrics
from rlix.pipeline.reporting.samples import SAMPLES_FILE, SampleRow, append_samples, keep_until, pick
from rlix.pipeline.rollout.types import Group
from rlix.training.ranks import TrainerGroup
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
#: the longest one part's stop may take at shutdown
STOP_PART_TIMEOUT_S = 20.0

#: steps whose samples are kept for the console (a reader further behind gets their lines without)
RECENT_SAMPLE_STEPS = 64
#: the steps averaged at each end of a run for its summary's first/last reward
REWARD_WINDOW = 5

T = TypeVar("T")


def reward_windows(rewards: list[float]) -> tuple[float | None, float | None]:
    """Mean reward of the first and of the last steps: REWARD_WINDOW steps each, fewer in a
    run too short for two windows (half its steps each, so they never overlap); None for both
    with fewer than two steps."""
    k = min(REWARD_WINDOW, len(rewards) // 2)
    if k == 0:
        return None, None
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


class PipelineRunner:
    """One pipeline. `setup()` starts its parts and makes `parts`, complete, once all have
    started; `run()` trains; `shutdown()` stops what was started, whether or not set-up
    finished (see parts.py: what runs the pipeline, what its reports read meanwhile)."""

    def __init__(self, cfg: PipelineConfig, hooks: RLixHooks, *, run_dir: str | Path, api_key: str,
                 resume: bool = False, devices: DevicePlan | None = None,
                 vllm_python: str | None = None, experiment_log: LoggingConfig | None = None) -> None:
        self.cfg, self.hooks, self.api_key, self.resume = cfg, hooks, api_key, resume
        self.logging_cfg = experiment_log  # the run's `logging:` (TensorBoard, wandb); None: off
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
        self.buffer = ReplayBuffer()
        self.parts: PipelineParts | None = None  # made by setup() once every part has started
        self.started = StartedParts()  # what the reports read, set as setup() makes it
        self.teardown = Teardown(STOP_ORDER)  # each part's stop, registered as it starts
        self.replica_routes: list[NodeReplicaRoute] = []  # several nodes: a cache replica per node
        self.trainer_placement: dict = {}
        self._steps: asyncio.Future | None = None  # the loop's run, cancelled by shutdown
        self.recent_samples: dict[int, list[dict]] = {}  # step -> its samples, for the console

    # ------------------------------------------------------------------ setup
    async def setup(self) -> dict:
        """Build the pipeline. The trainer and the engines start side by side (neither needs
        the other until the coordinator joins them): set-up takes the slower of the two, not
        their sum. `phases_s` says what each part took."""
        t0 = time.perf_counter()
        phases: dict[str, float] = {}

        async def timed(name: str, step: Awaitable[T]) -> T:
            t = time.perf_counter()
            try:
                return await step
            finally:
                phases[name] = round(time.perf_counter() - t, 2)

        path = str(resolve_model(self.cfg.model))
        engine_cfg = shard_engine(self.cfg, self.devices, path, self.vllm_python, self.dir / "generations")
        backend = make_backend(engine_cfg)
        # from here on, shutdown leaves (even if joining fails half-way)
        self.teardown.add("leave", self.hooks.leave)
        # the scheduler may place shards from now on
        train_gpus = await timed("reserve", self.hooks.reserve(self.cfg, frees_memory=backend.supports_sleep))
        training = asyncio.ensure_future(timed("trainer", self._start_trainer(path, train_gpus)))
        engines = asyncio.ensure_future(timed("engines", self._start_engines(engine_cfg, backend, train_gpus)))
        done = await asyncio.gather(training, engines, return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if failed:  # shutdown() stops whatever of the two did start
            raise failed[0]
        trainer, weights = training.result()
        data_plane, router, fleet = engines.result()
        experiment_log = await asyncio.to_thread(
            open_experiment_log, self.logging_cfg, pipeline=self.cfg.name, pipeline_dir=self.dir,
            start_step=self.start_step, config=self.cfg.model_dump(mode="json"))
        self.teardown.add("experiment log",  # a tracker that failed is dropped: closed if any are left
                          lambda: asyncio.to_thread(experiment_log.close) if experiment_log else None)
        keep_until(self.dir / SAMPLES_FILE, self.start_step)  # as metrics.jsonl: steps after it come again
        coordinator, ranks = await self._start_coordinator(
            trainer.weight_checksums if self.cfg.audit_weights else None, weights, fleet, backend)
        env, collector = await timed("collector", self._start_collector(path, data_plane, router, fleet))
        await timed("join", self.hooks.join(coordinator, self.cfg))
        loop = GrpoLoop(self.cfg, trainer=trainer, weights=weights, coordinator=coordinator,
                        collector=collector, buffer=self.buffer, hooks=self.hooks,
                        start_step=self.start_step, on_step=functools.partial(self._on_step, experiment_log),
                        checkpoint=functools.partial(self._checkpoint, trainer),
                        release_timeout_s=self.devices.release_timeout_s,
                        record_batch=self._record_batch if self.cfg.record_rollouts else None,
                        record_samples=functools.partial(self._record_samples, collector.tokenizer, experiment_log),
                        evaluate=PeriodicEval.of(self.cfg, collector))
        self.parts = PipelineParts(trainer=trainer, weights=weights, data_plane=data_plane, router=router,
                                   fleet=fleet, coordinator=coordinator, env=env, collector=collector,
                                   experiment_log=experiment_log, loop=loop)
        fleet.setup_done = True
        self.ready.set()  # after `parts`: a scheduler's call let through finds them made
        self.setup_s = time.perf_counter() - t0
        self.setup_phases_s = phases
        return {"pipeline": self.cfg.name, "shards": ranks, "start_step": self.start_step,
                "resumed_from": self.resumed_from,
                "setup_s": round(self.setup_s, 2), "phases_s": dict(phases)}

    async def _start_trainer(self, path: str, gpus: list[int]) -> tuple[TrainerGroup, WeightPath]:
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
        trainer = TrainerGroup.start(
            path, cfg.train, ranks, seed=cfg.seed, temperature=cfg.rollout.temperature,
            cpu_threads=cfg.cpu_threads, device=dev.device, offloaded=dev.device == "cuda",
            engine=cfg.engine, served_dtype=served_dtype(self.devices), **extra)
        self.teardown.add("trainer", trainer.close)
        ckpt = checkpoints.newest(self.checkpoint_dir) if self.resume else None
        metrics = self.dir / "metrics.jsonl"
        if ckpt is not None:
            self.start_step = await trainer.load_checkpoint(str(ckpt.path))
            self.checkpointed_step = self.start_step
            self.resumed_from = f"{ckpt.path} at step {self.start_step}"
            rows = read_metrics(metrics)
            self.history = [h for h in rows if h["step"] <= self.start_step]
            if len(self.history) != len(rows):  # steps after the checkpoint are trained again
                write_metrics(metrics, self.history)
        else:
            if self.resume:
                self.resumed_from = f"no checkpoint in {self.checkpoint_dir}: starting at step 0"
            else:  # a fresh start (--overwrite): a previous run's checkpoints would be resumed from later
                shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
            write_metrics(metrics, [])
        pids, nodes = await trainer.pids(), await trainer.node_ids()
        visible = await trainer.visible_devices()
        self.trainer_placement = {"gpus": list(gpus), "pid": pids[0], "node_id": nodes[0],
                                  "visible_devices": visible[0], "memory_share": dev.memory_share,
                                  "ranks": [{"rank": r, "gpu": gpus[r] if r < len(gpus) else None, "pid": pids[r],
                                             "node_id": nodes[r], "visible_devices": visible[r]}
                                            for r in range(len(pids))]}
        weights = WeightPath(trainer, api_key=self.api_key, engine=cfg.engine, trainer_node=nodes[0],
                             # shards off the trainer's node are refitted from their node's replica
                             replica_for=functools.partial(self._replica_route, trainer) if dev.multi_node else None)
        self.teardown.add("weight path", weights.close)
        await weights.publish(self.start_step, cfg.audit_weights)
        await trainer.offload()
        return trainer, weights

    def _replica_route(self, trainer: TrainerGroup, node: str) -> NodeReplicaRoute:
        """The weight route to a node other than the trainer's: a replica there, filled from
        rank 0's cache."""
        route = NodeReplicaRoute(node, trainer.ranks[0])
        self.replica_routes.append(route)
        return route

    async def _start_engines(self, engine_cfg: EngineBackendConfig, backend: EngineBackend,
                             train_gpus: list[int]) -> tuple[DataPlaneThread, Router, ShardFleet]:
        """The router on its own thread (control calls never queue behind rollout traffic on this
        actor's loop) and the shard fleet. Engines the mode wants resident start now, asleep:
        the ones on the training home during set-up, the others in the background (a rank
        placed there later wakes one instead of starting a process). They serve the weights on
        disk (version 0) until the first sync: nothing here needs the trainer."""
        cfg = self.cfg
        data_plane = DataPlaneThread(f"{cfg.name}-data-plane")
        self.teardown.add("data plane", data_plane.stop)
        data_plane.start()
        router = Router(self.api_key, hold_timeout_s=GENERATE_TIMEOUT_S)
        # closed on its own thread, if that still runs
        self.teardown.add("router", lambda: data_plane.run(router.close()) if data_plane.alive() else None)
        dev = self.devices
        vllm = backend.name == "vllm"
        control = RemoteInferenceClient(None, {}, self.api_key, cfg.name)  # straight to the shards
        placed = dev.reservation is not None
        # shard logs in the run dir: a dead shard's log stays for its post-mortem, and nothing
        # is left in /tmp when the process that would clean it up is killed
        launcher: LocalLauncher | RayLauncher
        if dev.multi_node:  # each shard a Ray actor on its GPUs' node, its server bound to that node
            assert dev.reservation is not None
            launcher = RayLauncher(engine_cfg, self.api_key, placement=dev.reservation.host_options,
                                   process_env=dev.visible_devices_env, node_of=dev.reservation.node_of,
                                   log_dir=str(self.dir / "shard-logs"))
        else:
            launcher = LocalLauncher(backend, self.api_key, log_dir=str(self.dir / "shard-logs"),
                                     placement=dev.visible_devices_env if placed else None)
        fleet = ShardFleet(launcher, data_plane.router_control(router), control,
                           sleep_level=dev.sleep_level, release_timeout_s=dev.release_timeout_s,
                           holder=f"pipeline {cfg.name}", supports_sleep=backend.supports_sleep,
                           # our engine aborts what is in flight at sleep; vLLM is drained first
                           drain_before_sleep=vllm,
                           # fake GPUs: a vLLM server is not restarted (a minute) to move
                           restart_on_move=dev.device == "cuda" or not vllm)
        self.started.fleet = fleet
        self.teardown.add("shards", fleet.shutdown)
        if placed:
            now, later = self.hooks.resident_gpu_sets(cfg, dev, train_gpus)
            await fleet.prestart(now, background=later)
        return data_plane, router, fleet

    async def _start_coordinator(self, audit: Callable[[int], Awaitable[Mapping[str, Any]]] | None,
                                 weights: WeightPath, fleet: ShardFleet,
                                 backend: EngineBackend) -> tuple[ShardCoordinator, list[int]]:
        """The coordinator over the fleet and the weight path (both started); `audit(version)`:
        the published version's per-tensor checksums (None: no audit). Unplaced shards (fake
        clusters without a reservation) start here, inactive. Returns it and the ranks."""
        cfg, dev = self.cfg, self.devices
        vllm = backend.name == "vllm"
        placed = dev.reservation is not None
        beside = dev.device == "cuda" and not vllm and not dev.multi_node
        coordinator = ShardCoordinator(fleet, weights, initial_version=0,
                                       wake_in_sync=True,  # our engine serves /sync_weights
                                       placed=placed,
                                       audit=audit,
                                       served_checksums=vllm_checksums if vllm else None,
                                       # on GPUs, our engine's shards asleep beside a trainer
                                       # rank take the new version from its GPU (CUDA IPC)
                                       beside_trainer=beside)
        self.started.coordinator = coordinator
        ranks = sorted(self.hooks.shard_gpus(cfg))
        if not placed:  # placed shards start where and when they are first given GPUs
            await coordinator.start(ranks, version=0, active=False)
        coordinator.announce(self.start_step)
        return coordinator, ranks

    async def _start_collector(self, path: str, data_plane: DataPlaneThread, router: Router,
                               fleet: ShardFleet) -> tuple[PipelineEnvironment | None, TrajectoryCollector]:
        """The collector, and with `env:` set the environment its episodes run in (its gateway
        and servers); returns both."""
        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(path)
        env, episodes = None, None
        if cfg.env is not None:  # trajectories are agent episodes: gateway + environment servers
            env = PipelineEnvironment(cfg.env, cfg.name, self.api_key, self.dir / "env-logs")
            self.started.env = env
            self.teardown.add("environment", functools.partial(env.stop, data_plane))
            episodes = await env.start(data_plane, router, tokenizer,
                                       temperature=cfg.rollout.temperature,
                                       max_tokens=cfg.rollout.max_new_tokens,
                                       generate_timeout_s=GENERATE_TIMEOUT_S)
        collector = TrajectoryCollector(
            functools.partial(self._generate, data_plane, router), tokenizer, make_task(cfg.task), self.buffer,
            self.hooks, cfg.rollout, max_age=cfg.max_staleness,
            seed=random.Random(cfg.seed).randrange(1 << 30) + self.start_step,
            max_failed_groups=cfg.max_failed_groups, episodes=episodes,
            active_shards=lambda: len(fleet.active_ranks()),
            steps=cfg.steps, shard_load=router.load, pipeline=cfg.name)
        self.started.collector = collector
        self.teardown.add("collector", collector.stop)
        collector.set_version(self.start_step)
        return env, collector

    async def _generate(self, data_plane: DataPlaneThread, router: Router, token_ids: list[int],
                        sampling_params: GenerateSamplingParams, session_id: str | None) -> Generation:
        return await data_plane.run(
            router.generate(token_ids, sampling_params, session_id, timeout_s=GENERATE_TIMEOUT_S))

    # ------------------------------------------------------------------ running
    async def run(self) -> dict:
        parts = self.parts
        if parts is None:
            raise RuntimeError(f"{self.cfg.name}: run() before setup() finished")
        parts.collector.start()
        watch = asyncio.ensure_future(self._watch_shards(parts))
        self._steps = asyncio.ensure_future(parts.loop.run())
        try:
            await self._steps
        finally:
            watch.cancel()
            await self._bounded("the shard watch to stop", asyncio.gather(watch, return_exceptions=True))
            await self._bounded("the collector to stop", parts.collector.stop())
        # done: its GPUs go back now, not when the whole run ends (others may be waiting)
        self.teardown.drop("leave")
        await self._bounded("leaving the scheduler", self.hooks.leave())
        # a shard woken just before it left may still be syncing (and auditing): counted whole
        await self._bounded("the shards' last sync", parts.coordinator.quiesce())
        await self._checkpoint(parts.trainer, parts.loop.step)
        return self.summary()

    async def _bounded(self, what: str, step: Any) -> None:
        """One step of finishing, given FINISH_STEP_TIMEOUT_S: a step that never ends is logged
        and the run goes on to end (seen once: a finished pipeline that never left)."""
        try:
            await asyncio.wait_for(step, FINISH_STEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.error("%s: waited %.0f s for %s; going on", self.cfg.name, FINISH_STEP_TIMEOUT_S, what)

    async def _watch_shards(self, parts: PipelineParts) -> None:
        """Every SHARD_WATCH_S: shards whose process died are replaced (or forgotten, if they
        held no GPU). A replacement that fails is tried again next time; the coordinator fails
        the pipeline when one rank keeps dying."""
        coordinator = parts.coordinator
        rounds = 0
        while not self.closing:
            await asyncio.sleep(SHARD_WATCH_S)
            rounds += 1
            if rounds % TRAINER_WATCH_ROUNDS == 0 and await self._trainer_dead(parts):
                return
            if parts.env is not None and rounds % TRAINER_WATCH_ROUNDS == 0:
                failure = await parts.env.check()
                if failure is not None:  # a server past its restart limit: nothing to roll out with
                    coordinator.fail(failure)
                    return
            try:
                await coordinator.replace_dead()
            except Exception as exc:  # noqa: BLE001 - counted by the coordinator; tried again
                log.warning("%s: replacing a dead shard failed: %r", self.cfg.name, exc)
                if coordinator.failure is not None:
                    return

    async def _trainer_dead(self, parts: PipelineParts) -> bool:
        """A dead trainer fails the pipeline: the loop may be waiting for a batch that no shard
        will generate (shards wake through the trainer's sync), and would wait forever. A ping
        that only times out (a busy trainer) is not death."""
        try:
            await asyncio.wait_for(parts.trainer.ping(), TRAINER_PING_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False
        except ray.exceptions.RayActorError as exc:
            if isinstance(exc, ray.exceptions.ActorUnavailableError):
                return False
            pid = self.trainer_placement.get("pid")
            parts.coordinator.fail(TrainerDiedError(f"the trainer of {self.cfg.name} (pid {pid}) died: "
                                                    f"{actor_death(exc)}"))
            return True
        return False

    def processes(self) -> dict:
        """This pipeline's processes by PID (the fault tests kill them; operators look here)."""
        fleet, env = self.started.fleet, self.started.env
        return {"pipeline": os.getpid(), "trainer": self.trainer_placement.get("pid"),
                "trainer_ranks": [r["pid"] for r in self.trainer_placement.get("ranks", [])],
                "trainer_node": self.trainer_placement.get("node_id"),
                "shard_guards": fleet.pids() if fleet is not None else {},
                "shards": fleet.server_pids() if fleet is not None else {},
                "resident_shard_guards": fleet.resident_pids() if fleet is not None else {},
                "shard_urls": {r: i.url for r, i in fleet.shards.items()} if fleet is not None else {},
                "shard_nodes": {r: fleet.node_of(r) for r in fleet.shards} if fleet is not None else {},
                "active_shards": fleet.active_ranks() if fleet is not None else [],
                **(env.processes() if env is not None else {})}

    def _record_batch(self, step: int, samples: list[TrainSample]) -> None:
        """record_rollouts: the batch of `step` exactly as the trainer gets it, one line per sample."""
        with (self.dir / "batches.jsonl").open("a") as fh:
            for s in samples:
                fh.write(json.dumps({"step": step, "prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                                     "behaviour_logprobs": s.behaviour_logprobs, "loss_mask": s.loss_mask,
                                     "advantage": s.advantage, "version": s.version}) + "\n")

    def _record_samples(self, tokenizer: Any, experiment_log: ExperimentLog, step: int, groups: list[Group],
                        samples: list[TrainSample]) -> None:
        """`logging.samples_per_step` of the batch, readable: to samples.jsonl, the trackers, and
        kept for the console (the supervisor reads them with the step's progress)."""
        k = self.logging_cfg.samples_per_step if self.logging_cfg is not None else 0
        rows: list[SampleRow] = pick(step, groups, samples, k,
                                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        if not rows:
            return
        append_samples(self.dir / SAMPLES_FILE, rows)
        if experiment_log:
            experiment_log.log_samples(step, rows)
        self.recent_samples[step] = [r.as_dict() for r in rows]
        for old in [s for s in self.recent_samples if s <= step - RECENT_SAMPLE_STEPS]:
            del self.recent_samples[old]

    async def _on_step(self, experiment_log: ExperimentLog, record: StepRecord) -> None:
        row = record.as_dict()
        self.history.append(row)
        with (self.dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if experiment_log:
            experiment_log.log(row)
        log.info("%s step %d reward %.3f (%.2fs)", self.cfg.name, record.step, record.reward, record.step_s)

    @property
    def checkpoint_dir(self) -> Path:
        """Where the step-numbered checkpoints go (pipeline/checkpoints.py)."""
        return self.dir / "checkpoint"

    async def _checkpoint(self, trainer: TrainerGroup, step: int) -> None:
        """Saved under a temporary name, then renamed to its step's: a save cut short (a kill, a
        full disk) leaves every earlier checkpoint whole and is never resumed from. Then the
        folder is pruned to checkpoint_keep_last (+ checkpoint_keep_best)."""
        cfg, root = self.cfg, self.checkpoint_dir
        root.mkdir(parents=True, exist_ok=True)
        partial = checkpoints.partial_path(root, step)
        shutil.rmtree(partial, ignore_errors=True)
        saved = await trainer.save_checkpoint(str(partial))
        if saved != step:  # the trainer holds another step than the loop's: name it by what it holds
            log.warning("%s: checkpoint asked for step %d holds step %d", cfg.name, step, saved)
        final = checkpoints.publish(root, partial, saved)
        scores = checkpoints.step_scores(read_metrics(self.dir / "metrics.jsonl"), cfg.checkpoint_best_metric) \
            if cfg.checkpoint_keep_best else {}
        removed = checkpoints.prune(root, cfg.checkpoint_keep_last, cfg.checkpoint_keep_best, scores,
                                    cfg.checkpoint_best_mode)
        self.checkpointed_step = saved
        log.info("%s: checkpoint at step %d in %s%s", cfg.name, saved, final,
                 f" (removed steps {removed})" if removed else "")

    async def save_on_exit(self) -> int | None:
        """A checkpoint of the trainer's state now, if it is newer than the last one and the
        trainer is alive (called on Ctrl-C and on failure); the step saved, else None."""
        parts = self.parts
        if parts is None or parts.loop.step <= self.checkpointed_step:
            return None
        try:
            await asyncio.wait_for(self._checkpoint(parts.trainer, parts.loop.step), CHECKPOINT_ON_EXIT_S)
        except Exception as exc:  # noqa: BLE001 - the trainer may be what failed
            log.warning("%s: no checkpoint on exit: %s", self.cfg.name, one_line(exc))
            return None
        return self.checkpointed_step

    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> dict:
        """The scheduler's call; one that comes during setup waits until the shards can move."""
        await self.ready.wait()
        parts = self.parts
        if self.closing or parts is None:  # once ready: set up, or shutting down
            return {"skipped": "pipeline is shutting down"}
        try:
            return await parts.coordinator.resize_inference(remove, add)
        finally:
            parts.collector.shards_changed()

    async def reassert_shards(self, shards: dict[int, list[int]], wake: bool = True) -> dict:
        """A restarted scheduler's call (see ShardCoordinator.reassert); waits for setup like
        `resize_inference`."""
        await self.ready.wait()
        parts = self.parts
        if self.closing or parts is None:
            return {"skipped": "pipeline is shutting down"}
        try:
            return await parts.coordinator.reassert(shards, wake)
        finally:
            parts.collector.shards_changed()

    def memory_log(self) -> list[dict]:
        """Every GPU hand-off of this pipeline's holders, with the memory measured at it."""
        fleet = self.started.fleet
        rows = list(self.parts.loop.memory_log if self.parts is not None else [])
        rows += fleet.memory_log if fleet is not None else []
        return sorted(rows, key=lambda r: r.get("at", 0.0))

    def progress(self, since: int | None = None) -> dict:
        """The pipeline now; with `since`, `new_steps` also holds every step finished after
        that step, in order (its number, reward, seconds, response length, and the console's
        samples when this step's are due), so a reader polling now and then misses none."""
        last = self.history[-1] if self.history else None
        loop = self.parts.loop if self.parts is not None else None
        fleet, coord = self.started.fleet, self.started.coordinator
        return {"pipeline": self.cfg.name, "step": loop.step if loop else self.start_step,
                "steps": self.cfg.steps, "reward": last["reward"] if last else None,
                "active_shards": fleet.active_ranks() if fleet is not None else [],
                "buffered": self.buffer.valid_count(loop.step, self.cfg.max_staleness) if loop else 0,
                "shard_deaths": len(coord.stats.deaths) if coord else 0,
                "shard_replacements": list(coord.stats.replacements) if coord else [],
                "processes": self.processes(),
                # shard servers starting (and started): the console's start-up lines
                "shard_startup": [st.as_dict() for st in fleet.startup()] if fleet is not None else [],
                "new_steps": [] if since is None else [self._step_line(h) for h in self.history if h["step"] > since]}

    def _step_line(self, row: dict) -> dict:
        every = self.logging_cfg.console_samples_every if self.logging_cfg is not None else 0
        step = int(row["step"])
        return {"step": step, "reward": row["reward"], "step_s": row.get("step_s", 0.0),
                "response_len_mean": row.get("response_len_mean"),
                "samples": self.recent_samples.get(step, []) if every and step % every == 0 else []}

    def summary(self) -> dict:
        """The pipeline's result; also of a set-up that failed once the coordinator and the
        collector were made (a failed join), else an error (the caller reads the metrics file)."""
        coord, collector, env = self.started.coordinator, self.started.collector, self.started.env
        if coord is None or collector is None:
            raise RuntimeError(f"{self.cfg.name}: no summary: set-up did not get as far as the collector")
        rewards = [h["reward"] for h in self.history]
        first, last = reward_windows(rewards)
        loop = self.parts.loop if self.parts is not None else None
        return {
            "pipeline": self.cfg.name, "mode": self.hooks.mode, "steps": len(self.history),
            "start_step": self.start_step, "rewards": rewards,
            "reward_first5": first, "reward_last5": last, "reward_window": min(REWARD_WINDOW, len(rewards) // 2),
            "records": [r.as_dict() for r in loop.records] if loop else [],
            "trained_versions": loop.trained_versions if loop else [],
            "accounting": self.buffer.accounting(),
            "collector": collector.stats(),
            **self._shard_summary(),
            "trainer_placement": self.trainer_placement,
            "router_redispatched": self.parts.router.relay.redispatched if self.parts is not None else 0,
            "replications": [r for route in self.replica_routes for r in route.replications],
            **({"env": env.stats()} if env is not None else {}),
        }

    def _shard_summary(self) -> dict:
        """The summary's part about the pipeline's shards, their weights and its GPU hand-offs
        (rlix's loop and an external one alike; the coordinator exists)."""
        coord, fleet = self.started.coordinator, self.started.fleet
        assert coord is not None
        return {
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
            "shard_placements": list(fleet.placements) if fleet is not None else [],
            "shard_starts_after_setup": fleet.starts_after_setup if fleet is not None else 0,
        }

    async def shutdown(self) -> dict[str, float]:
        """Stop everything this pipeline started, set up or not (the teardown, in its order);
        returns seconds per part (slow ones show). A part that fails or takes longer than
        STOP_PART_TIMEOUT_S is logged and the others are stopped all the same."""
        took: dict[str, float] = {}

        async def timed(name: str, step: Awaitable[Any]) -> None:
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(step, STOP_PART_TIMEOUT_S)
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
        for name, step in self.teardown.steps():
            await timed(name, step)
        return took
