"""Typed results of one simulated policy run, and what each pipeline got out of it.

`PipelineResult` carries the raw counters plus the fairness figures: GPU-seconds held by role,
the pipeline's share of the GPU-seconds held against its share of the scenario's GPU work
(`workload.gpu_work`), its slowdown against running alone on the whole cluster (filled in by
`run_scenario` once the alone runs are known) and its longest wait with work but no shard.
`RunResult.jain_fairness` is Jain's index over pipelines of gpu_share / demand_share: 1 when
every pipeline's GPU share matches its demand share, 1/n when one pipeline got everything.
A policy that cannot run a scenario is a `NotApplicable`, not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PipelineResult:
    name: str
    priority: int
    started_at: float
    finished_at: float
    step_ends: list[float]
    trajectories: int
    tokens: float
    prefill_tokens: float
    preempted_turns: int
    aborted_turns: int
    kept_tokens: float
    train_gpu_s: float
    shard_busy_gpu_s: float
    decode_s: float
    seq_s: float
    whole_cluster: bool  # ran on a domain equal to the whole cluster, alone
    traj_finish_times: list  # per released trajectory, None if it never finished
    train_waits: list
    expands: int
    turns: int
    queue_turn_s: float
    arrived_at: float = 0.0  # when it was submitted (started_at may be later: queued)
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # held, by role
    demand_gpu_s: float = 0.0  # its GPU work (lower bound), see workload.gpu_work
    demand_share: float = 0.0
    gpu_share: float = 0.0
    longest_shardless_wait_s: float = 0.0
    shardless_s: float = 0.0  # all such waits together
    slowdown: float | None = None  # completion time over completion time alone; None: not known
    crashes: int = 0

    @property
    def makespan(self) -> float:
        return self.finished_at

    @property
    def duration(self) -> float:
        return self.finished_at - self.started_at

    @property
    def completion_s(self) -> float:
        """From its arrival to its end: what its user waits for."""
        return self.finished_at - self.arrived_at

    @property
    def held_gpu_s(self) -> float:
        return sum(self.gpu_seconds.values())


@dataclass
class RunResult:
    policy: str
    gpus: int
    pipelines: dict[str, PipelineResult] = field(default_factory=dict)
    plan_calls: int = 0
    transition_gpu_s: float = 0.0
    events: int = 0
    jain_fairness: float = 1.0
    teardown_s: float = 0.0  # the last run's exit after its last step (scenario `run:`)

    @property
    def makespan(self) -> float:
        """Launch to the exit of the last process: the latest finish plus the teardown (under
        exclusive-queue every job's teardown before the last is in the later jobs' starts)."""
        return max(p.finished_at for p in self.pipelines.values()) + self.teardown_s

    def fill_shares(self) -> None:
        """Shares of held GPU-seconds and of demand, and Jain's index of their ratio."""
        pipes = list(self.pipelines.values())
        held = sum(p.held_gpu_s for p in pipes)
        demand = sum(p.demand_gpu_s for p in pipes)
        for p in pipes:
            p.gpu_share = p.held_gpu_s / held if held > 0 else 0.0
            p.demand_share = p.demand_gpu_s / demand if demand > 0 else 0.0
        self.jain_fairness = jain([p.gpu_share / p.demand_share for p in pipes if p.demand_share > 0])


@dataclass(frozen=True)
class NotApplicable:
    """A policy that cannot run this scenario (e.g. more pipelines than GPUs to partition)."""

    policy: str
    reason: str


def jain(xs: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2); 1.0 for no values or all zero."""
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if xs and sq > 0 else 1.0
