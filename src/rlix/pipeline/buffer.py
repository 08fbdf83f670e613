"""Replay buffer of whole GRPO groups tagged with their weight version, with the accounting
that proves nothing is lost: every trajectory started is trained on, dropped with a reason,
still buffered, or still in flight."""

from __future__ import annotations

from collections import Counter, deque

from rlix.errors import RlixError
from rlix.pipeline.types import Group


class AccountingError(RlixError):
    """Trajectories went missing: started != trained + dropped + buffered + in flight."""


class ReplayBuffer:
    def __init__(self) -> None:
        self._groups: deque[Group] = deque()  # oldest first
        self.started = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups)

    @staticmethod
    def _fresh(group: Group, current_version: int, max_age: int) -> bool:
        return group.version >= current_version - max_age

    def note_started(self, k: int) -> None:
        self.started += k

    def note_dropped(self, k: int, reason: str) -> None:
        self.dropped[reason] += k

    def put(self, group: Group) -> None:
        self._groups.append(group)

    def valid_count(self, current_version: int, max_age: int) -> int:
        """Trajectories in groups young enough to train on at `current_version`."""
        return sum(len(g) for g in self._groups if self._fresh(g, current_version, max_age))

    def valid_groups(self, current_version: int, max_age: int) -> int:
        return sum(1 for g in self._groups if self._fresh(g, current_version, max_age))

    def drop_stale(self, current_version: int, max_age: int) -> int:
        keep = deque(g for g in self._groups if self._fresh(g, current_version, max_age))
        gone = len(self) - sum(len(g) for g in keep)
        if gone:
            self.note_dropped(gone, "stale")
        self._groups = keep
        return gone

    def take(self, n_groups: int, current_version: int, max_age: int) -> list[Group]:
        """The `n_groups` oldest valid groups (stale ones are dropped first, counted)."""
        self.drop_stale(current_version, max_age)
        if len(self._groups) < n_groups:
            raise RlixError(f"buffer holds {len(self._groups)} valid groups, {n_groups} asked for")
        out = [self._groups.popleft() for _ in range(n_groups)]
        self.trained += sum(len(g) for g in out)
        return out

    def close(self) -> None:
        left = len(self)
        if left:
            self.note_dropped(left, "unused at shutdown")
        self._groups.clear()

    def accounting(self) -> dict:
        return {"started": self.started, "trained": self.trained, "dropped": dict(self.dropped),
                "buffered": len(self)}

    def check_conservation(self, in_flight: int = 0) -> None:
        accounted = self.trained + sum(self.dropped.values()) + len(self) + in_flight
        if accounted != self.started:
            raise AccountingError(f"{self.started} trajectories started but {accounted} accounted for "
                                  f"({self.accounting()}, in flight {in_flight})")
