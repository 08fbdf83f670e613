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
