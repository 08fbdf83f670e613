"""Trajectories and GRPO groups: plain dataclasses shared by the collector, buffer and loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # one per response token, from the engine that sampled it
    reward: float
    version: int  # the OLDEST weight version any of its tokens was generated with
    versions: list[int] = field(default_factory=list)  # distinct versions, in generation order
    finish_reason: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    # multi-turn episodes: 1 where the policy sampled the token, 0 for context between its turns
    # (tool outputs, chat-template tokens); None: every response token was sampled
    loss_mask: list[int] | None = None


@dataclass
class Group:
    """All samples of one prompt: GRPO normalises rewards within it, so it is trained whole."""

    group_id: str
    prompt: str
    trajectories: list[Trajectory]

    @property
    def version(self) -> int:
        return min(t.version for t in self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


@dataclass(frozen=True)
class RolloutDemand:
    """What a pipeline's rollouts still need, as its collector sees it at one moment.

    `collected` / `target`: trajectories valid for the next step (capped at it) and that step's
    batch; `complete` says the trainer could go at once. `outstanding`: trajectories it can
    still use now, in flight or not yet started: its staleness window (`groups_per_step x
    (max_staleness + 1)` groups, fewer near its last step) less the valid ones buffered.
    `remaining` is what the scheduler plans shards for: with only the next step's shortfall,
    a pipeline whose next batch was complete reported nothing left, its shards generating the
    batch after were taken for another pipeline, and their work in flight went stale.
    """

    collected: int
    target: int
    outstanding: int = 0

    @property
    def complete(self) -> bool:
        return self.target > 0 and self.collected >= self.target

    @property
    def for_next_step(self) -> int:
        return max(self.target - self.collected, 0)

    @property
    def remaining(self) -> int:
        return max(self.for_next_step, self.outstanding)


#: a pipeline that wants nothing more (its last step is trained)
NO_DEMAND = RolloutDemand(0, 0, 0)

