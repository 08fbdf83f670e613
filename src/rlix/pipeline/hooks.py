"""The hooks through which a pipeline talks to its control plane: the run mode as a strategy.

The hooks object decides everything that differs between modes, so nothing else tests a mode
name: which shards the pipeline starts (and on which GPUs), who places them once started
(`join`), how training GPUs are obtained and given back, where demand goes, and what leaving
means. Time-sharing: rlix.pipeline.scheduler_hooks.SchedulerHooks (the rlix scheduler places
shards and grants GPUs). Standalone on fixed GPUs: ColocatedHooks (the shards on the trainer's
GPUs sleep while it trains); NoOpHooks grants fixed GPUs and touches no shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the coordinator imports the inference fleet
    from rlix.config.models import PipelineConfig
    from rlix.pipeline.coordinator import ShardCoordinator
    from rlix.pipeline.device_plan import DevicePlan
    from rlix.pipeline.rollout.types import RolloutDemand


@runtime_checkable
class RLixHooks(Protocol):
    mode: str  # the run mode's name, for reports

    def shard_gpus(self, cfg: PipelineConfig) -> dict[int, list[int]]:
        """The dp ranks this pipeline starts, each with its GPUs if fixed (else [])."""
        ...

    def resident_gpu_sets(self, cfg: PipelineConfig, devices: DevicePlan,
                          home: list[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Where the pipeline's engines start before any rank is placed, (during set-up, in the
        background): resident engines that a shard placed there wakes (([], []): shards start
        where they are placed)."""
        ...

    async def reserve(self, cfg: PipelineConfig, frees_memory: bool = True) -> list[int]:
        """Make the pipeline known to whoever grants its GPUs; returns the GPUs its trainer is
        placed on (its training home). Shards may be placed from here on (once ready).
        `frees_memory`: whether its preempted shards give their GPU memory back (sleep) or
        only pause (vLLM where sleep mode is refused)."""
        ...

    async def join(self, coordinator: ShardCoordinator, cfg: PipelineConfig) -> None:
        """The shards are started, asleep-capable and inactive: hand them to whoever places them."""
        ...

    async def leave(self) -> None:
        """The pipeline ends: give everything back (after `settle`)."""
        ...

    async def before_training(self, step: int) -> list[int]:
        """Block until the training GPUs are this pipeline's; returns them."""
        ...

    async def after_training(self, step: int, demand: RolloutDemand | None = None) -> None:
        """The training GPUs are free again (weights cached, trainer offloaded). `demand`
        goes with the release, so the control plane hands the GPUs out knowing it."""
        ...

    async def report_progress(self, demand: RolloutDemand, step: int,
                              shard_load: dict[int, int] | None = None,
                              turns_outstanding: int | None = None,
                              pending_work: bool = False,
                              seconds_per_trajectory: float | None = None) -> None:
        """Rollout demand (`RolloutDemand`: the next step's collected vs target, and what its
        window can still use); `pending_work`: groups in flight or the trainer waiting for its
        batch (evidence beside the figure); `seconds_per_trajectory`: what one costs its
        shards, measured (rollout/rate.py)."""
        ...

    async def clear_progress(self) -> None: ...

    async def settle(self) -> None:
        """Return once every call sent so far has been answered (a release may be in flight)."""
        ...

    async def shard_ranks(self) -> set[int] | None:
        """After `settle`: the shards the control plane places now (None: not known)."""
        ...


