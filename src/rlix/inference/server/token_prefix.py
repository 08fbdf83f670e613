"""A multi-turn chat whose earlier turns keep the exact tokens they were sampled as.

An RL rollout trains on the tokens the policy sampled. In a multi-turn episode the next request
re-renders the whole conversation through the chat template, and re-tokenizing an earlier
assistant turn's text need not give back the tokens that were sampled (a different merge at a
word boundary, a tool call the agent reformatted). NeMo Gym's agents therefore send the previous
call's `prompt_token_ids` + `generation_token_ids` as `required_prefix_token_ids` (or leave them
on the assistant message, where NeMo RL's server looks for them): the new prompt must start with
exactly those ids, followed by what the template renders after them.

Where the prefix ends in the rendered prompt is found by its last token, which must be a special
token (a finished assistant turn ends with one: end-of-turn or end-of-sequence). Special tokens
are never produced by tokenizing text, so the k-th occurrence of that token in the rendered ids,
k being how often the prefix holds it, is the same turn boundary whatever the text between the
boundaries became. The prompt is then the prefix followed by the rendered ids after that point.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.server.limits import MAX_PROMPT_TOKENS

FIELD = "required_prefix_token_ids"


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"{where} must be a list of token ids", param=where)
    return value


def required_prefix(explicit: list[int] | None, messages: Sequence[dict[str, Any]]) -> tuple[list[int], str] | None:
    """The prefix the prompt must start with and the field it came from: the request's
    `required_prefix_token_ids`, else the last assistant message carrying `prompt_token_ids`
    and `generation_token_ids` (NeMo RL's rule); None when neither is there."""
    if explicit is not None:
        return list(explicit), FIELD
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") == "assistant" and "prompt_token_ids" in m:
            where = f"messages[{i}]"
            ids = (_ids(m["prompt_token_ids"], f"{where}.prompt_token_ids")
                   + _ids(m.get("generation_token_ids", []), f"{where}.generation_token_ids"))
            if len(ids) > MAX_PROMPT_TOKENS:
                raise InvalidRequestError(f"{where}: its token ids are more than {MAX_PROMPT_TOKENS}", param=where)
            return ids, where
    return None


def splice(rendered: list[int], prefix: list[int], specials: Collection[int], where: str) -> list[int]:
    """`prefix` followed by the `rendered` ids after the turn boundary it ends at (module doc).
    InvalidRequestError naming `where` when the prefix is empty, does not end with a special
    token, or holds that token more often than the rendered conversation does."""
    if not prefix:
        raise InvalidRequestError(f"{where}: an empty prefix", param=where)
    last = prefix[-1]
    if last not in specials:
        raise InvalidRequestError(f"{where} must end with a special token (a finished turn's end-of-turn "
                                  f"token), not {last}: only there can the rendered conversation be joined "
                                  "to it", param=where)
    wanted = prefix.count(last)
    seen = 0
    for at, token in enumerate(rendered):
        if token == last:
            seen += 1
            if seen == wanted:
                return prefix + rendered[at + 1:]
    raise InvalidRequestError(f"{where} holds token {last} {wanted} times but the rendered conversation only "
                              f"{seen}: it is not a prefix of this conversation", param=where)
