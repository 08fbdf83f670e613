"""A shard's life as one explicit state machine, owned by its fleet.

Why: what a shard is doing (serving, being preempted, asleep, waking) decides what may be done
to it next, and when it was kept as loose flags (`asleep`, `active`) beside the router's own
table, an impossible combination (routed to while asleep, woken while still draining) could only
show up as a failure far away. Here every change goes through `Shard.enter`, which refuses a
transition the table below does not allow (`EngineStateError` naming the shard and both
states); the router's routing state is a projection of it (`routing`), pushed by the fleet when
it changes, never kept apart.

    INACTIVE   awake, not routed to (a new process serving the weights on disk, or deactivated)
    ACTIVE     awake and routed to
    PREEMPTING marked preempted: aborting, draining, going to sleep
    ASLEEP     asleep (weights offloaded or dropped, KV cache freed)
    WAKING     a wake in progress
    UNKNOWN    a call that may have woken it failed half-way: the next sleep or wake asks it
    DOWN       its process is gone; the fleet forgets it (a new process is a new Shard)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from rlix.errors import EngineStateError
from rlix.inference.router.shard_table import ShardState


class Life(str, Enum):
    INACTIVE = "inactive"
    ACTIVE = "active"
    PREEMPTING = "preempting"
    ASLEEP = "asleep"
    WAKING = "waking"
    UNKNOWN = "unknown"
    DOWN = "down"


#: the transitions a shard may make (staying where it is is always allowed: calls repeat)
TRANSITIONS: dict[Life, frozenset[Life]] = {
    Life.INACTIVE: frozenset({Life.ACTIVE, Life.PREEMPTING, Life.UNKNOWN, Life.DOWN}),
    Life.ACTIVE: frozenset({Life.INACTIVE, Life.PREEMPTING, Life.DOWN}),
    Life.PREEMPTING: frozenset({Life.ASLEEP, Life.UNKNOWN, Life.DOWN}),
    # INACTIVE straight from ASLEEP: a sync call that wakes the shard itself (one round trip)
    Life.ASLEEP: frozenset({Life.WAKING, Life.PREEMPTING, Life.INACTIVE, Life.UNKNOWN, Life.DOWN}),
    Life.WAKING: frozenset({Life.INACTIVE, Life.ASLEEP, Life.UNKNOWN, Life.DOWN}),
    Life.UNKNOWN: frozenset({Life.PREEMPTING, Life.WAKING, Life.INACTIVE, Life.ASLEEP, Life.DOWN}),
    Life.DOWN: frozenset(),
}

#: what the router does with a shard in each state
ROUTING: dict[Life, ShardState] = {
    Life.INACTIVE: ShardState.INACTIVE, Life.ACTIVE: ShardState.ACTIVE,
    Life.PREEMPTING: ShardState.PREEMPTED, Life.ASLEEP: ShardState.PREEMPTED,
    Life.WAKING: ShardState.PREEMPTED, Life.UNKNOWN: ShardState.PREEMPTED, Life.DOWN: ShardState.DOWN,
}


HISTORY = 256


@dataclass
class Shard:
    """One DP rank of a pipeline and the engine process it is bound to."""

    rank: int
    url: str
    state: Life = Life.INACTIVE
    gpus: tuple[int, ...] = ()  # where its process runs (placed fleets), () if not placed
    proc: int | None = None  # the launcher's key of its process (None: the rank itself)
    #: the latest states entered, in order (a long run's shard makes thousands of changes)
    history: deque[Life] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def __post_init__(self) -> None:
        self.history.append(self.state)

    @property
    def key(self) -> int:
        return self.rank if self.proc is None else self.proc

    def enter(self, state: Life) -> None:
        """Move to `state`; EngineStateError if the table does not allow it from here."""
        if state is self.state:
            return
        if state not in TRANSITIONS[self.state]:
            raise EngineStateError(f"shard {self.rank}: {self.state.value} -> {state.value} is not a "
                                   f"transition a shard can make")
        self.state = state
        self.history.append(state)

    @property
    def routing(self) -> ShardState:
        return ROUTING[self.state]

    @property
    def active(self) -> bool:
        return self.state is Life.ACTIVE

    @property
    def awake(self) -> bool:
        """Known to be awake (serving or ready to)."""
        return self.state in (Life.INACTIVE, Life.ACTIVE)

    @property
    def asleep(self) -> bool | None:
        """True asleep, False awake, None not known (being preempted or woken, or a failed call)."""
        if self.state is Life.ASLEEP:
            return True
        return False if self.awake else None
