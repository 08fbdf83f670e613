"""Keys and values of finished sequences, kept so that a later prompt starting with the same
tokens prefills only what follows them.

Why: an agent's turn k+1 is turn k's prompt and answer plus a tool's output, so without this
every turn prefills the whole conversation again (on CPU, half of a shard's time in a multi-turn
run was prefill). The router sends an episode's turns to the same shard, where its last turn's
keys and values are still here.

An entry is a copy of a retired row's first `cached_len` positions (prompt and output but the
last sampled token, whose keys were never computed), all layers in one tensor, under the weight
version that computed it. A lookup returns the entry sharing the longest token prefix with the
prompt, capped so that at least one prompt token is still run (its logits give the first
sampled token). Entries of another weight version never match; the engine also clears the store
when weights change or the cache sleeps. A new entry replaces those whose tokens it extends
(the same keys, and more); the least recently used go first when the byte budget is exceeded.
Pure bookkeeping: the model runner copies rows in and out (`KeptRows`, every rank of a
tensor-parallel engine its own slice), and is told of every entry dropped (`on_drop`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: the engine's default budget for kept keys and values (on the engine's device; a sleep frees it)
DEFAULT_BUDGET_BYTES = 256 << 20
#: prompts are bucketed by their first tokens: a lookup compares only entries that share them
KEY_TOKENS = 8
#: shorter shared prefixes are recomputed: copying them in saves less than it costs
MIN_HIT_TOKENS = 16


class Kept(Protocol):
    """What an entry keeps: its keys and values as the runner copied them out."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]  # the tokens whose keys and values `kv` holds, in order
    kv: Kept  # [layers, 2, kv_heads, len(tokens), head_dim] (runner.KeptRows)
    version: int

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    length: int  # positions of the prompt whose keys and values come from `entry`


def shared_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    a, b = tuple(a), tuple(b)
    n, i, step = min(len(a), len(b)), 0, 64
    while i + step <= n and a[i: i + step] == b[i: i + step]:  # slices compare in C
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Entries by their first KEY_TOKENS tokens, least recently used first, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, min_hit_tokens: int = MIN_HIT_TOKENS,
                 on_drop: Callable[[Kept], None] | None = None) -> None:
        self.budget_bytes = budget_bytes
        #: told of each entry's keys and values as the entry goes (the runner forgets them)
        self.on_drop = on_drop
        self.min_hit_tokens = max(1, min_hit_tokens)
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # by id(entry), LRU order
        self._by_key: dict[tuple[int, ...], list[PrefixEntry]] = {}
        self.nbytes = 0
        self.hits = 0
        self.hit_tokens = 0
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix cache queries)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        if self.on_drop is not None:
            for entry in self._entries.values():
                self.on_drop(entry.kv)
        self._entries.clear()
        self._by_key.clear()
        self.nbytes = 0

    def match(self, prompt: list[int], version: int) -> PrefixHit | None:
        """The entry of weight `version` sharing the longest prefix with `prompt` (at most
        len(prompt) - 1 tokens, at least min_hit_tokens), or None."""
        best: PrefixHit | None = None
        wanted = tuple(prompt)
        self.queried_tokens += len(wanted)
        for entry in self._by_key.get(wanted[:KEY_TOKENS], ()):
            if entry.version != version:
                continue
            length = min(shared_length(entry.tokens, wanted), len(prompt) - 1)
            if length >= self.min_hit_tokens and (best is None or length > best.length):
                best = PrefixHit(entry, length)
        if best is not None:
            self._entries.move_to_end(id(best.entry))
            self.hits += 1
            self.hit_tokens += best.length
        return best

    def put(self, tokens: list[int], kv: Kept, version: int) -> None:
        """Keep `kv` (already a copy) for `tokens`; entries it extends go, then the oldest while
        over budget. An entry larger than the whole budget is not kept (dropped at once)."""
        entry = PrefixEntry(tuple(tokens), kv, version)
        if len(tokens) < self.min_hit_tokens or self.budget_bytes <= 0 or entry.nbytes > self.budget_bytes:
            if self.on_drop is not None:
                self.on_drop(kv)
            return
        key = entry.tokens[:KEY_TOKENS]
        for old in [e for e in self._by_key.get(key, ()) if e.version != version or
                    (len(e.tokens) <= len(entry.tokens) and entry.tokens[:len(e.tokens)] == e.tokens)]:
            self._drop(old)
        self._by_key.setdefault(key, []).append(entry)
        self._entries[id(entry)] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: PrefixEntry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        if self.on_drop is not None:
            self.on_drop(entry.kv)
        self.nbytes -= entry.nbytes
        key = entry.tokens[:KEY_TOKENS]
        bucket = self._by_key.get(key, [])
        bucket[:] = [e for e in bucket if e is not entry]
        if not bucket:
            self._by_key.pop(key, None)
