"""The scheduler's live dashboard: a page and its JSON, served from the scheduler's process.

`DashboardFeed` is bookkeeping fed by whoever drives a `SchedulerCore` (the service's
`AsyncScheduler` refreshes it after every change, beside the metrics): it keeps the pipelines
table and the recent GPU role changes in a frame replaced whole, because the HTTP server answers
from its own thread while the scheduler's loop changes the ledger. What depends on the time (a
pending request's wait, the timeline's right edge) is computed when asked, on the core's clock.

`DashboardServer` serves, on 127.0.0.1 only, from one event loop (connections capped, request
heads bounded in size and time, GET and HEAD only):
  GET /               the page (dashboard.html, shipped with the package: plain JS and SVG, no
                      build step, nothing fetched from elsewhere); it polls /api/state every second
  GET /api/state      `DashboardState`: the pipelines table and every GPU's segments over the last
                      `window_s` seconds (query `?window_s=N`, default 300, at most KEEP_S)
  GET /api/pipelines  the table alone;  GET /api/gpus  the GPU rows alone
  GET /api/curves     `CurvesState`: every pipeline's reward and eval curves over its steps, read
                      from its metrics.jsonl (query `?points=N`: the newest N per series, default
                      500, at most curves.KEEP_POINTS; rlix.scheduler.curves bounds the reads)
  GET /api/jobs       `JobsState`: a shared cluster's jobs (waiting, running, ended), as its head
                      pushes them; `cluster` false under `rlix run`
  GET /health         200 "ok" (a liveness probe)

Times in the JSON are seconds relative to the answer (`start_s` <= `end_s` <= 0), so the page
needs no clock of its own. Pipelines are coloured as the run's PNG chart colours them
(rlix.timeline.chart: matplotlib's tab10 then Dark2, in order of first appearance; train darker,
generate lighter).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel

from rlix.httpkit import capped
from rlix.scheduler.core import SchedulerCore, gpu_roles
from rlix.scheduler.curves import (
    DEFAULT_POINTS,
    KEEP_POINTS,
    CurvesState,
    JobRow,
    JobsState,
    MetricsCurves,
    bounded_jobs,
)
from rlix.scheduler.planning.planner import rollout_demand
from rlix.scheduler.types import Role

log = logging.getLogger("rlix.scheduler")

#: matplotlib's tab10 then Dark2, as hex: rlix.timeline.chart.pipeline_colours' palette (a test
#: keeps the two equal; the scheduler's layer cannot import the timeline's, nor needs matplotlib)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02",
           "#a6761d", "#666666")
#: how far back the timeline can be asked for (older role changes are dropped)
KEEP_S = 3600.0
#: role changes kept at most (a busy cluster's hour could be more: the oldest go first)
KEEP_CHANGES = 20000
#: pipelines that left, still shown (with state left or failed), newest kept
DEPARTED_SHOWN = 16
DEFAULT_WINDOW_S = 300.0

RoleName = Literal["train", "generate", "idle", "lost"]
PipelineState = Literal["waiting", "init", "train", "logprob", "generating", "idle", "left", "failed"]


class RoleColours(BaseModel):
    """A pipeline's two shades (CSS colours), as the PNG chart draws its roles."""

    train: str
    generate: str


class PipelineRow(BaseModel):
    """One row of the pipelines table."""

    name: str
    priority: int | None
    weight: float | None
    state: PipelineState
    #: GPUs held now, by role (train: a non-rollout stage; generate: its shards)
    train_gpus: list[int]
    generate_gpus: list[int]
    shards: int
    max_shards: int | None
    #: shards the planner would give it now (rollout demand); None once it has left
    demand_shards: int | None
    #: the step and rollout counts of its last progress report (None: none yet)
    step: int | None
    remaining: int | None
    target: int | None
    #: its pending non-rollout request: the stage, GPUs asked for, seconds waited so far
    waiting_for: str | None
    waiting_gpus: int | None
    waiting_s: float | None
    #: why it failed (state failed)
    error: str | None
    colours: RoleColours


