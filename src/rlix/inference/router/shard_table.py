"""The router's view of a pipeline's shards: state, load, and which shard takes a request.

Pure bookkeeping (no I/O) so the routing rules are unit-tested without servers:
a request goes to the ACTIVE shard with the fewest outstanding requests; a request of a session
(a group's samples, an agent's turns: they share a prompt prefix the shard has cached) goes where
its session went first, as long as that shard is active. A new session is placed by load, not by
a hash of its id: a shard that was just woken takes the new sessions until it is as busy as the
others (hashing sent it only its share, and the busy shards queued the rest), and a shard leaving
moves only its own sessions, each to the least loaded shard. Requests wait here while no shard
is active.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
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


#: sessions remembered, least recently used forgotten first (a forgotten one is placed anew)
MAX_SESSIONS = 1 << 16


class Sessions:
    """Session id -> the rank it was placed on, with how many live sessions each rank holds (the
    tie-break between shards equally loaded: new sessions spread instead of piling onto one)."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self._rank: OrderedDict[str, int] = OrderedDict()
        self.count: dict[int, int] = {}

    def get(self, session_id: str) -> int | None:
        rank = self._rank.get(session_id)
        if rank is not None:
            self._rank.move_to_end(session_id)
        return rank

    def place(self, session_id: str, rank: int) -> None:
        old = self._rank.pop(session_id, None)
        if old is not None:
            self.count[old] -= 1
        self._rank[session_id] = rank
        self.count[rank] = self.count.get(rank, 0) + 1
        while len(self._rank) > self.limit:
            _, gone = self._rank.popitem(last=False)
            self.count[gone] -= 1


class ShardTable:
    """Shards by DP rank. Must be used from one event loop (no locks: no awaits mid-change),
    except `flip`, which another thread may call (see there)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.shards: dict[int, Shard] = {}
        self.sessions = Sessions(max_sessions)
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
        must follow. Safe from another thread: one attribute write (atomic), and no change to the
        dict that `pick` iterates. A request
        picked during the flip may still reach the shard: a preempted shard's aborts are
        re-dispatched, so that costs a retry, not the request."""
        shard = self.shards.get(rank)
        if shard is None:
            raise InvalidRequestError(f"shard {rank} is unknown; give its url to add it")
        shard.state = _parse_state(state)
        return shard

    def notify(self) -> None:
        """Wake requests held for an active shard (on the table's loop)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def remove(self, rank: int) -> None:
        self.shards.pop(rank, None)
        self._rebuild()

    def _rebuild(self) -> None:
        self.notify()

    def active_ranks(self) -> list[int]:
        return sorted(r for r, s in self.shards.items() if s.state is ShardState.ACTIVE)

    def is_preempted(self, rank: int) -> bool:
        shard = self.shards.get(rank)
        return shard is None or shard.state is ShardState.PREEMPTED

    # ------------------------------------------------------------ routing
    def pick(self, session_id: str | None, exclude: frozenset[int] = frozenset()) -> Shard | None:
        """The shard for one request now, or None if no active shard is left after `exclude`:
        its session's shard while that is active and not excluded, else the least loaded (fewest
        outstanding requests, then fewest sessions, then the lowest rank), where its session
        then stays."""
        if session_id:
            rank = self.sessions.get(session_id)
            shard = self.shards.get(rank) if rank is not None else None
            if shard is not None and shard.state is ShardState.ACTIVE and rank not in exclude:
                return shard
        best: Shard | None = None
        best_key: tuple[int, int, int] | None = None
        for rank in self.active_ranks():
            if rank in exclude:
                continue
            shard = self.shards[rank]
            key = (shard.outstanding, self.sessions.count.get(rank, 0), rank)
            if best_key is None or key < best_key:
                best, best_key = shard, key
        if best is not None and session_id:
            self.sessions.place(session_id, best.rank)
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
