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

    async def after_training(self, step: int) -> None:
        """The training GPUs are free again (weights cached, trainer offloaded)."""
        ...

    async def report_progress(self, collected: int, target: int, step: int,
                              shard_load: dict[int, int] | None = None) -> None:
        """Rollout demand: trajectories collected vs needed for the next step."""
        ...

    async def clear_progress(self) -> None: ...


class NoOpHooks:
    """Standalone: the fixed training GPUs are always granted; progress goes nowhere."""

    def __init__(self, gpus: list[int] | None = None) -> None:
        self.gpus = list(gpus or [])

    async def before_training(self, step: int) -> list[int]:
        return list(self.gpus)

    async def after_training(self, step: int) -> None:
        return None

    async def report_progress(self, collected: int, target: int, step: int,
                              shard_load: dict[int, int] | None = None) -> None:
        return None

    async def clear_progress(self) -> None:
        return None


class ProgressThrottle:
    """Report only when the completed share crosses a `granularity` boundary (2% by default),
    at 0% and 100%, and whenever the target changes: the scheduler hears every real change
    without a message per trajectory."""

    def __init__(self, granularity: float = 0.02) -> None:
        self.granularity = granularity
        self._last: tuple[int, int] | None = None  # (bucket, target)

    def should_report(self, collected: int, target: int) -> bool:
        if target <= 0:
            bucket = -1
        else:
            frac = min(max(collected / target, 0.0), 1.0)
            bucket = len(range(0, int(frac / self.granularity + 1e-9) + 1)) - 1
            if frac >= 1.0:
                bucket = 10**6
        key = (bucket, target)
        if key == self._last:
            return False
        self._last = key
        return True


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

    async def after_training(self, step: int) -> None:
        if self.overlap:
            await self.coordinator.resize_inference([], dict(self.overlap))
