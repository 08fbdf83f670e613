"""The async GRPO training loop of one pipeline: the same code in both modes.

Per step: wait until the buffer holds a batch young enough (the collector keeps generating all
along) -> ask for training GPUs (time-sharing: the scheduler shrinks overlapping shards first;
standalone: the fixed GPUs come back at once) -> train on the batch -> snapshot the weights into
the CPU bucket cache as the next version -> offload -> release the GPUs (the scheduler may wake
shards there; the coordinator syncs them to the new version before routing to them) -> refit
the shards that stayed active, in flight. Where the wall time went is recorded per step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rlix.config.models import PipelineConfig
from rlix.devices import confirm_release
from rlix.pipeline.reporting.batch_stats import batch_stats
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.collector import TrajectoryCollector
from rlix.pipeline.rollout.types import NO_DEMAND, Group, RolloutDemand
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.pipeline.evaluation import EvalResult, PeriodicEval
from rlix.pipeline.hooks import RLixHooks
from rlix.training.ranks import TrainerGroup
from rlix.training.grpo import group_advantages
from rlix.training.types import TrainSample
from rlix.weights.refit import WeightPath


@dataclass
class StepRecord:
    step: int  # 1-based: the version the step produced
    reward: float  # mean reward of the batch trained on
    reward_std: float
    samples: int
    tokens: int
    oldest_version: int  # oldest weight version in the batch
    loss: float
    generate_s: float  # waiting for the batch (generation not hidden behind the last step)
    wait_gpus_s: float  # before_training: the scheduler freeing training GPUs (shards sleeping)
    reload_s: float  # the trainer's state back on its GPU (after measuring it free)
    train_s: float
    cache_s: float  # building the CPU bucket cache (and the GPU copy, where the shards use one)
    device_sync_s: float  # the shards asleep on the trainer's GPUs synced from its GPU copy
    audit_s: float  # checksumming the new version (audit_weights only; not in cache_s)
    offload_s: float
    release_s: float  # the release call; it runs alongside the refit: both start at offload's end
    sync_s: float  # refitting active shards (woken ones are synced inside the scheduler's call)
    step_s: float
    finished_at: float
    train_ranks: int = 1  # data-parallel trainer ranks of the step
    # the step's process group (train_ranks > 1): made and destroyed inside the train phase
    group_setup_s: float = 0.0
    group_teardown_s: float = 0.0
    group_destroyed: bool | None = None  # None: one rank, no group
    # of train_s, the trainer's own train_step (the rest: taking the batch and the call's transfer)
    trainer_s: float = 0.0
    # what RL practitioners watch (docs/ARCHITECTURE.md, "Metrics and experiment logging", has the table)
    reward_min: float = 0.0
    reward_max: float = 0.0
    response_len_mean: float = 0.0  # response tokens per sample
    response_len_max: int = 0
    response_truncated_frac: float = 0.0  # share of samples stopped by their token limit
    advantage_mean: float = 0.0
    advantage_std: float = 0.0
    advantage_min: float = 0.0
    advantage_max: float = 0.0
    staleness_mean: float = 0.0  # weight versions between a sample's generation and the trained weights
    staleness_max: int = 0
    entropy: float = 0.0  # of the policy over the trained tokens
    kl: float | None = None  # k3 KL to the reference model; None without one (kl_coef 0)
    clip_fraction: float = 0.0
    importance_ratio: float = 1.0  # mean of pi/pi_behaviour over the trained tokens
    grad_norm: float = 0.0  # before clipping
    tokens_per_s: float = 0.0  # the batch's response tokens per second of the step
    train_tokens_per_s: float = 0.0  # trained tokens per second of the trainer's step
    # the held-out evaluation of the weights this step produced (eval.every; `eval/` keys), else empty
    evaluation: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The step's row; the evaluation's scores sit in it beside the training metrics."""
        row = asdict(self)
        row.update(row.pop("evaluation"))
        return row


def to_samples(groups: list[Group]) -> list[TrainSample]:
    """GRPO samples: each trajectory's advantage is its reward normalised within its group."""
    rewards = [[t.reward for t in g.trajectories] for g in groups]
    advantages = group_advantages(rewards)
    out = []
    for g, adv in zip(groups, advantages):
        for t, a in zip(g.trajectories, adv):
            out.append(TrainSample(list(t.prompt_ids), list(t.response_ids), list(t.behaviour_logprobs),
                                   float(a), int(t.version),
                                   None if t.loss_mask is None else list(t.loss_mask)))
    return out


