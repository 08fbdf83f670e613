"""Seeded trajectory generation: the workload is drawn once, before any policy runs.

Every policy replays the same `Workload` objects, so differences between policies come from
scheduling alone. Each pipeline draws from its own stream, seeded by (scenario seed, pipeline
index), so adding a pipeline does not change the others' trajectories.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rlix.sim.scenario import LogNormal, PipelineSetup, RolloutModel, Scenario


@dataclass(frozen=True)
class TrajectorySpec:
    """One trajectory: tokens generated per turn, and tool seconds after every turn but the last."""

    gen: tuple[int, ...]
    tool: tuple[float, ...]
    prompt_tokens: int
    obs_tokens: int

    @property
    def turns(self) -> int:
        return len(self.gen)

    def context_before(self, turn: int) -> int:
        """Input tokens the model has seen when `turn` starts (prompt, earlier turns, tool output)."""
        return self.prompt_tokens + sum(self.gen[:turn]) + turn * self.obs_tokens

    def new_input(self, turn: int) -> int:
        """Input tokens a turn adds on top of a cached prefix: the prompt, or one observation."""
        return self.prompt_tokens if turn == 0 else self.obs_tokens


@dataclass(frozen=True)
class Workload:
    """All batches of one pipeline: `batches[k]` is what train step k consumes."""

    pipeline: str
    batches: tuple[tuple[TrajectorySpec, ...], ...]

    @property
    def trajectories(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def tokens(self) -> int:
        return sum(sum(t.gen) for b in self.batches for t in b)

    def min_prefill_tokens(self) -> int:
        """Prefill with a perfect prefix cache: each turn's new input only."""
        return sum(t.new_input(i) for b in self.batches for t in b for i in range(t.turns))


def _lognormal(rng: random.Random, dist: LogNormal) -> float:
    x = dist.median if dist.sigma == 0 else rng.lognormvariate(math.log(dist.median), dist.sigma)
    return min(x, dist.max) if dist.max is not None else x


def _turns(rng: random.Random, r: RolloutModel) -> int:
    """1 + geometric on {0, 1, ...} with mean m (success probability 1 / (1 + m)), capped."""
    m = r.extra_turns_mean
    extra = 0
    if m > 0:
        p = 1.0 / (1.0 + m)
        u = 1.0 - rng.random()  # in (0, 1]
        extra = int(math.floor(math.log(u) / math.log(1.0 - p)))
    return min(1 + extra, r.max_turns)


def draw_trajectory(rng: random.Random, r: RolloutModel) -> TrajectorySpec:
    n = _turns(rng, r)
    gen = tuple(max(1, int(round(_lognormal(rng, r.gen_tokens)))) for _ in range(n))
    tool = tuple(_lognormal(rng, r.tool_s) for _ in range(n - 1))
    return TrajectorySpec(gen=gen, tool=tool, prompt_tokens=r.prompt_tokens, obs_tokens=r.obs_tokens)


def generate_pipeline(seed: int, setup: PipelineSetup) -> Workload:
    rng = random.Random(f"rlix-sim/{seed}/{setup.index}")
    batches = tuple(tuple(draw_trajectory(rng, setup.rollout) for _ in range(setup.rollout.batch))
                    for _ in range(setup.steps))
    return Workload(pipeline=setup.name, batches=batches)


@dataclass(frozen=True)
class GpuWork:
    """A lower bound on the GPU-seconds a pipeline needs: its train steps, decode at the most
    efficient batch (a full shard) and prefill with a perfect prefix cache. Its share of the
    scenario's total is the pipeline's share of demand."""

    train: float
    decode: float
    prefill: float
    stages: float = 0.0  # the extra non-rollout stages (logprob...)

    @property
    def total(self) -> float:
        return self.train + self.decode + self.prefill + self.stages


def gpu_work(setup: PipelineSetup, workload: Workload) -> GpuWork:
    e, tp = setup.engine, setup.spec.tp
    best_step_s = (e.decode_base_ms + e.decode_per_seq_ms * e.max_seqs) / 1000.0
    return GpuWork(train=setup.steps * setup.train_gpu_seconds,
                   decode=workload.tokens * best_step_s / e.max_seqs * tp,
                   prefill=workload.min_prefill_tokens() / e.prefill_tokens_per_s * tp,
                   stages=setup.steps * sum(st.gpu_seconds for st in setup.stages))


def generate(scenario: Scenario) -> dict[str, Workload]:
    return {p.name: generate_pipeline(scenario.seed, p) for p in scenario.pipelines}