class Segment(BaseModel):
    """A stretch of time one GPU had one holder in one role; seconds relative to the answer."""

    start_s: float
    end_s: float
    pipeline: str | None
    role: RoleName
    rank: int | None
    #: why this stretch began (the role log's reason: grant, expand, preemption, release,
    #: unregister, failure, lost); None when it began before the window or the kept log
    reason: str | None


class GpuRow(BaseModel):
    """One GPU: who holds it now and its segments over the window, oldest first."""

    gpu: int
    node: int
    pipeline: str | None
    role: RoleName
    rank: int | None
    segments: list[Segment]


class DashboardState(BaseModel):
    """Everything the page draws, in one answer."""

    #: wall-clock time of this answer (unix seconds)
    at: float
    window_s: float
    gpus_total: int
    gpus_idle: int
    gpus_lost: int
    #: number of the last GPU role change (grows with every move)
    role_seq: int
    plans: int
    restarts: int
    pipelines: list[PipelineRow]
    gpus: list[GpuRow]


def colours(index: int) -> RoleColours:
    """The chart's shades of the `index`th pipeline's colour: train mixed 25% towards black,
    generate 50% towards white (rlix.timeline.chart.shade)."""
    base = PALETTE[index % len(PALETTE)]
    rgb = [int(base[i:i + 2], 16) / 255 for i in (1, 3, 5)]

    def mix(towards: float, amount: float) -> str:
        return "#" + "".join(f"{round((c + (towards - c) * amount) * 255):02x}" for c in rgb)

    return RoleColours(train=mix(0.0, 0.25), generate=mix(1.0, 0.5))


def parse_role(role: str) -> tuple[str | None, RoleName, int | None]:
    """A role-log role ("idle", "P/train", "P/generate#R") as (pipeline, role, dp rank)."""
    if role == "idle" or "/" not in role:
        return None, "idle", None
    pipeline, what = role.rsplit("/", 1)
    if what.startswith("generate#"):
        return pipeline, "generate", int(what.split("#", 1)[1])
    return pipeline, "train", None


def pipeline_rows(core: SchedulerCore, order: Mapping[str, int], now: float) -> list[PipelineRow]:
    """The registered pipelines as table rows (waits measured at `now`, the core's clock);
    `order`: pipeline -> colour index."""
    held: dict[str, dict[Role, list[int]]] = {}
    shards: dict[str, int] = {}
    stage_of: dict[str, str] = {}
    for h in core.ledger.holdings.values():
        held.setdefault(h.pipeline, {}).setdefault(h.role, []).extend(h.gpus)
        if h.role is Role.GENERATE:
            shards[h.pipeline] = shards.get(h.pipeline, 0) + 1
        else:
            stage_of[h.pipeline] = h.stage.name.lower()
    pending = {r.pipeline: r for r in core.pending.values()}
    rows = []
    for name, spec in core.pipelines.items():
        progress = core.progress.get(name)
        req = pending.get(name)
        mine = held.get(name, {})
        if req is not None:
            state: PipelineState = "waiting"
        elif name in stage_of:
            state = stage_of[name]  # type: ignore[assignment]
        elif shards.get(name):
            state = "generating"
        else:
            state = "idle"
        rows.append(PipelineRow(
            name=name, priority=spec.priority, weight=spec.weight, state=state,
            train_gpus=sorted(mine.get(Role.TRAIN, [])), generate_gpus=sorted(mine.get(Role.GENERATE, [])),
            shards=shards.get(name, 0), max_shards=spec.max_shards,
            demand_shards=rollout_demand(spec, progress),
            step=progress.step if progress else None, remaining=progress.remaining if progress else None,
            target=progress.target if progress else None,
            waiting_for=req.stage.name.lower() if req else None, waiting_gpus=req.gpus if req else None,
            waiting_s=round(max(0.0, now - req.submitted_at), 3) if req else None,
            error=None, colours=colours(order.get(name, 0))))
    return rows


def departed_row(last: PipelineRow, failure: Mapping | None) -> PipelineRow:
    """A pipeline that left, as its last row: nothing held, nothing asked for."""
    return last.model_copy(update={
        "state": "failed" if failure else "left", "train_gpus": [], "generate_gpus": [], "shards": 0,
        "demand_shards": None, "waiting_for": None, "waiting_gpus": None, "waiting_s": None,
        "error": str(failure.get("reason")) if failure else None})


def gpu_rows(changes: Iterable[Mapping], roles: Mapping[int, str], lost: Iterable[int],
             node_of: list[int], now: float, window_s: float) -> list[GpuRow]:
    """Every GPU's segments over [now - window_s, now] from the role changes (oldest first,
    `at` on the same clock as `now`) and the roles now. A GPU's role before its first kept
    change is that change's `before`; a GPU with no change kept had its role now all along."""
    start = now - window_s
    per_gpu: dict[int, list[Mapping]] = {}
    for c in changes:
        per_gpu.setdefault(int(c["gpu"]), []).append(c)
    lost = set(lost)
    rows = []
    for gpu, node in enumerate(node_of):
        segments: list[Segment] = []
        t, reason = float("-inf"), None
        current = roles.get(gpu, "idle")
        for c in per_gpu.get(gpu, []):
            _add(segments, t, float(c["at"]), str(c["before"]), reason, start, now)
            t, reason = float(c["at"]), str(c["reason"])
        _add(segments, t, now, current, reason, start, now)
        pipeline, role, rank = parse_role(current)
        if gpu in lost:
            role = "lost"
            if segments and segments[-1].role == "idle":
                segments[-1] = segments[-1].model_copy(update={"role": "lost"})
        rows.append(GpuRow(gpu=gpu, node=node, pipeline=pipeline, role=role, rank=rank, segments=segments))
    return rows


def _add(segments: list[Segment], begin: float, end: float, role: str, reason: str | None,
         start: float, now: float) -> None:
    """A segment clipped to the window (dropped if outside it); `lost` is kept as its role."""
    lo, hi = max(begin, start), min(end, now)
    if hi <= lo:
        return
    pipeline, name, rank = parse_role(role)
    if reason == "lost" and name == "idle":
        name = "lost"
    segments.append(Segment(start_s=round(lo - now, 3), end_s=round(hi - now, 3), pipeline=pipeline,
                            role=name, rank=rank, reason=reason if begin >= start else None))


@dataclass(frozen=True)
class _Frame:
    """The scheduler as of the last refresh (replaced whole, never changed)."""

    at: float = 0.0  # the core's clock at the refresh
    rows: tuple[PipelineRow, ...] = ()
    pending_since: dict[str, float] = field(default_factory=dict)  # pipeline -> its request's time
    roles: dict[int, str] = field(default_factory=dict)
    lost: frozenset[int] = frozenset()
    node_of: tuple[int, ...] = ()
    changes: tuple[dict, ...] = ()
    role_seq: int = 0
    plans: int = 0
    restarts: int = 0


