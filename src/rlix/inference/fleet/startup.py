"""Start-up progress of shard servers: the phase each one is in, read from a bounded tail of
its own log, and the console lines that say so while a run waits for them.

Why: a vLLM server takes a minute or more to start (engine process, weights, KV cache, warm-up
or graph capture), and a run that printed nothing meanwhile looked hung. The server's log is the
only place that says how far it got; it is read from its end, at most TAIL_BYTES, so a server
that logs a lot costs the reader nothing more. Phases only move forward: a marker once seen
stays seen even after it has scrolled out of the tail.

`StartupWatch` (beside each server process) gives a `ShardStartup` snapshot; the snapshots
travel in a pipeline's progress answers; `StartupReporter` (in the run's driver) turns them
into lines: one per starting shard at most every `interval_s`, one when it is healthy, and one
when every shard that was starting is up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

#: how much of a server's log is read to find its phase
TAIL_BYTES = 32 * 1024

STARTED = "process started"
HEALTHY = "healthy"
EXITED = "exited"

#: a phase and the log text that says it has begun, in the order a server goes through them
PhaseMarkers = tuple[tuple[str, tuple[str, ...]], ...]

VLLM_PHASES: PhaseMarkers = (
    ("engine starting", ("Initializing a V1 LLM engine", "EngineCore pid=")),
    ("loading model", ("Starting to load model", "Loading safetensors", "Loading weights")),
    ("warm-up and compilation", ("Warming up model", "torch.compile", "Dynamo bytecode transform",
                                 "Compiling a graph", "Memory profiling")),
    ("KV cache set-up", ("KV cache size", "Available KV cache memory", "init engine (profile, create kv cache")),
    ("graph capture", ("Capturing CUDA graph", "Graph capturing")),
    ("API server starting", ("Starting vLLM server on", "Available routes are")),
)

EMBEDDED_PHASES: PhaseMarkers = (
    ("API server starting", ("Started server process", "Waiting for application startup")),
)


def read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> str:
    """The last `max_bytes` of a file as text ('' if it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read(max_bytes).decode(errors="replace")
    except OSError:
        return ""


def furthest_phase(text: str, phases: PhaseMarkers) -> int:
    """Index into `phases` of the latest phase whose marker is in `text`, -1 if none is."""
    for i in range(len(phases) - 1, -1, -1):
        if any(needle in text for needle in phases[i][1]):
            return i
    return -1


@dataclass(frozen=True)
class ShardStartup:
    """One server process's start-up as seen now: `key` is its launcher key, `pid` tells two
    starts of the same key apart."""

    key: int
    pid: int | None
    phase: str
    elapsed_s: float
    healthy: bool

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ShardStartup:
        return cls(key=int(d["key"]), pid=d.get("pid"), phase=str(d["phase"]),
                   elapsed_s=float(d["elapsed_s"]), healthy=bool(d["healthy"]))


class StartupWatch:
    """One server's start: its phase from its log, its health and liveness from its owner
    (`healthy()`: it answered its health check; `alive()`: its process still runs)."""

    def __init__(self, log_path: Path, phases: PhaseMarkers, *, healthy: Callable[[], bool],
                 alive: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self.log_path, self.phases = log_path, phases
        self.healthy, self.alive, self.clock = healthy, alive, clock
        self.started_at = clock()
        self.ready_after: float | None = None
        self._seen = -1

    def phase(self) -> str:
        if self.healthy():
            return HEALTHY
        if not self.alive():
            return EXITED
        self._seen = max(self._seen, furthest_phase(read_tail(self.log_path), self.phases))
        return self.phases[self._seen][0] if self._seen >= 0 else STARTED

    def state(self, key: int, pid: int | None) -> ShardStartup:
        phase = self.phase()
        healthy = phase == HEALTHY
        if healthy and self.ready_after is None:
            self.ready_after = self.clock() - self.started_at
        elapsed = self.ready_after if healthy and self.ready_after is not None else self.clock() - self.started_at
        return ShardStartup(key=key, pid=pid, phase=phase, elapsed_s=round(elapsed, 1), healthy=healthy)


@dataclass
class _Seen:
    began: float  # when it started, on the reporter's clock
    said_at: float | None = None  # when its last line was printed (None: never)
    done: bool = False  # healthy, or exited before it was
    ready_at: float | None = None  # when it was healthy, on the reporter's clock


class StartupReporter:
    """Console lines from successive snapshots of one pipeline's shards. A shard starting for
    less than `quiet_s` gets no line (a quick start says nothing); after that one line per
    `interval_s` while it is not healthy, one when it is, and one when every shard is up (after
    any got a line)."""

    def __init__(self, say: Callable[[str], None], label: str, *, what: str = "server",
                 interval_s: float = 10.0, quiet_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.label, self.what = say, label, what
        self.interval_s, self.quiet_s, self.clock = interval_s, quiet_s, clock
        self._seen: dict[tuple[int, int | None], _Seen] = {}

    def update(self, states: list[ShardStartup]) -> None:
        now = self.clock()
        for s in states:
            seen = self._seen.setdefault((s.key, s.pid), _Seen(began=now - s.elapsed_s))
            if s.healthy and seen.ready_at is None:
                seen.ready_at = seen.began + s.elapsed_s
            if s.healthy or s.phase == EXITED:
                if seen.said_at is not None and not seen.done:
                    self.say(f"{self.label}: {self.what} {s.key} healthy after {s.elapsed_s:.0f}s" if s.healthy
                             else f"{self.label}: {self.what} {s.key} exited before it was healthy "
                                  f"({s.elapsed_s:.0f}s)")
                seen.done = True
                continue
            if s.elapsed_s < self.quiet_s:
                continue
            if seen.said_at is None or now - seen.said_at >= self.interval_s:
                self.say(f"{self.label}: {self.what} {s.key} {s.phase} ({s.elapsed_s:.0f}s)")
                seen.said_at = now
        current = {(s.key, s.pid) for s in states}
        said = [v for k, v in self._seen.items() if k in current and v.said_at is not None]
        if said and all(v.done for k, v in self._seen.items() if k in current):
            up = [v for v in said if v.ready_at is not None]
            if up:
                took = max(v.ready_at for v in up if v.ready_at is not None) - min(v.began for v in said)
                self.say(f"{self.label}: all {len(up)} {self.what}(s) up in {took:.0f}s")
            for v in said:
                v.said_at = None  # this batch is told; a later start is a batch of its own
        self._seen = {k: v for k, v in self._seen.items() if k in current}
