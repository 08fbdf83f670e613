"""One request's generation state, and the rules that end it (length, eos, stop ids, stop strings)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from rlix.inference.engine.api import Detokenizer, FinishReason, SamplingParams
from rlix.inference.engine.sampling import RowSampling, new_rng

_arrival = itertools.count()


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
    sampling: RowSampling = field(init=False)
    pending: Delta = field(default_factory=Delta)
    _text_checked: int = 0  # length of the output text already searched for stop strings

    def __post_init__(self) -> None:
        p = self.params
        self.sampling = RowSampling(p.temperature, p.top_k, p.top_p, new_rng(p.seed))

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

    def append(self, token: int, logprob: float, version: int, eos_ids: frozenset[int],
               detokenizer: Detokenizer | None) -> None:
        """Record one sampled token (under weight `version`) and decide whether the request ends."""
        index = len(self.output_ids)
        if index == 0:
            self.pending.first_token_at = time.monotonic()
        if not self.weight_versions or self.weight_versions[-1][1] != version:
            self.weight_versions.append((index, version))
            self.pending.weight_versions.append((index, version))
        self.output_ids.append(token)
        self.pending.token_ids.append(token)
        if self.params.logprobs:
            self.logprobs.append(logprob)
            self.pending.logprobs.append(logprob)
        self._check_finish(token, eos_ids, detokenizer)

    def _check_finish(self, token: int, eos_ids: frozenset[int],
                      detokenizer: Detokenizer | None) -> None:
        p = self.params
        if token in p.stop_token_ids:
            self.finish("stop", token)
        elif not p.ignore_eos and token in eos_ids:
            self.finish("stop", None)
        elif p.stop and detokenizer is not None and (hit := self._stop_string(detokenizer)):
            self.finish("stop", hit)
        elif len(self.output_ids) >= p.max_tokens:
            self.finish("length")

    def _stop_string(self, detokenizer: Detokenizer) -> str | None:
        """The first stop string that the output text now contains (searching only new text)."""
        text = detokenizer.decode(self.output_ids, skip_special_tokens=True)
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self._text_checked - longest + 1)
        self._text_checked = len(text)
        found = [(text.find(s, start), s) for s in self.params.stop]
        found = [(i, s) for i, s in found if i >= 0]
        return min(found)[1] if found else None

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.pending.finish_reason = reason
            self.pending.stop_reason = stop_reason

    def take_delta(self) -> Delta | None:
        """The changes since the last call, or None if nothing changed."""
        delta = self.pending
        if not (delta.token_ids or delta.finish_reason or delta.error or delta.weight_versions):
            return None
        self.pending = Delta()
        return delta
