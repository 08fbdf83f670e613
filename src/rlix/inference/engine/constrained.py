"""Constrained decoding: an `OutputConstraint` compiled to a grammar over the engine's vocabulary,
and each constrained row's matcher, which masks the row's logits before every pick.

The library is xgrammar (docs/INFERENCE_SERVING.md, "Structured outputs", has the measured
comparison with llguidance and outlines-core: bench/grammar_backends.py). It compiles JSON
schemas, regexes, EBNF grammars and structural tags (the forced tool calls' format) into a
pushdown automaton whose token masks are mostly precomputed per grammar state, so filling one
row's bitmask costs about a microsecond on the `tiny` vocabulary and tens of microseconds on a
150k one; it is vLLM's default backend too, so what compiles here compiles there.

Costs land only on constrained rows: a row without a constraint has no matcher and stays plain
(sampled inside the decode CUDA graph); a batch with a constrained row samples on the host, as
it does for any shaped row (sampling.py), and pays one bitmask fill per constrained row, one
host-to-device copy of those rows' bitmasks and one masking kernel per step.

xgrammar is imported on the first constrained request (it takes ~0.6 s to import, and most
engines never see such a request): `GrammarCompiler` is built with the engine, its tokenizer
tables at first use, then kept. Compiled grammars are cached by constraint (a bounded LRU), so
the 50 requests of one schema compile it once.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import OutputConstraint

if TYPE_CHECKING:
    import xgrammar

#: most whitespace characters in a row between two JSON tokens. vLLM leaves runs unbounded;
#: a model unsure of what comes next (a small or random one above all) then spends its
#: max_tokens on spaces and newlines, and the cut output is no JSON at all. 24 still allows
#: pretty-printing 5 levels deep at an indent of 4.
MAX_JSON_WHITESPACE = 24
#: compiled grammars kept (each holds its token-mask tables: a few KB to a few MB)
CACHE_ENTRIES = 64

# xgrammar's errors start with a timestamp and a C++ source location: not for the client
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def _import_xgrammar() -> Any:
    import xgrammar  # deferred: ~0.6 s to import, paid by the first constrained request only

    return xgrammar


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each an EBNF string literal)."""
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '\\"':
                out.append("\\" + ch)
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\r":
                out.append("\\r")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class CompiledConstraint:
    """A constraint compiled for one vocabulary: what each constrained row's matcher starts from."""

    def __init__(self, constraint: OutputConstraint, compiled: xgrammar.CompiledGrammar) -> None:
        self.constraint = constraint
        self.compiled = compiled


