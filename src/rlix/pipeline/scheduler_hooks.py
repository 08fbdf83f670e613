"""The hooks of time-sharing mode: the rlix scheduler (the Ray actor "rlix:scheduler") places the
pipeline's shards and grants its training GPUs; the loop's requests and the collector's demand go
there. Standalone mode uses rlix.pipeline.hooks.ColocatedHooks."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlix.scheduler.types import Progress

if TYPE_CHECKING:  # annotations only: the coordinator imports the inference fleet
    from rlix.config.models import PipelineConfig
    from rlix.inference.fleet.fleet import ShardFleet
    from rlix.pipeline.coordinator import ShardCoordinator
    from rlix.pipeline.device_plan import DevicePlan
    from rlix.pipeline.rollout.types import RolloutDemand

log = logging.getLogger("rlix.pipeline")


class SchedulerHooks:
    """`coordinator_handle` is what the scheduler calls back (`resize_inference`): the
    pipeline's Ray actor. `gpus`: the scheduler's GPU ids the pipeline may be given (where its
    reports say engines are still starting). `metrics_path`: its metrics.jsonl, named at
    registration so the scheduler's dashboard can draw its curves."""

    mode = "rlix"

    def __init__(self, scheduler: Any, pipeline: str, train_gpus: int, coordinator_handle: Any = None,
                 gpus: list[int] | None = None, metrics_path: str | None = None) -> None:
        self.scheduler, self.pipeline, self.train_gpus = scheduler, pipeline, train_gpus
        self.metrics_path = metrics_path
        self.coordinator_handle = coordinator_handle
        self.gpus = list(gpus or [])
        self.fleet: ShardFleet | None = None  # known from `join` on
        self.granted: list[int] = []
        self.home: list[int] = []
        self.wait_s = 0.0
        self._releasing: Any = None  # the release call in flight (a Ray ObjectRef)
        self._complete: Progress | None = None  # "batch complete", held for the next request
        # the next batch was complete when training ended: the GPUs are kept, and the next
        # request releases and asks again in one call (scheduler.cycle)
        self._cycling: Progress | None = None
        # the latest measured shard-seconds per trajectory: every report carries it, the one
        # that rides on a training request or a release too
        self._rate: float | None = None
        # the last report sent said a shard of it had requests running (the scheduler does not
        # take such a shard for an equal pipeline: it must hear when they went idle)
        self._sent_busy = False

    def shard_gpus(self, cfg: PipelineConfig) -> dict[int, list[int]]:
        """Every shard it may use; the scheduler decides where and when each runs."""
        return {r: [] for r in range(cfg.max_shards)}

    def resident_gpu_sets(self, cfg: PipelineConfig, devices: DevicePlan,
                          home: list[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Any GPU may be given to this pipeline's shards: an engine waits, asleep, on its
        training home from set-up, and on every other GPU where the run keeps engines resident
        (a move is then a wake, not a process start)."""
        return devices.resident_gpu_sets(cfg.tp, home)

    async def reserve(self, cfg: PipelineConfig, frees_memory: bool = True) -> list[int]:
        """Register as setting up; the scheduler answers with the training home, where the
        trainer is placed. It plans no shards for the pipeline until `join` says it is ready,
        so the GPUs stay with pipelines that can use them meanwhile."""
        self.home = list(await self.scheduler.register.remote(cfg.spec(frees_memory), self.coordinator_handle,
                                                              setting_up=True, metrics_path=self.metrics_path))
        return self.home

    async def join(self, coordinator: ShardCoordinator, cfg: PipelineConfig) -> None:
        """Shards started unplaced go to sleep: the scheduler wakes them where it decides.
        (Placed shards start only when the scheduler first gives them GPUs.) Then the
        scheduler plans for the pipeline: each is planned for as soon as it is ready."""
        await coordinator.fleet.sleep_partial(sorted(coordinator.fleet.shards))
        self.fleet = coordinator.fleet
        await self.scheduler.ready.remote(self.pipeline, self.engines_starting())

    async def leave(self) -> None:
        """The last release is collected (its error logged), then the pipeline unregisters."""
        try:
            await self.settle()
            if self._cycling is not None:  # the run ended holding the GPUs for a step it never took
                self._cycling = None
                await self.scheduler.release.remote(self.pipeline, "train")
        except Exception as exc:  # noqa: BLE001 - leaving anyway; the scheduler frees its GPUs
            log.warning("%s: the last release failed: %r", self.pipeline, exc)
        await self.scheduler.unregister.remote(self.pipeline)

    async def before_training(self, step: int) -> list[int]:
        """Blocks until the scheduler grants the training GPUs (it shrinks shards there first).
        A held "batch complete" report goes with the request (a cycle, when the GPUs were kept)."""
        t0 = time.perf_counter()
        await self.settle()  # an async actor may run calls out of order: the release goes first
        complete, self._complete = self._complete, None
        if complete is not None and complete.step != step:
            complete = None  # an older batch's (the step is the weight version collected for)
        cycling, self._cycling = self._cycling, None
        sent = complete or cycling
        if sent is not None:
            self._sent_busy = sent.busy
        if cycling is not None:
            self.granted = list(await self.scheduler.cycle.remote(self.pipeline, "train", self.train_gpus,
                                                                  complete or cycling))
        else:
            self.granted = list(await self.scheduler.request.remote(self.pipeline, "train", self.train_gpus,
                                                                    complete))
        self.wait_s += time.perf_counter() - t0
        return self.granted

    async def after_training(self, step: int, demand: RolloutDemand | None = None) -> None:
        """One call: the new demand and the release are applied before one re-plan. Sent, not
        awaited: the step goes on while the scheduler re-plans; its answer (or error) is
        collected by the next `before_training` or `settle`. With the next batch complete,
        nothing is sent: the GPUs are kept and the next `before_training` cycles them."""
        progress = None if demand is None else self._progress(demand, step + 1)
        await self.settle()
        if progress is not None and demand is not None and demand.complete:
            # The next batch is already complete: this pipeline trains again at once. Released
            # now, its GPUs would be lent to another pipeline's rollouts in the next plan, and
            # the request a moment later would wait for that shard's start (or wake) and sleep.
            # The next before_training releases and asks again in one re-plan, where requests
            # already waiting for these GPUs compete as usual.
            self._cycling = progress
            return
        if progress is not None:
            self._sent_busy = False  # a release's report carries no load
        self._releasing = self.scheduler.release.remote(self.pipeline, "train", progress)
        self.granted = []

    async def settle(self) -> None:
        """Wait for the release in flight, if any; raises its error."""
        ref, self._releasing = self._releasing, None
        if ref is not None:
            await ref

    async def shard_ranks(self) -> set[int] | None:
        """The shards the scheduler's plan places now, once the release in flight is answered
        (its error is raised, as `before_training` would); None if the scheduler cannot say."""
        await self.settle()
        try:
            return set(await self.scheduler.shard_ranks.remote(self.pipeline))
        except Exception as exc:  # noqa: BLE001 - the shards stay warm until a later step asks
            log.warning("%s: the scheduler did not say which shards it places: %r", self.pipeline, exc)
            return None

    def engines_starting(self) -> frozenset[int]:
        """The GPUs where an engine of this pipeline is still starting in the background."""
        if self.fleet is None:
            return frozenset()
        return frozenset(g for g in self.gpus if self.fleet.starting_on((g,)))

    def _progress(self, demand: RolloutDemand, step: int,
                  shard_load: dict[int, int] | None = None, turns_outstanding: int | None = None,
                  pending_work: bool = False) -> Progress:
        return Progress(self.pipeline, remaining=demand.remaining, target=demand.target,
                        for_next_step=demand.for_next_step,
                        step=int(step), shard_load=dict(shard_load or {}), turns_outstanding=turns_outstanding,
                        pending_work=bool(pending_work), seconds_per_trajectory=self._rate,
                        engines_starting=self.engines_starting())

    async def report_progress(self, demand: RolloutDemand, step: int,
                              shard_load: dict[int, int] | None = None,
                              turns_outstanding: int | None = None,
                              pending_work: bool = False,
                              seconds_per_trajectory: float | None = None) -> None:
        """A complete batch is not reported on its own: the loop's next call is the training
        request, which carries it. Alone, "no demand left" let the planner give this
        pipeline's shard to another pipeline just before the training request took that
        GPU back (a wasted wake, sync and sleep). Except when its shards went idle: the last
        report sent said they were busy, and busy shards are not lent."""
        if seconds_per_trajectory is not None:
            self._rate = seconds_per_trajectory
        progress = self._progress(demand, step, shard_load, turns_outstanding, pending_work)
        went_idle = shard_load is not None and self._sent_busy and not progress.busy
        if demand.complete and not went_idle:
            self._complete = progress
            return
        self._complete = None
        self._sent_busy = progress.busy
        await self.scheduler.report_progress.remote(progress)

    async def clear_progress(self) -> None:
        self._complete = None
        await self.scheduler.report_progress.remote(Progress(self.pipeline, remaining=0))
