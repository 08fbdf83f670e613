"""What all attempts of one relayed request produced so far, and the body of its next attempt.

Pure bookkeeping for relay.py: an attempt's output (whole or one streamed chunk) is added to the
running total (ids, text, logprobs in the endpoint's shape, weight-version spans shifted to where
the attempt began), and `upstream()` builds the continuation: prompt ids plus every token so far,
max_tokens minus those, through /v1/completions for a chat.

A continuation keeps the request's output constraint and says how many of the prompt's last ids
are output already generated (`already_generated`, rlix's own field of /v1/completions and
/inference/v1/generate): a shard advances a constrained request's matcher through them before
its first pick, so the joined output is one an uninterrupted constrained generation could have
given (without a constraint the count changes nothing). A chat's forced tool call goes as the
structural tag the chat endpoint compiles it to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from rlix.errors import InvalidRequestError
from rlix.inference.server import openai_schema as S
from rlix.inference.server.paths import CHAT, COMPLETIONS, GENERATE
from rlix.inference.server.tool_calls import ToolChoice, forced_call_constraint, tool_choice_of

#: what a continuation (token-level, through /v1/completions for a chat) carries over of a
#: chat or completions request, besides prompt, max_tokens and logprobs
CONTINUED_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "stream", "stream_options", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "skip_special_tokens",
                    "return_tokens_as_token_ids", "include_stop_str_in_output", "min_tokens",
                    "response_format", "structured_outputs")


def _min_left(holder: dict, done: int) -> dict:
    """`holder` (a request body or its sampling_params) with min_tokens less the `done` tokens
    of earlier attempts: the continuation's own output must only make up the rest."""
    wanted = holder.get("min_tokens")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0:
        return {**holder, "min_tokens": max(0, wanted - done)}
    return holder


