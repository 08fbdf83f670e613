"""Detokenising a sample as it grows: text deltas that never split a character or a stop string."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Cumulative token ids -> text deltas. Holds back a trailing partial UTF-8 character and
    the tail that could still grow into a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), prefix: list[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.stopped: str | None = None
        # The prompt's last tokens are decoded with the output so that a character whose
        # bytes started in the prompt (a request re-dispatched with its accumulated tokens)
        # comes out whole; a prefix ending mid-character counts from where that character starts.
        self.prefix = list(prefix)
        self.skip = len(tokenizer.decode(self.prefix, skip_special_tokens=skip_special_tokens).rstrip("\ufffd"))

    def update(self, token_ids: list[int], final: bool, cut: bool = False) -> str:
        """`cut`: the request ended early (aborted), so a trailing partial character is dropped
        rather than sent as U+FFFD: whoever continues the request will complete it."""
        full = self.tok.decode(self.prefix + token_ids, skip_special_tokens=self.skip_special)[self.skip:]
        if self.stop:
            hits = [(full.find(s), s) for s in self.stop if s in full]
            if hits:
                pos, self.stopped = min(hits)
                full, final = full[:pos], True
        safe = len(full) if final else len(full) - self.hold
        if not final or cut:
            while safe > 0 and full[safe - 1] == "\ufffd":
                safe -= 1
        delta = full[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta
