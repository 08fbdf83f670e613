"""Value types shared by the ledger, the planner, the Ray service and the simulator.

All of them are plain frozen dataclasses: no Ray, no torch, cheap to copy and to pickle.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class Stage(enum.IntEnum):
    """What a pipeline wants GPUs for. Lower value = served first.

    Every stage above ROLLOUT is granted before any rollout shard and is never preempted;
    rollout shards are preempted to make room for them.
    """

    INIT = 0
    TRAIN = 1
    LOGPROB = 2
    ROLLOUT = 3

    @classmethod
    def parse(cls, value: "Stage | str | int") -> "Stage":
        if isinstance(value, Stage):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                names = ", ".join(s.name.lower() for s in cls)
                raise ValueError(f"unknown stage {value!r}; expected one of {names}") from None
        return cls(value)


class Role(enum.Enum):
    """What a held GPU is doing for its pipeline."""

    TRAIN = "train"  # any non-preemptible stage (init, train, logprob)
    GENERATE = "generate"  # one inference shard


@dataclass(frozen=True)
class PipelineSpec:
    """What the scheduler needs to know about a pipeline.

    `priority`: strict tiers, higher is served first. `weight`: share within a tier.
    `seqs_per_shard`: concurrent trajectories one shard should carry; it converts the
    trajectories still needed into a demand in shard units.
    """

    name: str
    priority: int = 0
    weight: float = 1.0
    train_gpus: int = 1
    tp: int = 1
    min_shards: int = 1
    max_shards: int = 1
    partial_overlap: bool = True
    seqs_per_shard: int = 8
    #: its trainer is a process bound to its GPUs (a real run): it trains on a home chosen at
    #: registration, always the same GPUs; its own shards may still sit there (partial overlap)
    fixed_trainer: bool = False
    #: a preempted shard of it gives its GPU memory back (sleeps). False: it can only pause
    #: (vLLM on a platform without sleep mode), so the memory stays held; a GPU is then only
    #: time-shared where it is not a real one (fake GPUs on CPU), and the ledger says so
    frees_memory: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name must not be empty")
        if self.weight <= 0 or not math.isfinite(self.weight):
            problems.append(f"weight must be a positive number, got {self.weight}")
        if self.train_gpus < 0:
            problems.append(f"train_gpus must be >= 0, got {self.train_gpus}")
        if self.tp < 1:
            problems.append(f"tp must be >= 1, got {self.tp}")
        if self.max_shards < 1:
            problems.append(f"max_shards must be >= 1, got {self.max_shards}")
        if not 0 <= self.min_shards <= self.max_shards:
            problems.append(
                f"min_shards must be in [0, max_shards={self.max_shards}], got {self.min_shards}"
            )
        if self.seqs_per_shard < 1:
            problems.append(f"seqs_per_shard must be >= 1, got {self.seqs_per_shard}")
        if problems:
            raise ValueError(f"pipeline {self.name!r}: " + "; ".join(problems))


@dataclass(frozen=True)
class GpuRequest:
    """A pipeline asks for `gpus` GPUs for a non-rollout stage."""

    id: int
    pipeline: str
    stage: Stage
    gpus: int
    submitted_at: float


@dataclass(frozen=True)
class Progress:
    """A pipeline's rollout demand, as reported by its collector.

    `remaining`: trajectories it can still use now, in-flight ones included: its next step's
    shortfall, or more where its staleness window lets it generate ahead (the real collector's
    `RolloutDemand.remaining`; the simulator's released batches). What shards are planned for.
    `for_next_step`: of those, what its next step still lacks (target minus finished); the
    planner's estimate of when it next trains. None: the same as `remaining`.
    `shard_load`: optional running-request count per active dp rank; the planner preempts
    the least loaded shards first so fewer requests have to be re-dispatched.
    `turns_outstanding`: agent episodes only: policy calls still to come (at most) from the
    episodes in flight and those not started; reported for operators, not yet planned on.
    `pending_work`: generation work is waiting on this pipeline now (requests outstanding at
    its router, or a train step waiting for its batch). Evidence beside `remaining`: the
    planner keeps it a floor of one shard whatever `remaining` says.
    `seconds_per_trajectory`: measured shard-seconds per finished trajectory (the seconds its
    active shards were held, summed over shards, over the trajectories they finished in that
    time: the inverse of one shard's throughput as the pipeline runs). With it the planner
    knows a pipeline's expected work, `remaining x seconds_per_trajectory` shard-seconds, and
    moves a GPU only where that work repays the move (`rlix.scheduler.costs.MoveCosts`).
    None: unknown, and moves are planned as if they cost nothing.
    `setting_up`: the pipeline registered but is still setting up (loading its model, starting
    its trainer and engines): it has no demand yet, so the GPUs stay with pipelines that can use
    them, and it is planned for from its `ready` on (no report then means full demand). The
    scheduler stamps it at registration; the pipeline never sends it.
    `engines_starting`: GPUs where the pipeline's engine process is still starting in the
    background: a shard placed there generates only once it is up (seconds), so the planner
    puts no further shard of the pipeline there meanwhile (`Ledger.engines_starting`).
    """

    pipeline: str
    remaining: int
    target: int = 0
    step: int = 0
    shard_load: dict[int, int] = field(default_factory=dict)
    turns_outstanding: int | None = None
    reported_at: float = 0.0
    pending_work: bool = False
    seconds_per_trajectory: float | None = None
    setting_up: bool = False
    for_next_step: int | None = None
    engines_starting: frozenset[int] = frozenset()

    @property
    def next_step_remaining(self) -> int:
        return self.remaining if self.for_next_step is None else self.for_next_step

    def work_s(self) -> float | None:
        """Expected shard-seconds of generation left, or None when the rate is unknown."""
        spt = self.seconds_per_trajectory
        return None if spt is None else self.remaining * spt

    @property
    def busy(self) -> bool:
        """A shard of it has requests running (`shard_load`)."""
        return any(n > 0 for n in self.shard_load.values())


@dataclass(frozen=True)
class Holding:
    """GPUs held by one pipeline in one role. A shard holding carries its dp rank."""

    pipeline: str
    role: Role
    gpus: tuple[int, ...]
    since: float
    stage: Stage = Stage.ROLLOUT
    dp_rank: int | None = None
    request_id: int | None = None

    @property
    def key(self) -> tuple:
        if self.role is Role.GENERATE:
            return (self.pipeline, "shard", self.dp_rank)
        return (self.pipeline, "stage", self.stage)


@dataclass(frozen=True)
class Grant:
    """A non-rollout request is granted these GPUs."""

    request_id: int
    pipeline: str
    stage: Stage
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class ShardMove:
    """One shard of one pipeline, on these GPUs, goes to sleep (shrink) or wakes (expand)."""

    pipeline: str
    dp_rank: int
    gpus: tuple[int, ...]


@dataclass
class Plan:
    """What the planner decided. Apply order: shrinks, then grants and expands.

    An action only has to wait for the shrinks that free the GPUs it uses.
    `wake_at`: the earliest time a re-plan may change something by itself (a dwell time
    expiring or a request ageing), or None.
    """

    grants: list[Grant] = field(default_factory=list)
    shrinks: list[ShardMove] = field(default_factory=list)
    expands: list[ShardMove] = field(default_factory=list)
    wake_at: float | None = None

    def is_empty(self) -> bool:
        return not (self.grants or self.shrinks or self.expands)

    def summary(self) -> str:
        parts = []
        for g in self.grants:
            parts.append(f"grant {g.pipeline}/{g.stage.name.lower()} gpus={list(g.gpus)}")
        for s in self.shrinks:
            parts.append(f"shrink {s.pipeline}#{s.dp_rank} gpus={list(s.gpus)}")
        for e in self.expands:
            parts.append(f"expand {e.pipeline}#{e.dp_rank} gpus={list(e.gpus)}")
        return "; ".join(parts) if parts else "no change"


@dataclass(frozen=True)
class Topology:
    """The cluster: `gpus_per_node[i]` GPUs on node i, numbered consecutively from 0; `slices`:
    how many of them share one physical device (consecutive ids, `sliced`)."""

    gpus_per_node: tuple[int, ...]
    slices: int = 1

    def __post_init__(self) -> None:
        if not self.gpus_per_node or any(n < 0 for n in self.gpus_per_node):
            raise ValueError(f"invalid topology {self.gpus_per_node}")

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int) -> "Topology":
        return cls(tuple([gpus_per_node] * nodes))

    def sliced(self, slices: int) -> "Topology":
        """Every GPU as `slices` GPUs (consecutive ids, same node): how the scheduler sees a
        cluster whose GPUs are shared by several holders at once (`cluster.gpu_slices`)."""
        if slices < 1:
            raise ValueError(f"slices must be >= 1, got {slices}")
        return Topology(tuple(n * slices for n in self.gpus_per_node), self.slices * slices)

    @property
    def num_gpus(self) -> int:
        return sum(self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return len(self.gpus_per_node)

    def node_gpus(self, node: int) -> range:
        start = sum(self.gpus_per_node[:node])
        return range(start, start + self.gpus_per_node[node])

    def node_of(self) -> list[int]:
        """Node index of every GPU id."""
        out: list[int] = []
        for node, n in enumerate(self.gpus_per_node):
            out.extend([node] * n)
        return out