def requested_n(path: str, body: dict) -> int:
    """How many samples a request asks for (1 when it says nothing sensible: the shard judges)."""
    holder = body.get("sampling_params") if path == GENERATE else body
    n = holder.get("n") if isinstance(holder, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def chat_items(lp: dict, k: int) -> list[dict]:
    """Completions logprobs (a continued chat's) as chat logprob items with k alternatives."""
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens", []))
    out = []
    for tok, value, top in zip(lp.get("tokens", []), lp.get("token_logprobs", []), tops):
        best = sorted((top or {}).items(), key=lambda kv: -kv[1])[:k]
        out.append(S.chat_logprob_item(tok, value, best))
    return out


@dataclass
class Attempts:
    """What all attempts of one request produced so far."""

    path: str
    body: dict
    wants_ids: bool
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    lp_tokens: list[str] = field(default_factory=list)  # completions logprobs
    lp_values: list[float | None] = field(default_factory=list)
    lp_top: list[dict | None] = field(default_factory=list)
    lp_items: list[dict] = field(default_factory=list)  # chat logprobs
    gen_logprobs: list[dict] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)
    base: int = 0  # len(ids) when the current attempt began: its spans start there
    attempts: int = 0
    down_cuts: int = 0  # attempts cut because their shard could not be reached
    last_down: str = ""
    index: int = 0  # the choice this is (a sample of an n > 1 request continued on its own)
    seeded: bool = False  # its first attempt was the whole request's: it only continues

    @classmethod
    def lane(cls, path: str, body: dict, wants_ids: bool, index: int) -> Attempts:
        """Sample `index` of an n > 1 request, as a request of its own (n = 1, seed + index)."""
        drop = ("n", "best_of")
        if path == GENERATE:
            sp = {k: v for k, v in body.get("sampling_params", {}).items() if k not in drop}
            if isinstance(sp.get("seed"), int):
                sp["seed"] += index
            lane_body = {**body, "sampling_params": sp}
        else:
            lane_body = {k: v for k, v in body.items() if k not in drop}
            if isinstance(lane_body.get("seed"), int):
                lane_body["seed"] += index
        return cls(path, lane_body, wants_ids, index=index, seeded=True)

    @property
    def fresh(self) -> bool:
        """The first attempt of a request of its own (nothing to join)."""
        return self.attempts == 1 and not self.seeded

    @property
    def chat_top(self) -> int:
        return (self.body.get("top_logprobs") or 0) if self.body.get("logprobs") else 0

    @property
    def max_tokens(self) -> int | None:
        if self.path == GENERATE:
            return self.body.get("sampling_params", {}).get("max_tokens", 16)
        if self.path == CHAT:
            mt = self.body.get("max_completion_tokens")
            return mt if mt is not None else self.body.get("max_tokens")
        return self.body.get("max_tokens", 16)

    @cached_property
    def tools(self) -> ToolChoice:
        """What a chat's `tools` and `tool_choice` ask of its answer (nothing for the other
        paths). Read once a shard took the request, so they were checked there."""
        if self.path != CHAT:
            return ToolChoice(False)
        try:
            return tool_choice_of(self.body.get("tools"), self.body.get("tool_choice"))
        except InvalidRequestError:  # the shard refused it: no answer is built from it
            return ToolChoice(False)

    @property
    def parallel_calls(self) -> bool:
        return self.body.get("parallel_tool_calls", True) is not False

    @property
    def holds_calls(self) -> bool:
        """A chat whose answer is parsed for tool calls: streamed, its text comes in one delta
        at the end (a call is known only once its block closes), as a shard streams it."""
        return self.path == CHAT and self.tools.parse

    @cached_property
    def _forced_call(self) -> dict:
        """A chat's forced tool call as /v1/completions takes it: the structural tag the chat
        endpoint compiles `tools` + `tool_choice` to (the same function, so the same grammar)."""
        constraint = forced_call_constraint(self.body["tools"], self.tools, self.parallel_calls)
        return {"structural_tag": constraint.spec}

    def _already_generated(self) -> int:
        """The prompt's tail of output (the caller's own count, if it sent one, plus ours)."""
        sent = self.body.get("already_generated")
        return len(self.ids) + (sent if isinstance(sent, int) and not isinstance(sent, bool) else 0)

    def upstream(self) -> tuple[str, dict]:
        """Path and body for the next attempt."""
        self.base = len(self.ids)
        if self.prompt_ids is None:  # nothing came back yet: send the request as it was
            if self.path == GENERATE:  # output ids always come back; the prompt is in the body
                return self.path, self.body
            return self.path, {**self.body, "return_token_ids": True}
        left = None if self.max_tokens is None else self.max_tokens - len(self.ids)
        already = self._already_generated()
        if self.path == GENERATE:
            sp = {**_min_left(self.body.get("sampling_params", {}), len(self.ids)), "max_tokens": left}
            body = {**self.body, "token_ids": self.prompt_ids + self.ids, "sampling_params": sp,
                    "return_token_ids": True}
            if already:
                body["already_generated"] = already
            return GENERATE, body
        keep = _min_left({k: v for k, v in self.body.items() if k in CONTINUED_FIELDS}, len(self.ids))
        if self.tools.forced is not None:  # overrides the other constraints, as on the chat endpoint
            keep.pop("response_format", None)
            keep["structured_outputs"] = self._forced_call
        body = {**keep, "prompt": self.prompt_ids + self.ids, "return_token_ids": True}
        if already:
            body["already_generated"] = already
        if left is not None:
            body["max_tokens"] = left
        if self.path == CHAT and self.body.get("logprobs"):
            body["logprobs"] = self.chat_top
        elif self.path == COMPLETIONS and self.body.get("logprobs") is not None:
            body["logprobs"] = self.body["logprobs"]
        return COMPLETIONS, body

    def see_prompt(self, resp: dict, choice: dict) -> None:
        if self.prompt_ids is None:
            pids = self.body.get("token_ids") if self.path == GENERATE else (
                resp.get("prompt_token_ids") or choice.get("prompt_token_ids"))
            if pids is not None:
                self.prompt_ids = list(pids)

    def add(self, path: str, choice: dict) -> None:
        """Take an attempt's output (whole or one chunk) into the running total."""
        self.ids.extend(choice.get("token_ids") or [])
        self.text += choice.get("text") or (choice.get("message") or {}).get("content") or \
            (choice.get("delta") or {}).get("content") or ""
        lp = choice.get("logprobs")
        if lp and path == COMPLETIONS and self.path == CHAT:  # a chat continued as a completion
            self.lp_items += chat_items(lp, self.chat_top)
        elif lp and path == COMPLETIONS:
            tokens = lp.get("tokens", [])
            self.lp_tokens += tokens
            self.lp_values += lp.get("token_logprobs", [])
            self.lp_top += lp.get("top_logprobs") or [None] * len(tokens)
        elif lp and path == CHAT:
            self.lp_items += lp.get("content") or []
        elif lp and path == GENERATE:
            self.gen_logprobs += lp.get("content") or []
        spans = choice.get("weight_versions")
        if spans:
            b = self.base
            self.spans += [{**s, "start": s["start"] + b, "end": s["end"] + b} for s in spans]

    def close_attempt_without_spans(self) -> None:
        """A generate stream died before its final chunk: its tokens' versions are unknown."""
        if self.path == GENERATE and len(self.ids) > self.base:
            covered = self.spans[-1]["end"] if self.spans else 0
            if covered < len(self.ids):
                self.spans.append({"version": "unknown", "start": covered, "end": len(self.ids)})

    def n_prompt(self) -> int:
        return len(self.prompt_ids or [])
