"""The hooks through which a pipeline talks to a control plane, and the no-op standalone ones.

Time-sharing mode uses rlix.pipeline.scheduler_hooks.SchedulerHooks (GPU requests and demand go
to the rlix scheduler); standalone mode uses NoOpHooks (fixed GPUs, nobody to tell).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RLixHooks(Protocol):
    async def before_training(self, step: int) -> list[int]:
        """Block until the training GPUs are this pipeline's; returns them."""
        ...

    async def after_training(self, step: int, demand: tuple[int, int] | None = None) -> None:
        """The training GPUs are free again (weights cached, trainer offloaded). `demand`
        (collected, target) for the next step goes with the release, so the control plane
        hands the GPUs out knowing it."""
        ...

    async def report_progress(self, collected: int, target: int, step: int,
                              shard_load: dict[int, int] | None = None) -> None:
        """Rollout demand: trajectories collected vs needed for the next step."""
        ...

    async def clear_progress(self) -> None: ...

    async def settle(self) -> None:
        """Return once every call sent so far has been answered (a release may be in flight)."""
        ...


class NoOpHooks:
    """Standalone: the fixed training GPUs are always granted; progress goes nowhere."""

    def __init__(self, gpus: list[int] | None = None) -> None:
        self.gpus = list(gpus or [])

    async def before_training(self, step: int) -> list[int]:
        return list(self.gpus)

    async def after_training(self, step: int, demand: tuple[int, int] | None = None) -> None:
        return None

    async def report_progress(self, collected: int, target: int, step: int,
                              shard_load: dict[int, int] | None = None) -> None:
        return None

    async def clear_progress(self) -> None:
        return None

    async def settle(self) -> None:
        return None


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
    """Standalone on fixed GPUs: the shards that share a GPU with the trainer sleep while it
    trains and come back (synced to the new version) after; the others keep generating. The
    same partial overlap the scheduler applies, without a scheduler. `coordinator` is the
    pipeline's ShardCoordinator; `shard_gpus` maps each dp rank to its GPUs."""

    def __init__(self, coordinator, train_gpus: list[int], shard_gpus: dict[int, list[int]]) -> None:  # type: ignore[no-untyped-def]
        super().__init__(train_gpus)
        self.coordinator = coordinator
        self.overlap = {r: g for r, g in shard_gpus.items() if set(g) & set(train_gpus)}

    async def before_training(self, step: int) -> list[int]:
        if self.overlap:
            await self.coordinator.resize_inference(sorted(self.overlap), {})
        return list(self.gpus)

    async def after_training(self, step: int, demand: tuple[int, int] | None = None) -> None:
        if self.overlap:
            await self.coordinator.resize_inference([], dict(self.overlap))