class NoOpHooks:
    """Standalone: the fixed training GPUs are always granted; progress goes nowhere; every
    shard is activated at once and stays active."""

    mode = "standalone"

    def __init__(self, gpus: list[int] | None = None) -> None:
        self.gpus = list(gpus or [])

    def resident_gpu_sets(self, cfg: PipelineConfig, devices: DevicePlan,
                          home: list[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Its engines start on its fixed GPUs during set-up, beside the trainer's start (one
        per GPU, as a placed shard's would); `join` binds its ranks to them."""
        now, _ = devices.resident_gpu_sets(cfg.tp, list(self.gpus))
        return now, []

    def shard_gpus(self, cfg: PipelineConfig) -> dict[int, list[int]]:
        """One shard per `tp` fixed GPUs (at least one)."""
        n = max(len(self.gpus) // cfg.tp, 1)
        return {r: self.gpus[r * cfg.tp:(r + 1) * cfg.tp] for r in range(n)}

    async def reserve(self, cfg: PipelineConfig, frees_memory: bool = True) -> list[int]:
        return list(self.gpus[:cfg.train_gpus])

    async def join(self, coordinator: ShardCoordinator, cfg: PipelineConfig) -> None:
        await coordinator.resize_inference([], self.shard_gpus(cfg))

    async def leave(self) -> None:
        return None

    async def before_training(self, step: int) -> list[int]:
        return list(self.gpus)

    async def after_training(self, step: int, demand: RolloutDemand | None = None) -> None:
        return None

    async def report_progress(self, demand: RolloutDemand, step: int,
                              shard_load: dict[int, int] | None = None,
                              turns_outstanding: int | None = None,
                              pending_work: bool = False,
                              seconds_per_trajectory: float | None = None) -> None:
        return None

    async def clear_progress(self) -> None:
        return None

    async def settle(self) -> None:
        return None

    async def shard_ranks(self) -> set[int] | None:
        return None  # fixed shards: every one comes back after training (after_training)


class ProgressThrottle:
    """Decides which progress reports are worth sending (pure, no clock).

    Reports when the completed share crosses a `granularity` boundary (2% by default), when it
    reaches 100% or falls back to exactly 0, and whenever the target changes: the scheduler
    hears every real change without a message per trajectory. The first call always reports;
    `reset()` makes the next one report too (the collector calls it on a version change).
    """

    def __init__(self, granularity: float = 0.02) -> None:
        if not 0 < granularity <= 1:
            raise ValueError(f"granularity must be in (0, 1], got {granularity}")
        self.granularity = granularity
        self._last: tuple[int, int] | None = None  # (band, target) last reported
        self._last_collected = 0

    def band(self, collected: int, target: int) -> int:
        """The `granularity` band `collected` falls in; -1 once complete (its own band)."""
        if target <= 0:
            return 0
        if collected >= target:
            return -1
        return int(max(collected, 0) / target / self.granularity + 1e-9)

    def should_report(self, collected: int, target: int) -> bool:
        key = (self.band(collected, target), target)
        emptied = collected <= 0 and self._last_collected > 0
        if key == self._last and not emptied:
            return False
        self._last, self._last_collected = key, collected
        return True

    def reset(self) -> None:
        self._last = None


class ColocatedHooks(NoOpHooks):
    """Standalone on fixed GPUs: the shards that share a GPU with the trainer (its first
    `train_gpus` of `gpus`) sleep while it trains and come back (synced to the new version)
    after; the others keep generating. The same partial overlap the scheduler applies, without
    a scheduler."""

    def __init__(self, gpus: list[int], train_gpus: int = 1) -> None:
        super().__init__(gpus)
        self.train = list(gpus[:train_gpus])
        self.coordinator: ShardCoordinator | None = None
        self.overlap: dict[int, list[int]] = {}

    async def join(self, coordinator: ShardCoordinator, cfg: PipelineConfig) -> None:
        self.coordinator = coordinator
        shards = self.shard_gpus(cfg)
        self.overlap = {r: g for r, g in shards.items() if set(g) & set(self.train)}
        await coordinator.resize_inference([], shards)

    async def before_training(self, step: int) -> list[int]:
        if self.overlap and self.coordinator is not None:
            await self.coordinator.resize_inference(sorted(self.overlap), {})
        return list(self.train)

    async def after_training(self, step: int, demand: RolloutDemand | None = None) -> None:
        if self.overlap and self.coordinator is not None:
            await self.coordinator.resize_inference([], dict(self.overlap))
