"""The dashboard's training curves and the shared cluster's job queue, kept for the page.

Curves come from each pipeline's RUN_DIR/NAME/metrics.jsonl (one JSON row per step, appended as
steps end, rewritten whole on resume). The scheduler learns the file's path when the pipeline
registers; `MetricsCurves` reads each file incrementally from the byte it stopped at, so a page
polling every second costs only the rows added since, and every read is bounded (a first look at
a long file reads its tail, a later one at most READ_BYTES, a line longer than MAX_LINE_BYTES is
skipped, at most KEEP_POINTS points per series and MAX_SERIES series per pipeline). A file
replaced (a resume rewrote it) or shorter than the byte reached is read again from its tail.
Reading happens when the page asks (on the dashboard's thread, at most once per MIN_READ_S),
never on the scheduler's loop: the scheduler must not wait on a disk.

The job queue is pushed by the cluster's head (it alone talks to the job registry); a scheduler
started by `rlix run` gets none, and the page hides the queue.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from rlix.httpkit import capped

#: the metrics drawn, in this order: a name, or a prefix ending in "*" for every metric of a row
#: that starts with it (`eval/*`: whatever the evaluation logs, such as eval/pass@1). A series
#: appears once a row has it, so `eval/*` draws nothing for a run without evaluation.
PLOTTED: tuple[str, ...] = ("reward", "eval/*")
#: points kept per series (the newest); a request asks for at most this many
KEEP_POINTS = 2000
#: points answered when the request does not say
DEFAULT_POINTS = 500
#: series kept per pipeline at most (a row with hundreds of eval metrics cannot grow the answer)
MAX_SERIES = 16
#: the first read of a file starts this many bytes before its end (older rows are not drawn)
TAIL_BYTES = 2 << 20
#: bytes read from one file per refresh at most (the rest at the next)
READ_BYTES = 2 << 20
#: a longer line is skipped (a metrics row is a few KiB)
MAX_LINE_BYTES = 256 << 10
#: a file is looked at again at most this often, however many pages poll
MIN_READ_S = 0.5
#: pipelines whose curves are kept (registered now, or the latest that left)
MAX_PIPELINES = 64
#: jobs answered: every waiting or running one up to MAX_LIVE_JOBS, the newest ended ones up to
#: MAX_ENDED_JOBS
MAX_LIVE_JOBS = 200
MAX_ENDED_JOBS = 50


def plotted(name: str) -> bool:
    """Whether a metric of a row is drawn (see PLOTTED)."""
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in PLOTTED)


def _order(name: str) -> tuple[int, str]:
    """Series sort as PLOTTED lists them, then by name."""
    for i, p in enumerate(PLOTTED):
        if (name.startswith(p[:-1]) if p.endswith("*") else name == p):
            return i, name
    return len(PLOTTED), name


class Series(BaseModel):
    """One metric of one pipeline: its newest points, oldest first (steps grow)."""

    name: str
    steps: list[int]
    values: list[float]


class PipelineCurves(BaseModel):
    name: str
    #: rows read so far (after a rewrite, since it)
    rows: int
    #: the last step read (None: no row yet)
    last_step: int | None
    series: list[Series]
    #: why its file cannot be read (None: read, or not written yet)
    error: str | None


class CurvesState(BaseModel):
    """GET /api/curves: every pipeline's curves, at most `points` points per series."""

    at: float
    points: int
    plotted: list[str]
    pipelines: list[PipelineCurves]


JobGroup = Literal["waiting", "running", "ended"]


class JobRow(BaseModel):
    """One job of a shared cluster as the queue shows it."""

    name: str
    user: str
    #: the registry's state: queued, admitted, running, done, failed, cancelled
    state: str
    group: JobGroup
    pipelines: list[str]
    #: GPUs it asks for: the floor promised to it, and the most it may hold at once
    min_gpus: int
    max_gpus: int
    #: 1-based place in the admission queue (None: not waiting)
    queue_position: int | None
    #: why it waits, or how it ended
    reason: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None


class JobsState(BaseModel):
    """GET /api/jobs: the cluster's queue; `cluster` false where no head feeds it (`rlix run`)."""

    at: float
    cluster: bool
    jobs: list[JobRow]


def bounded_jobs(rows: Iterable[JobRow]) -> list[JobRow]:
    """Waiting first (by place), then running, then the newest ended, each group capped."""
    rows = list(rows)
    waiting = sorted((r for r in rows if r.group == "waiting"),
                     key=lambda r: (r.queue_position or 0, r.submitted_at))
    running = sorted((r for r in rows if r.group == "running"), key=lambda r: r.submitted_at)
    ended = sorted((r for r in rows if r.group == "ended"), key=lambda r: -(r.ended_at or r.submitted_at))
    live = (waiting + running)[:MAX_LIVE_JOBS]
    return live + ended[:MAX_ENDED_JOBS]


