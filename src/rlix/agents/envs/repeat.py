"""`repeat`: the shipped environment, one a tiny random model learns within a few dozen steps.

The example's answer is a pattern ("z"); the model should repeat it. Its `check` tool scores an
answer as the pattern task does (the share of the first `length` characters that follow the
pattern) and says so; the ToolAgent feeds that back after each turn. The reward is the mean
score of the episode's assistant replies, so every turn counts.
"""

from __future__ import annotations

from typing import Any

from rlix.agents.protocol import VerifyRequest, VerifyResult
from rlix.agents.sdk import EpisodeContext, ResourcesServer, tool
from rlix.envs.tasks import PatternTask, Prompt


class RepeatResources(ResourcesServer):
    def __init__(self, tool_latency_s: float = 0.0, length: int = 12) -> None:
        super().__init__(tool_latency_s)
        self.scorer = PatternTask(length=length)

    def score(self, episode: EpisodeContext, answer: str) -> float:
        pattern = str(episode.example.answer) if episode.example and episode.example.answer else "a"
        return self.scorer.reward(Prompt("", pattern), answer)

    @tool("Score an answer.")
    async def check(self, episode: EpisodeContext, answer: str) -> str:
        episode.state["checks"] = episode.state.get("checks", 0) + 1
        return f"score {self.score(episode, answer):.2f}"

    async def verify(self, req: VerifyRequest, episode: EpisodeContext) -> VerifyResult:
        replies = [m.get("content") or "" for m in req.messages if m.get("role") == "assistant"]
        scores = [self.score(episode, r) for r in replies]
        info: dict[str, Any] = {"scores": scores, "checks": episode.state.get("checks", 0)}
        return VerifyResult(reward=sum(scores) / len(scores) if scores else 0.0, info=info)
