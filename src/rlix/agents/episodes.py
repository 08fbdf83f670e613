"""An episode's turns as one training sample: the engine's sampled ids, context masked out.

The sample is turn 1's prompt, then for every turn the context the gateway added before it
(tool outputs, template tokens: loss mask 0, logprob 0) and the ids the engine sampled (mask 1,
the engine's logprobs). Each turn's prompt must begin with everything before it, token for
token; an episode where that fails is not trained on (`Unstitchable` names the turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlix.agents.gateway import EpisodeTrace


class Unstitchable(Exception):
    """This episode's tokens cannot be one exact sample; the message is the counted reason."""


@dataclass(frozen=True)
class EpisodeSample:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's for sampled tokens, 0.0 for context
    loss_mask: list[int]  # 1: sampled by the policy, 0: context
    turns: int

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)


def stitch(trace: EpisodeTrace) -> EpisodeSample:
    if trace.broken is not None:
        raise Unstitchable(f"not token-exact: {trace.broken}")
    if not trace.turns:
        raise Unstitchable("the agent made no policy call")
    prompt = list(trace.turns[0].prompt_ids)
    response: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for k, turn in enumerate(trace.turns, start=1):
        if len(turn.logprobs) != len(turn.token_ids):
            raise Unstitchable(f"turn {k}: {len(turn.logprobs)} logprobs for {len(turn.token_ids)} tokens")
        done = len(prompt) + len(response)
        if turn.prompt_ids[:done] != prompt + response:
            raise Unstitchable(f"turn {k}: its prompt does not begin with the episode's tokens so far")
        context = turn.prompt_ids[done:]
        response += context + turn.token_ids
        logprobs += [0.0] * len(context) + list(turn.logprobs)
        mask += [0] * len(context) + [1] * len(turn.token_ids)
    return EpisodeSample(prompt, response, logprobs, mask, len(trace.turns))