@dataclass
class _File:
    """What has been read of one pipeline's metrics.jsonl."""

    path: Path
    identity: tuple[int, int] | None = None  # (device, inode) of the file read
    offset: int = 0  # the byte reached (the start of a line)
    rows: int = 0
    last_step: int | None = None
    series: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    error: str | None = None
    read_at: float = -math.inf

    def reset(self) -> None:
        self.identity, self.offset, self.rows, self.last_step, self.series = None, 0, 0, None, {}


class MetricsCurves:
    """See module doc. `watch(pipeline, path)` from the scheduler's thread, `state(points)` from
    the dashboard's; a lock keeps the two apart."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()

    def watch(self, pipeline: str, path: str | os.PathLike) -> None:
        """Draw `pipeline` from the metrics file at `path` (a new path starts it afresh)."""
        with self._lock:
            known = self._files.pop(pipeline, None)
            self._files[pipeline] = known if known is not None and known.path == Path(path) else _File(Path(path))
            while len(self._files) > MAX_PIPELINES:
                self._files.pop(next(iter(self._files)))

    def paths(self) -> dict[str, str]:
        """pipeline -> the watched file (what a restarted scheduler needs to watch again)."""
        with self._lock:
            return {name: str(f.path) for name, f in self._files.items()}

    def state(self, points: int = DEFAULT_POINTS, pipelines: Iterable[str] | None = None) -> CurvesState:
        """Every watched pipeline's curves (in `pipelines`' order and only those, when given),
        the newest `points` points per series; files read first when due."""
        points = min(max(int(points), 1), KEEP_POINTS)
        with self._lock:
            names = list(self._files) if pipelines is None else [p for p in pipelines if p in self._files]
            out = []
            for name in names:
                f = self._files[name]
                if self.clock() - f.read_at >= MIN_READ_S:
                    _read(f)
                    f.read_at = self.clock()
                series = [Series(name=s, steps=[p[0] for p in pts][-points:], values=[p[1] for p in pts][-points:])
                          for s, pts in sorted(f.series.items(), key=lambda kv: _order(kv[0]))]
                out.append(PipelineCurves(name=name, rows=f.rows, last_step=f.last_step, series=series,
                                          error=f.error))
        return CurvesState(at=time.time(), points=points, plotted=list(PLOTTED), pipelines=out)


def _read(f: _File) -> None:
    """Take the rows added to `f`'s file since the last read (see module doc for the bounds)."""
    try:
        with open(f.path, "rb") as fh:
            st = os.fstat(fh.fileno())
            identity = (st.st_dev, st.st_ino)
            if identity != f.identity or st.st_size < f.offset:
                f.reset()  # a new file (a resume rewrote it), or cut short: read its tail again
                f.identity = identity
                if st.st_size > TAIL_BYTES:
                    fh.seek(st.st_size - TAIL_BYTES)
                    fh.readline()  # the first line read there is likely a piece of one
                    f.offset = fh.tell()
            fh.seek(f.offset)
            chunk = fh.read(READ_BYTES)
    except FileNotFoundError:
        f.reset()
        f.error = None  # not written yet: the pipeline has not finished a step
        return
    except OSError as exc:
        f.error = capped(f"cannot read {f.path.name}: {exc.strerror or exc}", 200)
        return
    f.error = None
    end = chunk.rfind(b"\n") + 1  # only whole lines; a line being written is read next time
    if end == 0 and len(chunk) >= MAX_LINE_BYTES:
        end = len(chunk)  # no newline in a full read: one line too long to keep, skipped
    for line in chunk[:end].split(b"\n"):
        if line and len(line) <= MAX_LINE_BYTES:
            _take(f, line)
    f.offset += end


def _take(f: _File, line: bytes) -> None:
    """One metrics row into the series (a row cut short, or not a row, is skipped)."""
    try:
        row = json.loads(line)
    except ValueError:
        return
    if not isinstance(row, dict):
        return
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return
    f.rows += 1
    f.last_step = step
    for name, value in row.items():
        if not plotted(name) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        if not math.isfinite(value):
            continue
        pts = f.series.get(name)
        if pts is None:
            if len(f.series) >= MAX_SERIES:
                continue
            pts = f.series[name] = deque(maxlen=KEEP_POINTS)
        while pts and pts[-1][0] >= step:  # a step taken again replaces what followed it
            pts.pop()
        pts.append((step, round(value, 6)))
