"""One pipeline, assembled: trainer actor, shard fleet + router, coordinator, buffer, collector
and the GRPO loop, in either mode. `PipelineActor` (actor.py) is the thin Ray shell around it.

Time-sharing (`rlix`): every shard process is started, put to sleep, and the pipeline registers
with the scheduler, which then wakes shards where and when it decides (resize_inference) and
grants training GPUs on request. Standalone: the shards on the pipeline's fixed GPUs are
activated at once; those sharing a GPU with the trainer sleep while it trains and are woken and
synced after (ColocatedHooks), the others stay active and are refitted in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from rlix.config.models import PipelineConfig
from rlix.pipeline.async_grpo import GrpoLoop, StepRecord
from rlix.pipeline.coordinator import ShardCoordinator

log = logging.getLogger("rlix.pipeline")


class PipelineRunner:
    def __init__(self, cfg: PipelineConfig, *, mode: str, run_dir: str | Path, api_key: str,
                 gpus: list[int], scheduler: Any = None, self_handle: Any = None,
                 resume: bool = False) -> None:
        self.cfg, self.mode, self.api_key = cfg, mode, api_key
        self.dir = Path(run_dir) / cfg.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.gpus = gpus
        self.scheduler, self.self_handle, self.resume = scheduler, self_handle, resume
        self.start_step = 0
        self.history: list[dict] = []  # every step's record, across resumes
        self.loop: GrpoLoop | None = None
        self.started_at = time.time()
        self.closing = False
        self.setup_s = 0.0

    # ------------------------------------------------------------------ setup
    async def setup(self) -> dict:
        from transformers import AutoTokenizer

        from rlix.envs import make_task
        from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
        from rlix.inference.fleet.client import RemoteInferenceClient
        from rlix.inference.fleet.fleet import LocalLauncher, ShardFleet
        from rlix.inference.router.data_plane import DataPlaneThread
        from rlix.inference.router.router import Router
        from rlix.models.presets import resolve_model
        from rlix.pipeline.buffer import ReplayBuffer
        from rlix.pipeline.collector import TrajectoryCollector
        from rlix.pipeline.hooks import ColocatedHooks
        from rlix.pipeline.scheduler_hooks import SchedulerHooks
        from rlix.training.actor import TrainerActor

        t0 = time.perf_counter()
        cfg, tr, ro = self.cfg, self.cfg.train, self.cfg.rollout
        path = resolve_model(cfg.model)
        self.trainer = TrainerActor.options(max_concurrency=2).remote(
            str(path), cpu_threads=cfg.cpu_threads, device="cpu", lr=tr.lr, weight_decay=tr.weight_decay,
            micro_batch_size=tr.micro_batch_size, clip_eps=tr.clip_eps, kl_coef=tr.kl_coef,
            aggregation=tr.aggregation, max_grad_norm=tr.max_grad_norm, seed=cfg.seed,
            temperature=ro.temperature, cache_bucket_bytes=tr.bucket_mib << 20)
        ckpt = self.dir / "checkpoint"
        if self.resume and (ckpt / "trainer").exists():
            self.start_step = int(await self.trainer.load_checkpoint.remote(str(ckpt / "trainer")))
            metrics = self.dir / "metrics.jsonl"
            if metrics.exists():
                self.history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                self.history = [h for h in self.history if h["step"] <= self.start_step]
        elif not self.resume:
            (self.dir / "metrics.jsonl").write_text("")
        await self.trainer.build_cache.remote(self.start_step)
        await self.trainer.promote_active.remote(self.start_step)
        await self.trainer.offload.remote()

        # rollouts (router + their HTTP calls) run on their own loop and thread, so control calls
        # (sleep, wake, sync) never queue behind rollout traffic on this actor's loop
        self.data_plane = DataPlaneThread(f"{cfg.name}-data-plane")
        self.data_plane.start()
        self.router = Router(self.api_key, hold_timeout_s=600.0)
        router_url = await self.data_plane.serve_router(self.router)
        self.rollout_client = RemoteInferenceClient(router_url, {}, self.api_key, cfg.name)
        client = RemoteInferenceClient(router_url, {}, self.api_key, cfg.name)  # control calls
        backend = make_backend(EngineBackendConfig(
            backend="embedded", model=str(path), served_model_name=cfg.name,
            max_model_len=ro.max_model_len, max_num_seqs=ro.max_num_seqs, cpu_threads=cfg.cpu_threads))
        self.fleet = ShardFleet(LocalLauncher(backend, self.api_key),
                                self.data_plane.router_control(self.router), client,
                                drain_before_sleep=False)  # our engine aborts in-flight at sleep
        self.coordinator = ShardCoordinator(self.fleet, self._sync, initial_version=0,
                                            wake_in_sync=True)  # our engine serves /sync_weights
        ranks = list(range(cfg.max_shards if self.mode == "rlix" else max(len(self.gpus) // cfg.tp, 1)))
        await self.coordinator.start(ranks, version=0, active=False)  # weights from disk = v0
        self.coordinator.announce(self.start_step)

        self.buffer = ReplayBuffer()
        shard_gpus = {r: self.gpus[r * cfg.tp:(r + 1) * cfg.tp] for r in ranks}
        if self.mode == "rlix":
            self.hooks: Any = SchedulerHooks(self.scheduler, cfg.name, cfg.train_gpus)
        else:  # fixed GPUs: shards on the trainer's GPUs sleep while it trains
            self.hooks = ColocatedHooks(self.coordinator, self.gpus[: cfg.train_gpus], shard_gpus)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.collector = TrajectoryCollector(
            self._generate(), tokenizer, make_task(cfg.task), self.buffer, self.hooks,
            group_size=ro.group_size, groups_per_step=ro.groups_per_step,
            max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
            max_age=cfg.max_staleness, concurrency=ro.concurrency,
            seed=random.Random(cfg.seed).randrange(1 << 30) + self.start_step)
        self.collector.set_version(self.start_step)
        if self.mode == "rlix":
            await self.fleet.sleep_partial(ranks)  # the scheduler decides where shards run
            await self.scheduler.register.remote(cfg.spec(), self.self_handle)
        else:
            await self.coordinator.resize_inference([], shard_gpus)
        self.loop = GrpoLoop(
            name=cfg.name, trainer=self.trainer, coordinator=self.coordinator,
            collector=self.collector, buffer=self.buffer, hooks=self.hooks,
            groups_per_step=ro.groups_per_step, max_age=cfg.max_staleness, steps=cfg.steps,
            start_step=self.start_step, on_step=self._on_step, checkpoint=self._checkpoint,
            checkpoint_every=cfg.checkpoint_every)
        self.setup_s = time.perf_counter() - t0
        return {"pipeline": cfg.name, "shards": ranks, "start_step": self.start_step,
                "setup_s": round(self.setup_s, 2)}

    def _generate(self):  # type: ignore[no-untyped-def]
        async def generate(token_ids: list[int], sampling_params: dict, session_id: str | None = None) -> dict:
            return await self.data_plane.run(
                self.rollout_client.generate(token_ids, sampling_params, session_id=session_id))
        return generate

    async def _sync(self, version: int, urls: dict[int, str], wake: list[int]) -> Any:
        return await self.trainer.sync_shards.remote(version, urls, self.api_key, wake)

    # ------------------------------------------------------------------ running
    async def run(self) -> dict:
        assert self.loop is not None, "setup() first"
        self.collector.start()
        try:
            await self.loop.run()
        finally:
            await self.collector.stop()
        await self._checkpoint(self.loop.step)
        return self.summary()

    async def _on_step(self, record: StepRecord) -> None:
        row = record.as_dict()
        self.history.append(row)
        with (self.dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        log.info("%s step %d reward %.3f (%.2fs)", self.cfg.name, record.step, record.reward, record.step_s)

    async def _checkpoint(self, step: int) -> None:
        await self.trainer.save_checkpoint.remote(str(self.dir / "checkpoint" / "trainer"))

    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> dict:
        if self.closing:
            return {"skipped": "pipeline is shutting down"}
        return await self.coordinator.resize_inference(remove, add)

    def progress(self) -> dict:
        last = self.history[-1] if self.history else None
        return {"pipeline": self.cfg.name, "step": self.loop.step if self.loop else self.start_step,
                "steps": self.cfg.steps, "reward": last["reward"] if last else None,
                "active_shards": self.fleet.active_ranks() if hasattr(self, "fleet") else [],
                "buffered": self.buffer.valid_count(self.loop.step, self.cfg.max_staleness)
                if self.loop else 0}

    def summary(self) -> dict:
        rewards = [h["reward"] for h in self.history]
        records = self.loop.records if self.loop else []
        coord = self.coordinator
        return {
            "pipeline": self.cfg.name, "mode": self.mode, "steps": len(self.history),
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
            "sync_s": coord.stats.sync_seconds, "sleep_s": coord.stats.sleep_seconds,
            "wake_s": coord.stats.wake_seconds, "setup_s": self.setup_s,
            "sleep_phases_ms": {k: round(v, 1) for k, v in coord.stats.sleep_phases_ms.items()},
            "events": [(e.at, e.kind, list(e.ranks), e.version, e.seconds) for e in coord.stats.events],
        }

    async def shutdown(self) -> dict[str, float]:
        """Stop everything this pipeline started; returns seconds per part (slow ones show)."""
        import ray

        took: dict[str, float] = {}

        async def timed(name: str, coro, limit_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(coro, limit_s)
            except Exception as exc:  # noqa: BLE001 - keep shutting the rest down
                log.warning("%s shutdown: %s failed: %r", self.cfg.name, name, exc)
                took[f"{name} failed"] = 1.0
            took[name] = round(time.perf_counter() - t0, 3)

        self.closing = True  # the scheduler's late resize calls are ignored from here on

        if self.mode == "rlix" and self.scheduler is not None:
            if hasattr(self, "hooks"):  # the last release before leaving (an error is logged)
                await timed("release", self.hooks.settle())
            await timed("unregister", self.scheduler.unregister.remote(self.cfg.name))
        if hasattr(self, "collector"):
            await timed("collector", self.collector.stop())
        if hasattr(self, "data_plane"):
            if hasattr(self, "rollout_client") and self.data_plane.alive():
                await timed("rollout client", self.data_plane.run(self.rollout_client.aclose()))
            await timed("router", self.data_plane.stop())
        if hasattr(self, "fleet"):
            await timed("shards", self.fleet.shutdown())
        if hasattr(self, "trainer"):
            await timed("trainer", self.trainer.close.remote())
            ray.kill(self.trainer)
        return took
