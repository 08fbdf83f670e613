"""Detokenising a sample as it grows: text deltas that never split a character or a stop string."""

from __future__ import annotations

from typing import Any

from rlix.inference.engine.sequence import first_stop


class TextStream:
    """Cumulative token ids -> text deltas. Holds back a trailing partial UTF-8 character and
    the tail that could still grow into a stop string; cuts the text at the stop string that
    ends first, as vLLM's detokenizer does: before it, or after it with `include_stop` (vLLM's
    include_stop_str_in_output, which also holds nothing back: the string is sent either way).
    With `min_tokens` no stop string counts before the output is longer than that, nor one
    ending in the text of those first tokens (vLLM's rule)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), prefix: list[int] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.hold = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.stopped: str | None = None
        self._floor: int | None = None  # text length of the first min_tokens tokens
        # The prompt's last tokens are decoded with the output so that a character whose
        # bytes started in the prompt (a request re-dispatched with its accumulated tokens)
        # comes out whole; a prefix ending mid-character counts from where that character starts.
        self.prefix = list(prefix)
        self.skip = len(self._decode([]).rstrip("\ufffd"))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tok.decode(self.prefix + token_ids, skip_special_tokens=self.skip_special)

    def update(self, token_ids: list[int], final: bool, cut: bool = False, drop_last: bool = False) -> str:
        """`cut`: the request ended early (aborted); like any end, a trailing partial character
        is left out rather than sent as U+FFFD (whoever continues the request completes it).
        `drop_last`: the last token ended the output (end-of-sequence or a stop token id) and
        its text is left out, as vLLM leaves it out unless include_stop_str_in_output."""
        text_ids = token_ids[:-1] if drop_last else token_ids
        full = self._decode(text_ids)[self.skip:]
        if self.stop and len(token_ids) > self.min_tokens:
            if self._floor is None:
                self._floor = (len(self._decode(token_ids[:self.min_tokens])[self.skip:])
                               if self.min_tokens else 0)
            pos, hit = first_stop(full, self.stop, self._floor)
            if hit is not None:
                self.stopped = hit
                full, final = full[:pos + len(hit) if self.include_stop else pos], True
        safe = len(full) if final else len(full) - self.hold
        # a trailing partial character is held back, the final text's too (vLLM's detokenizer
        # never sends the U+FFFD of an incomplete character; a cut request's continuation, or
        # nothing, completes it). Text cut at a stop string is not at the end of the decode: a
        # U+FFFD there stands for bytes the next ones did not complete, and stays.
        while self.stopped is None and safe > 0 and full[safe - 1] == "\ufffd":
            safe -= 1
        delta = full[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta
