"""What a step's batch says about the policy, beside the trainer's own numbers: response lengths
and how many ran into their length limit, reward and advantage spread, and how far behind the
trained weights the samples were generated (staleness). Pure functions over the batch, so they
are checked without a pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlix.pipeline.rollout.types import Group
from rlix.training.types import TrainSample

#: a generation that stopped because it reached its token limit, not on its own
TRUNCATED = "length"


@dataclass(frozen=True)
class BatchStats:
    response_len_mean: float
    response_len_max: int
    response_truncated_frac: float
    reward_min: float
    reward_max: float
    advantage_mean: float
    advantage_std: float
    advantage_min: float
    advantage_max: float
    staleness_mean: float
    staleness_max: int


def _spread(values: Sequence[float]) -> tuple[float, float, float, float]:
    """mean, population std, min, max (zeros for no values)."""
    if not values:
        return 0.0, 0.0, 0.0, 0.0
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    return mean, std, min(values), max(values)


def batch_stats(groups: Sequence[Group], samples: Sequence[TrainSample], trained_version: int) -> BatchStats:
    """`groups`: the batch as taken from the collector; `samples`: the same trajectories as the
    trainer gets them (their advantages); `trained_version`: the weights the step trained (the
    step's number less one), from which staleness is counted: 0 for a sample those very weights
    generated."""
    trajectories = [t for g in groups for t in g.trajectories]
    lengths = [len(t.response_ids) for t in trajectories]
    rewards = [float(t.reward) for t in trajectories]
    lag = [trained_version - int(t.version) for t in trajectories]
    adv_mean, adv_std, adv_min, adv_max = _spread([float(s.advantage) for s in samples])
    n = max(len(trajectories), 1)
    return BatchStats(
        response_len_mean=sum(lengths) / n, response_len_max=max(lengths, default=0),
        response_truncated_frac=sum(1 for t in trajectories if t.finish_reason == TRUNCATED) / n,
        reward_min=min(rewards, default=0.0), reward_max=max(rewards, default=0.0),
        advantage_mean=adv_mean, advantage_std=adv_std, advantage_min=adv_min, advantage_max=adv_max,
        staleness_mean=sum(lag) / n, staleness_max=max(lag, default=0))