class DashboardFeed:
    """See module doc. Off until `start()` (the service starts it when it serves the page):
    then every `refresh(core)` keeps a frame for the server's thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep_s: float = KEEP_S,
                 keep_changes: int = KEEP_CHANGES) -> None:
        self.clock = clock
        self.keep_s = keep_s
        self.active = False
        self._frame = _Frame()
        self._changes: deque[dict] = deque(maxlen=keep_changes)
        self._seq = 0  # the last role change taken
        self._order: dict[str, int] = {}  # pipeline -> colour index, in order of first appearance
        self._last_rows: dict[str, PipelineRow] = {}  # every pipeline's last row (a leaver's stays)
        self._departed: deque[str] = deque()
        self._seen_at: dict[str, float] = {}  # pipeline -> the last refresh that found it registered
        #: the pipelines' metrics files, read when the page asks for curves
        self.curves = MetricsCurves(clock)
        self._jobs: tuple[JobRow, ...] | None = None  # None: no cluster head feeds the queue

    def start(self, core: SchedulerCore, failures: Iterable[Mapping] = (), restarts: int = 0) -> None:
        self.active = True
        self.refresh(core, failures, restarts)

    def refresh(self, core: SchedulerCore, failures: Iterable[Mapping] = (), restarts: int = 0) -> None:
        """Take the core's state now (on the thread that changes it)."""
        if not self.active:
            return
        now = core.clock()
        new = []
        for c in reversed(core.role_log):  # the newest are at the end: read back to the last taken
            if c["seq"] <= self._seq:
                break
            new.append(dict(c))
        self._changes.extend(reversed(new))
        self._seq = max(self._seq, core.role_seq)
        dropped = 0
        while self._changes and self._changes[0]["at"] < now - self.keep_s:
            self._changes.popleft()
            dropped += 1
        # copied for the frame only when they changed (a refresh per progress report is common)
        changes = tuple(self._changes) if new or dropped or not self._frame.changes else self._frame.changes
        for name in core.pipelines:
            self._order.setdefault(name, len(self._order))
        rows = pipeline_rows(core, self._order, now)
        # a failure counts for a leaver if it came after the pipeline was last seen registered
        # (one that failed, came back and then left in peace has left)
        failed = {f["pipeline"]: f for f in failures
                  if f.get("at", now) >= self._seen_at.get(f["pipeline"], float("-inf"))}
        for name in [n for n in self._last_rows if n not in core.pipelines and n not in self._departed]:
            self._departed.append(name)
        for name in [n for n in self._departed if n in core.pipelines]:
            self._departed.remove(name)  # registered again
        while len(self._departed) > DEPARTED_SHOWN:
            name = self._departed.popleft()
            self._last_rows.pop(name, None)
            self._seen_at.pop(name, None)
        for row in rows:
            self._last_rows[row.name] = row
            self._seen_at[row.name] = now
        gone = [departed_row(self._last_rows[n], failed.get(n)) for n in self._departed]
        self._frame = _Frame(
            at=now, rows=tuple(rows + gone),
            pending_since={r.pipeline: r.submitted_at for r in core.pending.values()},
            roles=gpu_roles(core.ledger.snapshot()), lost=frozenset(core.ledger.lost),
            node_of=tuple(core.ledger.topology.node_of()), changes=changes,
            role_seq=core.role_seq, plans=len(core.plan_log), restarts=restarts)

    def state(self, window_s: float = DEFAULT_WINDOW_S) -> DashboardState:
        """The page's data now (any thread)."""
        frame, now = self._frame, self.clock()
        window_s = min(max(float(window_s), 1.0), self.keep_s)
        rows = [r.model_copy(update={"waiting_s": round(max(0.0, now - frame.pending_since[r.name]), 3)})
                if r.name in frame.pending_since else r for r in frame.rows]
        gpus = gpu_rows(frame.changes, frame.roles, frame.lost, list(frame.node_of), now, window_s)
        return DashboardState(
            at=time.time(), window_s=window_s, gpus_total=len(frame.node_of),
            gpus_idle=sum(1 for g in gpus if g.role == "idle"), gpus_lost=len(frame.lost),
            role_seq=frame.role_seq, plans=frame.plans, restarts=frame.restarts, pipelines=rows, gpus=gpus)

    def curve_state(self, points: int = DEFAULT_POINTS) -> CurvesState:
        """The curves of the pipelines the table shows, in its order (any thread)."""
        return self.curves.state(points, [r.name for r in self._frame.rows])

    def set_jobs(self, rows: Iterable[JobRow]) -> None:
        """The cluster's jobs now (replaced whole; any thread)."""
        self._jobs = tuple(bounded_jobs(rows))

    def jobs(self) -> JobsState:
        jobs = self._jobs
        return JobsState(at=time.time(), cluster=jobs is not None, jobs=list(jobs or ()))


