"""Replay buffer of whole GRPO groups tagged with their weight version, with the accounting
that proves nothing is lost: every trajectory started is trained on, dropped with a reason,
still buffered, or still in flight.

GRPO normalises rewards within a group, so a group is stored, aged and taken as one unit; its
age is that of its oldest token (`Group.version`).
"""

from __future__ import annotations

from collections import Counter, deque

from rlix.errors import AccountingError, RlixError
from rlix.pipeline.rollout.types import Group

__all__ = ["AccountingError", "ReplayBuffer"]

STALE = "stale"
UNUSED = "unused at shutdown"


class ReplayBuffer:
    """Plain (not thread-safe) buffer; the collector and the loop share one event loop."""

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()  # in arrival order; versions only ever age
        self._buffered = 0  # trajectories in _groups
        self.started = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self.closed = False

    def __len__(self) -> int:
        """Trajectories held (valid or not)."""
        return self._buffered

    @property
    def n_groups(self) -> int:
        return len(self._groups)

    @staticmethod
    def fresh(version: int, current_version: int, max_age: int) -> bool:
        """Can data of weight `version` still train the policy at `current_version`?"""
        return version >= current_version - max_age

    # ------------------------------------------------------------------ accounting inputs
    def note_started(self, k: int) -> None:
        self.started += int(k)

    def note_dropped(self, k: int, reason: str) -> None:
        if k:
            self.dropped[reason] += int(k)

    # ------------------------------------------------------------------ groups
    def put(self, group: Group) -> None:
        if not group.trajectories:
            raise RlixError(f"group {group.group_id} has no trajectories")
        if self.closed:  # a straggler after shutdown: account for it, keep nothing
            self.note_dropped(len(group), UNUSED)
            return
        self._groups.append(group)
        self._buffered += len(group)

    def valid_count(self, current_version: int, max_age: int) -> int:
        """Trajectories in groups young enough to train on at `current_version`."""
        return sum(len(g) for g in self._groups if self.fresh(g.version, current_version, max_age))

    def valid_groups(self, current_version: int, max_age: int) -> int:
        return sum(1 for g in self._groups if self.fresh(g.version, current_version, max_age))

    def drop_stale(self, current_version: int, max_age: int) -> int:
        """Drop (reason "stale") every group too old for `current_version`; returns trajectories."""
        keep = deque(g for g in self._groups if self.fresh(g.version, current_version, max_age))
        if len(keep) == len(self._groups):
            return 0
        kept = sum(len(g) for g in keep)
        gone = self._buffered - kept
        self._groups, self._buffered = keep, kept
        self.note_dropped(gone, STALE)
        return gone

    def take(self, n_groups: int, current_version: int, max_age: int) -> list[Group]:
        """The `n_groups` oldest valid groups (by version, then arrival), counted as trained.
        Stale groups are dropped first; asking for more than there are raises and takes none."""
        self.drop_stale(current_version, max_age)
        if n_groups > len(self._groups):
            raise RlixError(f"buffer holds {len(self._groups)} valid groups, {n_groups} asked for")
        order = sorted(range(len(self._groups)), key=lambda i: (self._groups[i].version, i))[:n_groups]
        out = [self._groups[i] for i in order]
        chosen = set(order)
        self._groups = deque(g for i, g in enumerate(self._groups) if i not in chosen)
        n = sum(len(g) for g in out)
        self._buffered -= n
        self.trained += n
        return out

    def close(self) -> None:
        """Shutdown: what is left will never be trained on; say so. Idempotent."""
        self.note_dropped(self._buffered, UNUSED)
        self._groups.clear()
        self._buffered = 0
        self.closed = True

    # ------------------------------------------------------------------ accounting outputs
    def accounting(self) -> dict:
        return {"started": self.started, "trained": self.trained, "dropped": dict(self.dropped),
                "buffered": self._buffered}

    def check_conservation(self, in_flight: int = 0) -> None:
        """Raise AccountingError unless started == trained + dropped + buffered + in flight."""
        accounted = self.trained + sum(self.dropped.values()) + self._buffered + in_flight
        if accounted != self.started:
            raise AccountingError(f"{self.started} trajectories started but {accounted} accounted for "
                                  f"({self.accounting()}, in flight {in_flight})")
