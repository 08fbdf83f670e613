"""A token's text in logprobs (`logprobs.content[].token`, its `bytes`, `top_logprobs`,
completions' `tokens`), as vLLM 0.32 writes it, so that clients comparing the two servers (or
keying on token strings) see the same strings.

Two rules differ from decoding a token alone:

- A byte-fallback or byte-level token holding part of a multi-byte UTF-8 character decodes alone
  to U+FFFD. Its text is then what it completes, read against the tokens sampled just before it
  (at most 4, the longest UTF-8 sequence): the first context of 1, 2, 3 or 4 preceding tokens
  with which it decodes to whole characters gives the text it adds, that of the context's own
  incomplete tokens included (they themselves showed ""), and "" when no context completes it
  (the character is still open, or it starts one). An alternative in `top_logprobs` is read
  against the same sampled tokens: it would have followed them. A prompt token (echo, prompt
  logprobs) is read against the prompt tokens before it that have logprobs (all but the first).
- A SentencePiece tokenizer (a Metaspace pre-tokenizer: Llama, Mistral) drops a piece's leading
  space marker when it decodes it alone; the piece's text gets those spaces back.

Texts of single tokens are cached by id (one decode per vocabulary entry seen); the context
reading costs a few decodes, for U+FFFD tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
#: preceding tokens that may hold the start of a token's character (UTF-8: 4 bytes at most)
MAX_CONTEXT = 4


def space_marker(tokenizer: Any) -> str | None:
    """The leading-space marker of a Metaspace pre-tokenizer (alone, or in a sequence of
    pre-tokenizers), or None where decoding a token alone keeps its spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    parts = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    for part in parts:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


class TokenTexts:
    """See module doc; one per tokenizer (the server's), used on its event loop only."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.marker = space_marker(tokenizer)
        self._alone: dict[int, str] = {}

    def alone(self, token: int) -> str:
        """The token decoded by itself, its leading spaces kept (module doc)."""
        text = self._alone.get(token)
        if text is None:
            text = self.tok.decode([token])
            if self.marker is not None:
                piece = self.tok.convert_ids_to_tokens(token) or ""
                markers = len(piece) - len(piece.lstrip(self.marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                if missing > 0:
                    text = " " * missing + text
            self._alone[token] = text
        return text

    def at(self, token: int, before: Sequence[int]) -> str:
        """The text of `token` following the sampled (or prompt) tokens `before`."""
        text = self.alone(token)
        if not text.endswith(REPLACEMENT):
            return text
        context = list(before[-MAX_CONTEXT:])
        for k in range(1, len(context) + 1):
            window = context[-k:]
            whole = self.tok.decode([*window, token])
            if whole.endswith(REPLACEMENT):
                continue
            # the window's trailing tokens that were incomplete alone belong to this character
            clean = len(window)
            while clean and self.alone(window[clean - 1]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.tok.decode(window[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            same = 0  # a normalising tokenizer may render the prefix differently inside `whole`
            while same < min(len(prefix), len(whole)) and prefix[same] == whole[same]:
                same += 1
            return whole[same:]
        return ""
