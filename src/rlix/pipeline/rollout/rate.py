"""A pipeline's generation rate as the scheduler plans with it: shard-seconds per trajectory.

Why: the planner moves a GPU only where the work it buys repays the move (sleep, wake, sync);
a pipeline's expected work is its remaining trajectories times what one costs its shards. That
cost is measured, not configured: the seconds its active shards were held while work was in
flight, summed over shards, over the trajectories finished in that time, over a recent window
(the rate changes with batch sizes, lengths and weights).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class ShardRate:
    """Shard-seconds per finished trajectory over the last `window` ticks. `active()` is the
    number of shards routed to now; `tick(working, finished)` closes the interval since the
    last tick (counted only if work was in flight during it)."""

    def __init__(self, active: Callable[[], int], window: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.active, self.clock = active, clock
        self._ticks: deque[tuple[float, int]] = deque(maxlen=window)  # (shard-seconds, trajectories)
        self._last = clock()
        self._shards = 0
        self._working = False

    def tick(self, working: bool, finished: int = 0) -> None:
        now = self.clock()
        held = self._shards * (now - self._last) if self._working else 0.0
        if held or finished:
            self._ticks.append((held, finished))
        self._last, self._working, self._shards = now, working, self.active()

    def seconds_per_trajectory(self) -> float | None:
        """None until a trajectory finished with shards held."""
        held = sum(h for h, _ in self._ticks)
        done = sum(n for _, n in self._ticks)
        return held / done if done and held > 0 else None