# ---------------------------------------------------------------------- HTTP
@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, content type, body."""

    status: int
    content_type: str
    body: bytes


def page() -> bytes:
    """The dashboard page (package data beside this module)."""
    return resources.files("rlix.scheduler").joinpath("dashboard.html").read_bytes()


def _json(status: int, payload) -> Answer:
    return Answer(status, "application/json", json.dumps(payload).encode())


PAGES = ("/", "/api/state", "/api/pipelines", "/api/gpus", "/api/curves", "/api/jobs")


def route(target: str, state: Callable[[float], DashboardState],
          curves: Callable[[int], CurvesState] | None = None,
          jobs: Callable[[], JobsState] | None = None) -> Answer:
    """What a GET of `target` (path and query) answers; `state(window_s)`, `curves(points)` and
    `jobs()` give the data (the last two answer empty when not given)."""
    url = urlsplit(target)
    if url.path in ("/", "/index.html"):
        return Answer(200, "text/html; charset=utf-8", page())
    if url.path == "/health":  # what a liveness probe asks (it costs nothing)
        return Answer(200, "text/plain", b"ok")
    if url.path not in PAGES[1:]:
        return _json(404, {"error": f"no such page: {capped(url.path, 200)}", "pages": list(PAGES)})
    if url.path == "/api/curves":
        raw = parse_qs(url.query).get("points", [str(DEFAULT_POINTS)])[-1]
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 8 and 1 <= int(raw) <= KEEP_POINTS):
            return _json(400, {"error": f"points must be a whole number from 1 to {KEEP_POINTS}, "
                                        f"got {capped(raw, 100)!r}"})
        data = curves(int(raw)) if curves is not None else CurvesState(
            at=time.time(), points=int(raw), plotted=[], pipelines=[])
        return Answer(200, "application/json", data.model_dump_json().encode())
    if url.path == "/api/jobs":
        answer = jobs() if jobs is not None else JobsState(at=time.time(), cluster=False, jobs=[])
        return Answer(200, "application/json", answer.model_dump_json().encode())
    raw = parse_qs(url.query).get("window_s", [str(DEFAULT_WINDOW_S)])[-1]
    try:
        window_s = float(raw)
        if not window_s > 0 or window_s == float("inf"):
            raise ValueError
    except ValueError:
        return _json(400, {"error": f"window_s must be a positive number of seconds, got {capped(raw, 100)!r}"})
    data = state(window_s)
    if url.path == "/api/pipelines":
        body = "[" + ",".join(r.model_dump_json() for r in data.pipelines) + "]"
    elif url.path == "/api/gpus":
        body = "[" + ",".join(g.model_dump_json() for g in data.gpus) + "]"
    else:
        body = data.model_dump_json()
    return Answer(200, "application/json", body.encode())


#: connections open at once (see DashboardServer: one more makes room by closing a waiting one):
#: (sockets on one event loop, no thread each: half-open connections cannot pile up threads)
MAX_CONNECTIONS = 32
#: seconds a connection may take to send a request head, or stay idle between two requests
HEAD_TIMEOUT_S = 5.0
#: the most bytes of a request head (its line and headers): more is answered 431
MAX_HEAD_BYTES = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _answer_bytes(answer: Answer, head_only: bool = False, close: bool = False) -> bytes:
    head = [f"HTTP/1.1 {answer.status} {_REASONS.get(answer.status, '')}",
            f"Content-Type: {answer.content_type}", f"Content-Length: {len(answer.body)}",
            "Cache-Control: no-store"]
    if answer.status == 405:
        head.append("Allow: GET, HEAD")
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else answer.body)


class DashboardServer:
    """The page and its JSON over HTTP, from one asyncio event loop on a thread of this process.

    Why a loop: the scheduler's process must not grow a thread per connection (the standard
    library's threading server did: 300 half-open connections made 329 threads). Connections are
    capped (MAX_CONNECTIONS): one over the cap closes the oldest connection that has not sent a
    request yet, else the oldest idle kept-alive one (a browser opens a new one), else it gets
    503. A request head must come within HEAD_TIMEOUT_S and fit MAX_HEAD_BYTES, and only GET and
    HEAD without a body are served (anything else: 405 or 413, the body unread, the connection
    closed)."""

    def __init__(self, state: Callable[[float], DashboardState],
                 curves: Callable[[int], CurvesState] | None = None,
                 jobs: Callable[[], JobsState] | None = None) -> None:
        self.state, self.curves, self.jobs = state, curves, jobs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._tasks: dict[asyncio.StreamWriter, asyncio.Task] = {}  # every open connection's
        # connections waiting for a request head, oldest first: never served / kept alive
        self._fresh: dict[asyncio.StreamWriter, None] = {}
        self._idle: dict[asyncio.StreamWriter, None] = {}

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start serving; returns the port (0: a free one is chosen). OSError if it cannot
        listen there (a port taken by another program, one below 1024 without the right)."""
        self.close()
        sock = socket.create_server((host, port))  # here, so that a taken port raises here
        loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:  # the loop's own thread (the caller's may run a loop already: Ray's)
            try:
                self._server = loop.run_until_complete(asyncio.start_server(
                    self._connection, sock=sock, limit=MAX_HEAD_BYTES, backlog=1024))
            except BaseException as exc:  # noqa: BLE001 - handed to serve()
                started.set_exception(exc)
                return
            started.set_result(None)
            loop.run_forever()

        thread = threading.Thread(target=run, name="rlix-dashboard", daemon=True)
        thread.start()
        try:
            started.result(30)
        except BaseException:
            thread.join(5)
            sock.close()
            loop.close()
            raise
        self._loop, self._thread, self._port = loop, thread, int(sock.getsockname()[1])
        return self._port

    @property
    def port(self) -> int | None:
        return self._port

    def close(self) -> None:
        """Stop serving (if it was) and free the port."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        if thread is not None and thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shut(), loop).result(5)
            except Exception:  # noqa: BLE001 - stopping anyway
                log.exception("dashboard: closing failed")
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
        if not loop.is_running():
            loop.close()
        self._loop = self._thread = self._server = self._port = None

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ one connection
    def _make_room(self) -> bool:
        """Below the cap, or made so by closing a waiting connection; False if all are busy."""
        if len(self._tasks) < MAX_CONNECTIONS:
            return True
        for waiting in (self._fresh, self._idle):
            oldest = next(iter(waiting), None)
            if oldest is not None:
                waiting.pop(oldest)
                self._tasks.pop(oldest).cancel()
                return True
        return False

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not self._make_room():
                await self._send(writer, _json(503, {"error": "too many connections"}), close=True)
                return
            self._tasks[writer] = asyncio.current_task()  # type: ignore[assignment]
            self._fresh[writer] = None
            while await self._one_request(reader, writer):
                self._idle[writer] = None
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # gone, or closed to make room (or by close())
        finally:
            for table in (self._tasks, self._fresh, self._idle):
                table.pop(writer, None)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read and answer one request (the connection is in `_fresh` or `_idle` meanwhile);
        whether the connection stays open for another."""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, ValueError):
            too_long = _json(431, {"error": f"request head over {MAX_HEAD_BYTES} bytes"})
            await self._send(writer, too_long, close=True)
            return False
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return False  # half-open, idle or gone: closed
        finally:
            self._fresh.pop(writer, None)
            self._idle.pop(writer, None)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._send(writer, _json(400, {"error": "malformed request line"}), close=True)
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "0")
        if method not in ("GET", "HEAD"):
            await self._send(writer, _json(405, {"error": f"{capped(method, 20)} is not served: GET only"}),
                             close=True)
            return False
        if not length.isdigit() or int(length) > 0 or "transfer-encoding" in headers:
            await self._send(writer, _json(413, {"error": "a GET carries no body"}), close=True)
            return False
        try:
            answer = route(target, self.state, self.curves, self.jobs)
        except Exception as exc:  # noqa: BLE001 - a bug here must answer, not hang the page
            log.exception("dashboard: %s failed", capped(target, 200))
            answer = _json(500, {"error": capped(f"{type(exc).__name__}: {exc}")})
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        await self._send(writer, answer, head_only=method == "HEAD", close=not keep)
        return keep

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, answer: Answer, head_only: bool = False,
                    close: bool = False) -> None:
        writer.write(_answer_bytes(answer, head_only, close))
        await writer.drain()
