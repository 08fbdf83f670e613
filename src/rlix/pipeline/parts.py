"""The parts of one pipeline (PipelineRunner): what runs it once set up, what its reports read
while it sets up, and how each part it started is stopped.

`PipelineParts` is made once, complete, when set-up has started everything: the code that runs
the pipeline (the loop, the shard watch, a checkpoint, the scheduler's calls) reads its parts
without asking which exist. Before then the pipeline is still asked how it is doing (progress,
its processes, the summary of a set-up that failed) and may be told to stop half-way:
`StartedParts` holds the parts those reports read, each set as it is made, and `Teardown` how to
stop each part started so far.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rlix.agents.environment import PipelineEnvironment
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.router.data_plane import DataPlaneThread
from rlix.inference.router.router import Router
from rlix.pipeline.async_grpo import GrpoLoop
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.pipeline.reporting.experiment_log import ExperimentLog
from rlix.pipeline.rollout.collector import TrajectoryCollector
from rlix.training.ranks import TrainerGroup
from rlix.weights.refit import WeightPath


@dataclass(frozen=True)
class PipelineParts:
    """Every part of a set-up pipeline. `env` is None when the config has no `env:` (the
    collector's rollouts are single generations); `experiment_log` is empty (falsy) when
    `logging:` chooses no tracker."""

    trainer: TrainerGroup
    weights: WeightPath  # publishes versions, refits shards
    data_plane: DataPlaneThread  # the router's own thread and loop
    router: Router
    fleet: ShardFleet
    coordinator: ShardCoordinator
    env: PipelineEnvironment | None  # `env:` set: agent episodes
    collector: TrajectoryCollector
    experiment_log: ExperimentLog
    loop: GrpoLoop


@dataclass
class StartedParts:
    """The parts the pipeline's reports read (progress, processes, the summary), each set once,
    as set-up makes it: a report asked while set-up runs, or after it failed, shows what was
    made (the shards' PIDs as they start, the failed join's shard history). Equal to the
    PipelineParts ones once set up."""

    fleet: ShardFleet | None = None
    coordinator: ShardCoordinator | None = None
    env: PipelineEnvironment | None = None
    collector: TrajectoryCollector | None = None


#: the order shutdown stops a pipeline's parts in, each name its key in shutdown's timings (an
#: external pipeline's program first: it drives the calls; the environment's gateway and the
#: router are closed on the data plane's thread, so before it stops)
STOP_ORDER = ("program", "leave", "collector", "environment", "router", "data plane", "shards", "weight path",
              "trainer", "experiment log")

#: how to stop one part: the step to await, or None when nothing is left to do by then
Stop = Callable[[], Awaitable[Any] | None]


class Teardown:
    """How each part a pipeline started is stopped, registered the moment it starts, so that a
    set-up that fails half-way stops exactly what it started.

    Parts stop in a fixed `order`, not in the reverse of their starts: the trainer and the
    engines start side by side, so their registrations interleave differently from run to run,
    and the order of stopping does not mirror the order of starting (the scheduler is left
    first, the experiment log, opened after the trainer, is closed last). Entries stay after a
    stop: a second shutdown asks each part to stop again.
    """

    def __init__(self, order: tuple[str, ...]) -> None:
        self.order = order
        self._stops: dict[str, Stop] = {}

    def add(self, name: str, stop: Stop) -> None:
        if name not in self.order:
            raise ValueError(f"no place in the stop order for {name!r}: {self.order}")
        if name in self._stops:
            raise ValueError(f"{name!r} is registered to stop already")
        self._stops[name] = stop

    def drop(self, name: str) -> None:
        """`name` is stopped already, by the one who started it (a run that finished left the
        scheduler itself)."""
        self._stops.pop(name, None)

    def steps(self) -> Iterator[tuple[str, Awaitable[Any]]]:
        """The stops in order, each made when the one before has been awaited (a stop may
        depend on what the earlier ones left, e.g. whether the data plane still runs)."""
        for name in self.order:
            stop = self._stops.get(name)
            step = stop() if stop is not None else None
            if step is not None:
                yield name, step
