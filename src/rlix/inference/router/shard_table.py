"""The router's view of a pipeline's shards: state, load, and which shard takes a request.

Pure bookkeeping (no I/O) so the routing rules are unit-tested without servers:
session-sticky requests go by consistent hashing over the ACTIVE shards (a shard joining or
leaving moves only the sessions that hashed to it); the rest go to the active shard with the
fewest outstanding requests. Requests wait here while no shard is active.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
from dataclasses import dataclass
from enum import Enum

from rlix.errors import InvalidRequestError, NoActiveShardError


class ShardState(str, Enum):
    """ACTIVE takes new requests; INACTIVE finishes what it has (no new ones); PREEMPTED is being
    taken away: its aborts and connection errors are re-dispatched elsewhere. DOWN: the router
    could not reach it (connection refused or lost): no requests until it answers /health again
    (it goes back to the state it had) or the fleet sets it anew (a replacement)."""

    ACTIVE = "active"
    INACTIVE = "inactive"
    PREEMPTED = "preempted"
    DOWN = "down"


@dataclass
class Shard:
    rank: int
    url: str
    state: ShardState = ShardState.INACTIVE
    outstanding: int = 0
    served: int = 0
    down_from: ShardState | None = None  # the state a DOWN shard returns to when it answers
    down_reason: str = ""

    def view(self) -> dict:
        out = {"rank": self.rank, "url": self.url, "state": self.state.value,
               "outstanding": self.outstanding, "served": self.served}
        if self.state is ShardState.DOWN:
            out["down_reason"] = self.down_reason
        return out


def _parse_state(state: ShardState | str) -> ShardState:
    try:
        return ShardState(state)
    except ValueError:
        raise InvalidRequestError(
            f"unknown shard state {state!r}; one of: active, inactive, preempted, down") from None


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes; rebuilt only when the active set changes."""

    def __init__(self, ranks: list[int], vnodes: int = 64) -> None:
        points = sorted((_hash(f"shard-{rank}-{i}"), rank) for rank in ranks for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._ranks = [r for _, r in points]

    def lookup(self, key: str, exclude: frozenset[int] = frozenset()) -> int | None:
        """The first rank clockwise of `key` that is not excluded."""
        if not self._keys:
            return None
        start = bisect.bisect(self._keys, _hash(key))
        n = len(self._keys)
        for i in range(n):
            rank = self._ranks[(start + i) % n]
            if rank not in exclude:
                return rank
        return None


class ShardTable:
    """Shards by DP rank. Must be used from one event loop (no locks: no awaits mid-change),
    except `flip`, which another thread may call (see there)."""

    def __init__(self, vnodes: int = 64) -> None:
        self.shards: dict[int, Shard] = {}
        self._vnodes = vnodes
        self._ring = HashRing([], vnodes)
        self._changed = asyncio.Event()
        self.closed = False

    # ------------------------------------------------------------ admin
    def set(self, rank: int, url: str | None = None, state: ShardState | str | None = None) -> Shard:
        """Add or update a shard; a new shard needs a url."""
        shard = self.shards.get(rank)
        if shard is None:
            if not url:
                raise InvalidRequestError(f"shard {rank} is unknown; give its url to add it")
            shard = self.shards[rank] = Shard(rank, url.rstrip("/"))
        elif url:
            shard.url = url.rstrip("/")
        if state is not None:
            shard.state = _parse_state(state)
            shard.down_from = None
        self._rebuild()
        return shard

    def mark_down(self, rank: int, reason: str) -> bool:
        """The router could not reach this shard: no requests go there until it is back. False
        if it was not routable anyway (preempted: its connection errors are preemption cuts)."""
        shard = self.shards.get(rank)
        if shard is None or shard.state in (ShardState.PREEMPTED, ShardState.DOWN):
            return False
        shard.down_from, shard.down_reason = shard.state, reason[:200]
        shard.state = ShardState.DOWN
        self._rebuild()
        return True

    def revive(self, rank: int, url: str) -> bool:
        """A DOWN shard at `url` answered again: back to the state it had."""
        shard = self.shards.get(rank)
        if shard is None or shard.state is not ShardState.DOWN or shard.url != url:
            return False
        shard.state, shard.down_from = shard.down_from or ShardState.INACTIVE, None
        self._rebuild()
        return True

    def down(self) -> list[Shard]:
        return [s for s in self.shards.values() if s.state is ShardState.DOWN]

    def flip(self, rank: int, state: ShardState | str) -> Shard:
        """Change a known shard's state without waking waiters; `notify()` on the table's loop
        must follow. Safe from another thread: one attribute write and one reference swap
        (the hash ring), each atomic, and no change to the dict that `pick` iterates. A request
        picked during the flip may still reach the shard: a preempted shard's aborts are
        re-dispatched, so that costs a retry, not the request."""
        shard = self.shards.get(rank)
        if shard is None:
            raise InvalidRequestError(f"shard {rank} is unknown; give its url to add it")
        shard.state = _parse_state(state)
        self._ring = HashRing(self.active_ranks(), self._vnodes)
        return shard

    def notify(self) -> None:
        """Wake requests held for an active shard (on the table's loop)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def remove(self, rank: int) -> None:
        self.shards.pop(rank, None)
        self._rebuild()

    def _rebuild(self) -> None:
        self._ring = HashRing(self.active_ranks(), self._vnodes)
        self.notify()

    def active_ranks(self) -> list[int]:
        return sorted(r for r, s in self.shards.items() if s.state is ShardState.ACTIVE)

    def is_preempted(self, rank: int) -> bool:
        shard = self.shards.get(rank)
        return shard is None or shard.state is ShardState.PREEMPTED

    # ------------------------------------------------------------ routing
    def pick(self, session_id: str | None, exclude: frozenset[int] = frozenset()) -> Shard | None:
        """The shard for one request now, or None if no active shard is left after `exclude`."""
        if session_id:
            rank = self._ring.lookup(session_id, exclude)
            return None if rank is None else self.shards[rank]
        best: Shard | None = None
        for rank in self.active_ranks():
            shard = self.shards[rank]
            if rank not in exclude and (best is None or shard.outstanding < best.outstanding):
                best = shard
        return best

    async def acquire(self, session_id: str | None, timeout_s: float,
                      exclude: frozenset[int] = frozenset()) -> Shard:
        """Pick a shard and count the request on it, holding the caller while none is active.

        `exclude` (shards that just failed this request) is dropped when only they are active,
        so a lone shard that was restarted is not refused forever.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.closed:
                raise NoActiveShardError("the router is shutting down")
            shard = self.pick(session_id, exclude) or (self.pick(session_id) if exclude else None)
            if shard is not None:
                shard.outstanding += 1
                return shard
            left = deadline - loop.time()
            if left <= 0:
                down = "; ".join(f"shard {s.rank} down ({s.down_reason})" for s in self.down())
                raise NoActiveShardError(f"no active shard within {timeout_s:g} s"
                                         + (f"; {down}" if down else ""))
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass

    def close(self) -> None:
        """Refuse new requests and release every held one (they get NoActiveShardError)."""
        self.closed = True
        self._changed.set()

    def release(self, shard: Shard, completed: bool) -> None:
        shard.outstanding = max(0, shard.outstanding - 1)
        if completed:
            shard.served += 1

    def view(self) -> list[dict]:
        return [self.shards[r].view() for r in sorted(self.shards)]