class GrpoLoop:
    """Drives one pipeline's steps, as its config says. `trainer` trains (a TrainerGroup);
    `weights` publishes each new version (the pipeline's WeightPath); `hooks` the mode's RLixHooks; `on_step(record)` is called after every
    step, `checkpoint(step)` every `checkpoint_every` steps, `record_batch(step, samples)` with
    each batch before it is trained on (record_rollouts), `record_samples(step, groups, samples)`
    with each trained batch just before its `on_step` (the readable samples)."""

    def __init__(self, cfg: PipelineConfig, *, trainer: TrainerGroup, weights: WeightPath,
                 coordinator: ShardCoordinator,
                 collector: TrajectoryCollector, buffer: ReplayBuffer, hooks: RLixHooks,
                 start_step: int = 0, on_step: Callable[[StepRecord], Any] | None = None,
                 checkpoint: Callable[[int], Any] | None = None, release_timeout_s: float = 60.0,
                 record_batch: Callable[[int, list[TrainSample]], None] | None = None,
                 record_samples: Callable[[int, list[Group], list[TrainSample]], Any] | None = None,
                 evaluate: PeriodicEval | None = None) -> None:
        self.name, self.trainer, self.weights, self.coordinator = cfg.name, trainer, weights, coordinator
        self.collector, self.buffer, self.hooks = collector, buffer, hooks
        self.groups_per_step, self.max_age = cfg.rollout.groups_per_step, cfg.max_staleness
        self.steps = cfg.steps
        self.audit = cfg.audit_weights
        self.step = start_step  # = the version the trainer holds
        self.on_step, self.checkpoint, self.checkpoint_every = on_step, checkpoint, cfg.checkpoint_every
        self.records: list[StepRecord] = []
        self.memory_log: list[dict] = []  # the trainer's hand-offs: memory measured at each
        self.release_timeout_s = release_timeout_s
        self.record_batch = record_batch
        self.record_samples = record_samples
        self.evaluate = evaluate  # the held-out evaluation, asked after each step (it says when it is due)
        self.trained_versions: list[tuple[int, list[int]]] = []  # (step, versions in its batch)
        self._reload_bytes: int | None = None  # what the trainer needs free to reload (asked once)

    async def run(self) -> list[StepRecord]:
        """Every step; a failed GPU hand-off of the shards (the coordinator's `failure`, found
        while the scheduler moved them) ends the run with that error, wherever the step was."""
        failed = asyncio.ensure_future(self.coordinator.failed.wait())
        step: asyncio.Future | None = None
        try:
            while self.step < self.steps:
                step = asyncio.ensure_future(self.one_step())
                await asyncio.wait({step, failed}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                if self.coordinator.failure is not None:
                    raise self.coordinator.failure
                step.result()
        finally:
            failed.cancel()
            if step is not None and not step.done():  # the run itself was cancelled (shutdown)
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        return self.records

    def _memory(self, event: str, gpus: list[int], report: Any) -> None:
        row = report.as_dict() if hasattr(report, "as_dict") else dict(report)
        self.memory_log.append({"event": event, "holder": f"trainer of {self.name}", "gpus": list(gpus), **row})

    async def one_step(self) -> StepRecord:
        version = self.step
        t: dict[str, float] = {"start": time.perf_counter()}
        await self.collector.wait_for(self.groups_per_step)
        t["gen"] = time.perf_counter()
        gpus = await self.hooks.before_training(version)
        t["gpus"] = time.perf_counter()
        where = ",".join(map(str, gpus))
        trained: tuple[list, list[TrainSample], dict] | None = None
        published = None
        try:
            try:
                # the GPU's previous holders confirmed their release; the reload also measures it
                self._memory("acquire", gpus, await self.trainer.reload(self.release_timeout_s, where))
                t["reload"] = time.perf_counter()
                groups = self.collector.take(self.groups_per_step)
                samples = to_samples(groups)
                if self.record_batch is not None:
                    self.record_batch(version, samples)
                training = asyncio.ensure_future(self.trainer.train_step(samples))
                try:
                    metrics = await asyncio.shield(training)
                except asyncio.CancelledError:
                    # the trainer takes this step whatever happens here, and a checkpoint on the
                    # way out saves it: the step is recorded too, or a resume would skip its row
                    metrics = await training
                    trained = (groups, samples, metrics)
                    raise
                trained = (groups, samples, metrics)
                t["train"] = time.perf_counter()
                new = version + 1
                beside = self.coordinator.syncs_on_device
                published = await self.weights.publish(new, self.audit, on_device=beside)
                t["cache"] = time.perf_counter()
                if beside:  # the shards asleep on the trainer's GPUs, from its GPU copy
                    await self.coordinator.sync_beside_trainer(new, gpus, self.weights.device_ranks)
                t["beside"] = time.perf_counter()
                released = await self.trainer.offload()
                self._memory("release", gpus, released)
                # residue is tolerated while the GPU keeps room for a holder of this size;
                # a shortfall is measured again (offload frees and measures) before it fails
                if self._reload_bytes is None:  # fixed from the first step on (AdamW's moments exist)
                    self._reload_bytes = await self.trainer.reload_bytes()
                await confirm_release(released, self.trainer.offload, holder=f"the trainer of {self.name}",
                                      gpu=where, need_bytes=self._reload_bytes)
                t["off"] = time.perf_counter()
                self.coordinator.announce(new)  # shards woken from here on get `new`
                # the new demand goes with the release, so the GPUs go back where the demand is
                # (reported after it, a GPU went to the other pipeline and came back one report
                # later: a wasted sleep, wake and sync)
                # no group starts until the active shards are refit below (started now, it
                # would run on the old weights and go stale a step early)
                self.collector.set_version(new, held=True)
                # after the last step nothing is wanted: the GPUs go back at once, not when the
                # pipeline has finished leaving
                demand = NO_DEMAND if new >= self.steps else self.collector.demand_for_release()
                # an evaluation after this step needs a shard: the GPUs go back now even when the
                # next batch is complete (kept for the next step, no shard would answer it)
                release: RolloutDemand | None = None if self._eval_due(new) else demand
            except BaseException:
                self.collector.open_admission()
                await self.hooks.after_training(version)
                raise
            # The release and the refit of the shards that stayed active run together (the release
            # round trip is not on the step's path). The refit takes the coordinator's lock at once,
            # before the release can come back as a wake: a wake then waits for the refit.
            refit = asyncio.ensure_future(self.coordinator.publish(new))
            try:
                await self.hooks.after_training(version, demand=release)
                t["release"] = time.perf_counter()
            finally:
                try:
                    await refit
                finally:
                    self.collector.open_admission()
                t["sync"] = time.perf_counter()
            if self.coordinator.warm:  # synced beside the trainer but not given their GPU back
                await self.coordinator.cool(await self.hooks.shard_ranks())
            # the shards serve `new` and nothing is published until this returns
            evaluated = await self.evaluate(new) if self.evaluate is not None else None
        except BaseException:
            if trained is not None:  # trained but not finished: its row, with the phases it reached
                self.step = version + 1
                await self._record(version + 1, *trained, t, published)
            raise
        self.step = new
        record = await self._record(new, groups, samples, metrics, t, published, evaluated)
        if self.checkpoint is not None and self.checkpoint_every and new % self.checkpoint_every == 0:
            await self.checkpoint(new)
        return record

    def _eval_due(self, step: int) -> bool:
        return self.evaluate is not None and self.evaluate.due(step)

    async def _record(self, new: int, groups: list, samples: list[TrainSample], metrics: dict,
                      t: dict[str, float], published: Any, evaluated: EvalResult | None = None) -> StepRecord:
        """The step's row (phases a step cut short did not reach count 0 s), passed to on_step."""
        rewards = [tr.reward for g in groups for tr in g.trajectories]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        versions = sorted({tr.version for g in groups for tr in g.trajectories})
        self.trained_versions.append((new - 1, versions))
        end = max(t.values())

        def span(start: str, stop: str) -> float:
            return t[stop] - t[start] if start in t and stop in t else 0.0

        audit_s = published.audit_s if published is not None else 0.0
        stats = batch_stats(groups, samples, new - 1)
        step_s = end - t["start"]
        trainer_s = float(metrics.get("seconds", 0.0))
        tokens = sum(s.trained_tokens() for s in samples)
        kl = metrics.get("kl")
        record = StepRecord(
            step=new, reward=mean, reward_std=std, samples=len(samples),
            tokens=tokens, oldest_version=versions[0],
            loss=float(metrics.get("loss", 0.0)), generate_s=span("start", "gen"),
            wait_gpus_s=span("gen", "gpus"), reload_s=span("gpus", "reload"), train_s=span("reload", "train"),
            audit_s=audit_s, cache_s=max(0.0, span("train", "cache") - audit_s),
            device_sync_s=span("cache", "beside"), offload_s=span("beside", "off"),
            release_s=span("off", "release"), sync_s=span("off", "sync"), step_s=step_s,
            finished_at=time.time(), train_ranks=int(metrics.get("ranks", 1)),
            group_setup_s=float(metrics.get("group_setup_s", 0.0)),
            group_teardown_s=float(metrics.get("group_teardown_s", 0.0)),
            group_destroyed=bool(metrics["group_destroyed"]) if "group_destroyed" in metrics else None,
            trainer_s=trainer_s, **asdict(stats),
            entropy=float(metrics.get("entropy", 0.0)), kl=None if kl is None else float(kl),
            clip_fraction=float(metrics.get("clip_fraction", 0.0)),
            importance_ratio=float(metrics.get("ratio", 1.0)), grad_norm=float(metrics.get("grad_norm", 0.0)),
            tokens_per_s=sum(len(s.response_ids) for s in samples) / step_s if step_s > 0 else 0.0,
            train_tokens_per_s=tokens / trainer_s if trainer_s > 0 else 0.0,
            evaluation=evaluated.as_row() if evaluated is not None else {})
        self.records.append(record)
        if self.record_samples is not None:
            result = self.record_samples(new, groups, samples)
            if asyncio.iscoroutine(result):
                await result
        if self.on_step is not None:
            result = self.on_step(record)
            if asyncio.iscoroutine(result):
                await result
        return record
