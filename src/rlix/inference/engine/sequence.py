"""One request's generation state, and the rules that end it (length, eos, stop ids, stop strings)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InferenceError
from rlix.inference.engine.api import Detokenizer, FinishReason, SamplingParams, TopLogprobs
from rlix.inference.engine.constrained import RowGrammar
from rlix.inference.engine.sampling import LogitShaping, RowSampling, new_rng

_arrival = itertools.count()


def first_stop(text: str, stop: tuple[str, ...], searched: int = 0) -> tuple[int, str | None]:
    """Where the stop string that ends first in `text` begins, and which one it is (-1, None:
    none); ties go to the first listed. Only matches ending past `searched` count (the text up
    to there was searched before, or may not end the output: min_tokens)."""
    best, where, end = None, -1, len(text) + 1
    for s in stop:
        i = text.find(s, max(0, searched - len(s) + 1))
        if i >= 0 and i + len(s) < end:
            best, where, end = s, i, i + len(s)
    return where, best


@dataclass
class Delta:
    """What one step added to a request; the async side folds deltas into GenerationOutputs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: BaseException | None = None
    first_token_at: float | None = None  # set on the delta that carries the first token
    index: int = 0  # the sample's index within its request (n > 1)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # in the first delta, when asked for
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass
class PromptGroup:
    """The n samples of one request: one prefill serves them all (the others copy its cache
    row and sample their first token from its logits)."""

    request_id: str
    members: list[Sequence] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. `sink` receives its Deltas (set by the engine's front end)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Any = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    index: int = 0  # within its group
    group: PromptGroup | None = None  # n > 1: the request's samples, sharing one prefill
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    #: deliver one delta, at the end (final_only callers): no per-step delta is cut
    fold: bool = False
    #: params.constraint's matcher where this output starts (at the grammar's start, or after a
    #: continuation's already generated tokens: the engine builds it at generate()); each sample
    #: forks its own from it
    grammar: RowGrammar | None = None
    #: time.monotonic() when it reached the engine, was admitted into the batch, got its first
    #: and its latest token (0.0: not yet); the engine's metrics (stats.py) read them
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    #: prompt tokens whose keys and values it did not compute: a prefix cache hit, or the whole
    #: prompt for a sample that copied its request's prefill (n > 1)
    cached_prompt_tokens: int = 0
    sampling: RowSampling = field(init=False)
    pending: Delta = field(init=False)
    _text_checked: int = 0  # length of the output text already searched for stop strings

    def __post_init__(self) -> None:
        p = self.params
        seed = p.seed + self.index if p.seed is not None else None
        shaping = None
        if p.shapes_logits:
            shaping = LogitShaping(p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                                   p.logit_bias, self.prompt_token_ids)
        self.sampling = RowSampling(p.temperature, p.top_k, p.top_p, new_rng(seed),
                                    p.top_logprobs, shaping,
                                    grammar=self.grammar.fork() if self.grammar is not None else None)
        self.pending = Delta(index=self.index)

    def hold_stops(self, eos_ids: frozenset[int]) -> None:
        """With min_tokens: mask the stop ids (end-of-sequence, whatever ignore_eos says, and
        stop_token_ids: vLLM's all_stop_token_ids) until that many tokens were generated."""
        p = self.params
        if p.min_tokens > len(self.output_ids):
            self.sampling.hold(tuple(sorted(eos_ids | set(p.stop_token_ids))))

    @property
    def group_id(self) -> str | None:
        return self.group.request_id if self.group is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_len(self) -> int:
        """Tokens whose keys/values are in the cache: all but the last sampled one."""
        return len(self.prompt_token_ids) + len(self.output_ids) - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def set_prompt_logprobs(self, logprobs: list[float | None], top: list[TopLogprobs]) -> None:
        """The prompt's logprobs, from the prefill; they go out with the first delta."""
        self.prompt_logprobs, self.prompt_top_logprobs = logprobs, top
        self.pending.prompt_logprobs, self.pending.prompt_top_logprobs = logprobs, top

    def append(self, token: int, logprob: float, version: int, eos_ids: frozenset[int],
               detokenizer: Detokenizer | None, top: TopLogprobs | None = None,
               now: float | None = None) -> None:
        """Record one sampled token (under weight `version`, read at time.monotonic() `now`: one
        clock reading serves a step's rows) and decide whether the request ends."""
        index = len(self.output_ids)
        if now is None:
            now = time.monotonic()
        if index == 0:
            self.pending.first_token_at = self.first_token_at = now
        self.last_token_at = now
        if not self.weight_versions or self.weight_versions[-1][1] != version:
            self.weight_versions.append((index, version))
            self.pending.weight_versions.append((index, version))
        self.output_ids.append(token)
        self.pending.token_ids.append(token)
        if self.params.logprobs:
            self.logprobs.append(logprob)
            self.pending.logprobs.append(logprob)
        if top is not None:
            self.pending.top_logprobs.append(top)
        if self.sampling.held is not None and len(self.output_ids) >= self.params.min_tokens:
            self.sampling.release()
        grammar = self.sampling.grammar
        if grammar is not None and not grammar.accept(token):  # sampled from its mask: never
            self.pending.error = InferenceError(f"request {self.request_id}: the grammar refused "
                                                f"sampled token {token}")
            self.finish("abort")
            return
        self._check_finish(token, eos_ids, detokenizer)

    def _check_finish(self, token: int, eos_ids: frozenset[int],
                      detokenizer: Detokenizer | None) -> None:
        p = self.params
        if token in p.stop_token_ids:
            self.finish("stop", token)
        elif not p.ignore_eos and token in eos_ids:
            self.finish("stop", None)
        elif self.sampling.grammar is not None and self.sampling.grammar.terminated:
            self.finish("stop", None)  # its end accepted (ignore_eos or not): nothing else may follow
        elif p.stop and detokenizer is not None and (hit := self._stop_string(detokenizer)):
            self.finish("stop", hit)
        elif len(self.output_ids) >= p.max_tokens:
            self.finish("length")

    def _stop_string(self, detokenizer: Detokenizer) -> str | None:
        """The stop string that the output text now contains, searching only new text: the
        one ending first (then the first listed), as vLLM picks it. With min_tokens, none before
        the output is longer than that, and a match must end past the text of those tokens."""
        p = self.params
        if len(self.output_ids) <= p.min_tokens:
            return None
        if p.min_tokens and len(self.output_ids) == p.min_tokens + 1:
            self._text_checked = len(detokenizer.decode(self.output_ids[:p.min_tokens],
                                                        skip_special_tokens=True))
        text = detokenizer.decode(self.output_ids, skip_special_tokens=True)
        checked, self._text_checked = self._text_checked, len(text)
        return first_stop(text, p.stop, checked)[1]

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.pending.finish_reason = reason
            self.pending.stop_reason = stop_reason

    def take_delta(self) -> Delta | None:
        """The changes since the last call, or None if nothing changed (for a folding sequence:
        None until it has finished, then everything at once)."""
        delta = self.pending
        if self.fold and delta.finish_reason is None and delta.error is None:
            return None
        if not (delta.token_ids or delta.finish_reason or delta.error or delta.weight_versions):
            return None
        self.pending = Delta(index=self.index)
        return delta