class GrammarCompiler:
    """Compiles `OutputConstraint`s for one tokenizer and logits width, with a bounded cache.

    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's vocabulary
    (padded embeddings): the ids past the tokenizer are never allowed. `stop_ids` are the
    end-of-sequence ids a complete grammar allows (the engine's). Thread-safe: requests compile
    on the caller's event loop, matchers run on the engine's worker thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int],
                 cache_entries: int = CACHE_ENTRIES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self._stop_ids = sorted(set(stop_ids))
        self._cache_entries = cache_entries
        self._cache: OrderedDict[OutputConstraint, CompiledConstraint] = OrderedDict()
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _import_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_ids or None)
            # its own cache off: ours is keyed by the whole constraint and bounded by count
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, constraint: OutputConstraint) -> CompiledConstraint:
        """The compiled grammar, or InvalidRequestError naming `constraint.param` when the schema,
        regex or grammar is not one (the request is refused before any generation)."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
            compiler = self._xgr_compiler()
        try:
            compiled = CompiledConstraint(constraint, self._compile(compiler, constraint))
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choices", "grammar": "grammar",
                    "structural_tag": "structural tag"}[constraint.kind]
            message = _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
            raise InvalidRequestError(f"{constraint.param}: this {what} cannot be compiled: {message}",
                                      param=constraint.param) from None
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: Any, c: OutputConstraint) -> Any:
        separators = None if c.any_whitespace else (",", ":")
        if c.kind == "json":
            return compiler.compile_json_schema(c.spec, any_whitespace=c.any_whitespace,
                                                separators=separators,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if c.kind == "json_object":  # any object: no schema, so no strict mode's closed objects
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=c.any_whitespace,
                                                separators=separators, strict_mode=False,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if c.kind == "regex":
            if "\x00" in c.spec:  # xgrammar's regex parser reads a C string
                raise ValueError("a regex must not contain NUL")
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            if not c.choices:
                raise ValueError("at least one choice is needed")
            return compiler.compile_grammar(choice_grammar(c.choices))
        if c.kind == "grammar":
            return compiler.compile_grammar(c.spec)
        if c.kind == "structural_tag":
            return compiler.compile_structural_tag(c.spec)
        raise ValueError(f"unknown constraint kind {c.kind!r}")


class RowGrammar:
    """One constrained row's matcher (its grammar state after the tokens it has sampled).

    Owned by the row's RowSampling: `sample` asks it for the row's bitmask, the sequence
    feeds it every token the row keeps (`accept`), in order, exactly once."""

    def __init__(self, compiled: CompiledConstraint, matcher: Any = None) -> None:
        self._xgr = _import_xgrammar()
        self.matcher = self._xgr.GrammarMatcher(compiled.compiled) if matcher is None else matcher
        self.compiled = compiled
        self.vocab_size = compiled.compiled.tokenizer_info.vocab_size

    def fork(self) -> RowGrammar:
        """An independent matcher in this one's state: the n samples of a continued request
        each start where the tokens already generated left the grammar."""
        return RowGrammar(self.compiled, self.matcher.fork())

    def advance(self, tokens: list[int]) -> int:
        """Accept `tokens` in order (output an earlier attempt generated under this grammar);
        how many were accepted: len(tokens) unless the grammar refused one (which it then
        did not take: the matcher stays after the last accepted token)."""
        for i, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                return i
        return len(tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this row's allowed tokens into bitmask[row] (a CPU int32 bitmask)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end (an end-of-sequence token) was accepted."""
        return bool(self.matcher.is_terminated())


def grammar_after(compiled: CompiledConstraint, generated: list[int], param: str) -> RowGrammar:
    """A matcher advanced through `generated`: the tokens a re-dispatched request already
    generated under this constraint elsewhere (the router sends them as the prompt's tail and
    says how many). Its next mask is then the one an uninterrupted generation would have had,
    so the continued output plus what came before is one the grammar allows. Tokens it refuses
    did not come from a matcher of this grammar and tokenizer (tampering, or another model):
    InvalidRequestError naming `param`, before any work."""
    grammar = RowGrammar(compiled)
    taken = grammar.advance(generated)
    if taken < len(generated):
        raise InvalidRequestError(f"{param}: the constraint does not allow the already generated tokens "
                                  f"(token {taken} of {len(generated)}, id {generated[taken]}, is refused "
                                  f"after the {taken} before it)", param=param)
    if grammar.terminated:
        raise InvalidRequestError(f"{param}: the already generated tokens end the constraint's output "
                                  f"(nothing is left to generate)", param=param)
    return grammar


def apply_grammars(logits: torch.Tensor, rows: list[int], grammars: list[RowGrammar]) -> None:
    """Set every token that row rows[j]'s grammar forbids to -inf in logits [B, V], in place:
    one bitmask fill per row (host), one copy of those rows' bitmasks to the logits' device and
    one masking kernel. Logits wider than the grammar's vocabulary (padding) are masked past it."""
    xgr = grammars[0]._xgr
    vocab = grammars[0].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, grammar in enumerate(grammars):
        grammar.fill(bitmask, j)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    width = logits.shape[-1]
    if len(rows) == logits.shape[0]:
        target = logits
    elif len(rows) == 1:
        target = logits[rows[0]: rows[0] + 1]  # a view: masked in place
    else:
        index = torch.tensor(rows, device=logits.device)
        target = logits.index_select(0, index)
    if width > vocab:
        target[:, vocab:] = float("-inf")
    xgr.apply_token_bitmask_inplace(target, bitmask, vocab_size=min(width, vocab))
    if len(rows) not in (1, logits.shape[0]):
        logits.index_copy_(0, index, target)
