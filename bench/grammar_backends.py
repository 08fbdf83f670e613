"""Which constrained-decoding library the engine uses: mask time per token, measured.

The engine computes one allowed-token bitmask per step for every constrained row, on the host,
between two forwards: that time is added to each step the row is in. This script runs the same
JSON-schema constraint (a tool call's arguments: strings, numbers, an enum, an array) through
xgrammar, llguidance and outlines-core over the same tokenizer, walking one valid answer token
by token, and reports per library: the compile time (schema -> grammar over the vocabulary,
once per distinct schema), the mean time to fill one row's bitmask, and the time to advance the
matcher by the sampled token. A library that is not installed is skipped (only the engine's
choice is a dependency of rlix).

The default tokenizer is the `tiny` preset's (384 tokens), built in a temporary folder;
`--model PATH` takes any local Hugging Face tokenizer (a real 150k vocabulary scales the mask
times, not the compile of a schema, which grows with the vocabulary for the DFA-based one).

    .venv/bin/python bench/grammar_backends.py [--model PATH] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1},
        "units": {"enum": ["metric", "imperial"]},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "units", "fields"],
    "additionalProperties": False,
}
ANSWER = '{"city": "Paris", "days": 3, "units": "metric", "fields": ["temperature", "rain"]}'


def _xgrammar(tok, vocab: int) -> tuple[float, Callable[[], object], Callable[[object], None], Callable[[object, int], None]]:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    assert isinstance(bitmask, torch.Tensor)
    return (compile_s, lambda: xgr.GrammarMatcher(compiled),
            lambda m: m.fill_next_token_bitmask(bitmask),  # type: ignore[attr-defined]
            lambda m, t: m.accept_token(t))  # type: ignore[attr-defined]


def _llguidance(tok, vocab: int):  # type: ignore[no-untyped-def]
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(lltok, grammar)  # the first matcher compiles the grammar lazily
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    return (compile_s, lambda: llguidance.LLMatcher(lltok, grammar),
            lambda m: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0),
            lambda m, t: m.consume_token(t))


def _outlines(tok, vocab: int):  # type: ignore[no-untyped-def]
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    eos = tok.eos_token_id
    byte_of = {v: k for k, v in _bytes_to_unicode().items()}
    tokens: dict[str, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i == eos or text in tok.all_special_tokens:
            continue
        raw = bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()
        tokens.setdefault(raw.decode("latin-1"), []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, tokens))
    compile_s = time.perf_counter() - t0
    bitmask = allocate_token_bitmask(vocab)
    return (compile_s, lambda: Guide(index), lambda g: fill_next_token_bitmask(g, bitmask),
            lambda g, t: g.advance(t))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (byte-level BPE token strings)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BACKENDS = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines}


def measure(name: str, tok, vocab: int, ids: list[int], repeat: int) -> dict | None:  # type: ignore[no-untyped-def]
    try:
        compile_s, new, fill, advance = BACKENDS[name](tok, vocab)
    except ImportError as exc:
        return {"backend": name, "skipped": f"not installed ({exc.name})"}
    fills, advances = [], []
    for _ in range(repeat):
        matcher = new()
        for t in ids:
            t0 = time.perf_counter()
            fill(matcher)
            t1 = time.perf_counter()
            advance(matcher, t)
            fills.append(t1 - t0)
            advances.append(time.perf_counter() - t1)
    return {"backend": name, "compile_ms": round(compile_s * 1e3, 2),
            "mask_us_per_token": round(statistics.mean(fills) * 1e6, 1),
            "mask_us_p99": round(sorted(fills)[int(len(fills) * 0.99)] * 1e6, 1),
            "advance_us_per_token": round(statistics.mean(advances) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Hugging Face model or tokenizer folder (default: the tiny preset)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer  # deferred: --help stays fast

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from rlix.models.presets import build_preset  # deferred: only for the default tokenizer

            path = build_preset("tiny", Path(tmp) / "tiny")
        tok = AutoTokenizer.from_pretrained(path)
        try:
            vocab = int(AutoConfig.from_pretrained(path).vocab_size)
        except (OSError, ValueError):
            vocab = len(tok)
        ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
        results = [measure(name, tok, vocab, ids, args.repeat) for name in BACKENDS]
    for r in results:
        print(json.dumps(r))
    print(json.dumps({"vocab": vocab, "answer_tokens": len(ids),
                      **{r["backend"]: r.get("mask_us_per_token") for r in results if r}}))


if __name__ == "__main__":
    main()
