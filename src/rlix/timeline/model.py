"""A run's timeline, rebuilt from its summary (pure: no Ray, no I/O).

Every GPU's *holdings* tile the run without gap or overlap: who held it, in which role, from
when to when, and why it began (the scheduler's role log: `reason`). Each holding is cut into
*parts* that say what the GPU was doing, one category each:

- generate: an active shard of the holder served on it;
- train: the holder's trainer trained on it (the step's `train_s`);
- sync: weights moved: a shard's wake-sync, refit or audit, the trainer's cache build + audit;
- switch: sleep / wake: a shard started, woke or was replaced before it served, the
  previous holder's shard went to sleep on it, the trainer reloaded or offloaded;
- waiting: held, and none of the above (a trainer's GPUs between its grant and its reload,
  or after its offload until the release);
- idle (no holder) and lost (its node left the cluster) for GPUs nobody held.

The categories come from the pipelines' own records (step phases, `StepRecord`) and their
coordinator's shard events ([at, kind, ranks, version, seconds]), laid over the holdings:
where they overlap, a step phase wins over a sync, a sync over a switch, and a switch over the
holding's base (a shard's base is switch until it is activated, generate after; a trainer's is
waiting). A pipeline with no events (a log without them) has generate as its shards' base, one
with no step records has train as its trainer's. The scheduler's clock and the pipelines'
differ by a few milliseconds (the role log is moved onto wall-clock time when polled), so a
shard's activation is looked for from `ACTIVATION_SLACK_S` before its holding began.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlix.run_summary import RunSummary, StepRow

#: what a held GPU did (a pipeline's account has these) and what a free one was
HELD = ("generate", "train", "sync", "switch", "waiting")
FREE = ("idle", "lost")
CATEGORIES = HELD + FREE

#: coordinator events that move weights / that sleep, wake or start shards
SYNC_EVENTS = ("sync", "refit", "audit", "device_sync")
SWITCH_EVENTS = ("wake", "sleep", "replace", "cool")
#: events that make a shard serve
ACTIVATING = ("activate", "replace")
ACTIVATION_SLACK_S = 0.25

# overlay priorities (higher wins): the holding's base < the previous holder's sleep < the
# holder's shard switches < its syncs < its trainer's step phases
_BASE, _PREV_SLEEP, _SWITCH, _SYNC, _STEP = range(5)

#: a step's phases in the order they run (StepRecord fields; cache and audit drawn as one)
STEP_PHASES = (("generate", "generate_s"), ("wait GPUs", "wait_gpus_s"), ("reload", "reload_s"),
               ("train", "train_s"), ("cache", ("cache_s", "audit_s")), ("sync shards", "device_sync_s"),
               ("offload", "offload_s"))
#: what each step phase counts as on the trainer's GPUs (those not named are not on its GPUs)
PHASE_CATEGORY = {"reload": "switch", "train": "train", "cache": "sync", "sync shards": "sync",
                  "offload": "switch"}


@dataclass(frozen=True)
class Part:
    start: float
    end: float
    category: str


@dataclass(frozen=True)
class Holding:
    """One GPU held (or not) in one role from `start` to `end`."""

    gpu: int
    start: float
    end: float
    role: str  # the role log's words: "idle", "lost", "P/train", "P/generate#R"
    reason: str  # why it began ("" for the state the run started in)
    pipeline: str | None
    kind: str  # "train", "generate", "idle" or "lost"
    rank: int | None
    parts: tuple[Part, ...] = ()

    @property
    def label(self) -> str:
        if self.pipeline is None:
            return self.kind
        return f"{self.pipeline} {self.kind}" + (f" #{self.rank}" if self.rank is not None else "")


@dataclass(frozen=True)
class Span:
    """A pipeline's phase or shard event that took time."""

    start: float
    end: float
    name: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Instant:
    at: float
    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    cat: str = "shard"  # "version": a weight version published; "shard": a shard event


@dataclass
class Timeline:
    start: float
    end: float
    gpus: list[int]
    node_of: dict[int, int | None]  # GPU -> node index (None: not known)
    holdings: dict[int, list[Holding]]  # per GPU, in time order, tiling [start, end]
    pipelines: list[str]  # in order of first appearance
    phases: dict[str, list[Span]]  # per pipeline: its steps' phases (one after another)
    shard_spans: dict[str, list[Span]]  # per pipeline: shard events that took time
    instants: dict[str, list[Instant]]  # per pipeline: versions published, shards started ...
    changes: list[dict]  # the role log, in time order, each with a reason

    @property
    def span_s(self) -> float:
        return self.end - self.start


def parse_role(role: str) -> tuple[str | None, str, int | None]:
    """"P/generate#R" -> (P, "generate", R); "P/train" -> (P, "train", None); "idle", "lost"."""
    if role in FREE:
        return None, role, None
    pipeline, _, what = role.rpartition("/")
    if what.startswith("generate#"):
        return pipeline, "generate", int(what.split("#", 1)[1])
    if what == "train":
        return pipeline, "train", None
    raise ValueError(f"not a GPU role: {role!r}")


def infer_reason(before: str, after: str) -> str:
    """The reason of a role-log entry written before entries carried one."""
    if after.endswith("/train"):
        return "grant"
    if "/generate#" in after:
        return "expand"
    return "release" if before.endswith("/train") else "preemption"


def _num(x: Any, default: float = 0.0) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return v if math.isfinite(v) else default


def run_span(summary: RunSummary) -> tuple[float, float]:
    """[start, end] of the run in wall-clock seconds: `run` (started_at, ended_at) when the
    summary has it, else its last timestamp and `wall_s` before it; widened to every timestamp."""
    stamps = [_num(c.at) for c in summary.role_changes]
    stamps += [_num(n.at) for n in summary.lost_nodes]
    for p in summary.pipelines.values():
        for r in p.records:
            if r.finished_at is not None:
                end = _num(r.finished_at)
                stamps += [end - _num(r.step_s), end]
        for e in p.events:
            stamps += [_num(e.at) - _num(e.seconds), _num(e.at)]
    if summary.run is not None:
        start, end = _num(summary.run.started_at), _num(summary.run.ended_at)
    elif stamps:
        end = max(stamps)
        start = end - _num(summary.wall_s)
    else:
        start = end = 0.0
    if stamps:
        start, end = min(start, min(stamps)), max(end, max(stamps))
    return start, end


def run_gpus(summary: RunSummary) -> tuple[list[int], dict[int, int | None]]:
    """The run's GPUs and the node of each: `run.gpu_nodes` (node index per GPU id) when the
    summary has it, else every GPU the role log names (0 up to the highest), nodes unknown."""
    nodes = summary.run.gpu_nodes if summary.run is not None else []
    if nodes:
        node_of: dict[int, int | None] = dict(enumerate(nodes))
    else:
        seen = [c.gpu for c in summary.role_changes]
        seen += [g for n in summary.lost_nodes for g in n.gpus]
        node_of = {g: None for g in range(max(seen) + 1 if seen else 0)}
    extra = {c.gpu for c in summary.role_changes} - set(node_of)
    for g in sorted(extra):
        node_of[g] = None
    return sorted(node_of), node_of


class _Marks:
    """Labelled intervals, found by overlap quickly (sorted by start; the longest is known)."""

    def __init__(self, marks: Iterable[tuple[float, float, str, int]] = ()) -> None:
        self.items = sorted(m for m in marks if m[1] > m[0])
        self.starts = [m[0] for m in self.items]
        self.longest = max((m[1] - m[0] for m in self.items), default=0.0)

    def overlapping(self, start: float, end: float) -> list[tuple[float, float, str, int]]:
        lo = bisect.bisect_left(self.starts, start - self.longest)
        hi = bisect.bisect_left(self.starts, end)
        return [m for m in self.items[lo:hi] if m[1] > start and m[0] < end]


def tile(start: float, end: float, base: str, marks: Iterable[tuple[float, float, str, int]]) -> tuple[Part, ...]:
    """[start, end] cut into parts: each piece takes the category of the highest-priority mark
    over it, else `base`. The parts tile [start, end] exactly (same boundary floats)."""
    marks = [(max(s, start), min(e, end), c, p) for s, e, c, p in marks if e > start and s < end]
    if not marks:
        return (Part(start, end, base),)
    cuts = sorted({start, end, *(m[0] for m in marks), *(m[1] for m in marks)})
    parts: list[Part] = []
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        best, prio = base, -1
        for s, e, c, p in marks:
            if s <= mid < e and p > prio:
                best, prio = c, p
        if parts and parts[-1].category == best:
            parts[-1] = Part(parts[-1].start, b, best)
        else:
            parts.append(Part(a, b, best))
    return tuple(parts)


def step_phases(records: list[StepRow]) -> list[tuple[StepRow, list[Span], float]]:
    """Each step's phases as spans, one after another (a step starts no earlier than the last
    one ended), with the time its version was published (the end of its cache build)."""
    out = []
    prev_end = -math.inf
    for r in sorted((r for r in records if r.finished_at is not None), key=lambda r: _num(r.finished_at)):
        finished = _num(r.finished_at)
        t = max(finished - _num(r.step_s), prev_end)
        spans = []
        for name, keys in STEP_PHASES:
            keys = keys if isinstance(keys, tuple) else (keys,)
            dur = sum(max(0.0, _num(getattr(r, k))) for k in keys)
            if dur > 0:
                spans.append(Span(t, t + dur, name, {"step": r.step}))
            t += dur
            if name == "cache":
                published = t
        sync = max(0.0, _num(r.sync_s))
        if sync > 0:
            spans.append(Span(t, t + sync, "sync", {"step": r.step}))
        prev_end = max(t + sync, t + max(0.0, _num(r.release_s)))
        out.append((r, spans, published))
    return out


def build_timeline(summary: RunSummary | Mapping[str, Any]) -> Timeline:
    """The timeline of a run from its summary (`rlix run`'s summary.json, or the simulator's
    of the same shape; JSON data is validated as a RunSummary): `role_changes`, `lost_nodes`,
    `run` and per pipeline `records` and `events`."""
    summary = RunSummary.coerce(summary)
    start, end = run_span(summary)
    gpus, node_of = run_gpus(summary)
    changes = sorted((dict(c.model_dump(), reason=c.reason or infer_reason(c.before, c.after))
                      for c in summary.role_changes),
                     key=lambda c: (_num(c["at"]), c["seq"]))
    lost_logged = {c["gpu"] for c in changes if c["reason"] == "lost"}
    for node in summary.lost_nodes:  # an idle GPU that left has no role-log entry
        for g in node.gpus:
            if g not in lost_logged:
                changes.append({"seq": 0, "at": _num(node.at), "gpu": g, "before": "",
                                "after": "lost", "reason": "lost"})
    changes.sort(key=lambda c: (_num(c["at"]), c["seq"]))

    pipelines: list[str] = []

    def seen(name: str | None) -> None:
        if name is not None and name not in pipelines:
            pipelines.append(name)

    for name in summary.pipelines:  # the config's order first
        seen(name)
    for c in changes:
        for role in (c["before"], c["after"]):
            if role and role not in FREE:
                seen(parse_role(role)[0])

    # what each pipeline's records and events say, as marks
    phases: dict[str, list[Span]] = {p: [] for p in pipelines}
    shard_spans: dict[str, list[Span]] = {p: [] for p in pipelines}
    instants: dict[str, list[Instant]] = {p: [] for p in pipelines}
    train_marks: dict[str, _Marks] = {}
    rank_marks: dict[tuple[str, int], list[tuple[float, float, str, int]]] = {}
    sleeps: dict[tuple[str, int], list[tuple[float, float, str, int]]] = {}
    activations: dict[tuple[str, int], list[float]] = {}
    has_events: set[str] = set()
    has_records: set[str] = set()
    for name, p in summary.pipelines.items():
        marks = []
        for r, spans, published in step_phases(p.records):
            has_records.add(name)
            phases[name].extend(spans)
            marks += [(s.start, s.end, PHASE_CATEGORY[s.name], _STEP) for s in spans
                      if s.name in PHASE_CATEGORY]
            if r.step is not None:
                instants[name].append(Instant(published, f"v{r.step}", {
                    "version": r.step, "reward": r.reward}, "version"))
        train_marks[name] = _Marks(marks)
        for e in p.events:
            at, kind, ranks, version = _num(e.at), e.kind, e.ranks, e.version
            seconds = max(0.0, _num(e.seconds))
            has_events.add(name)
            args = {"ranks": ranks, "version": version, "seconds": seconds}
            if seconds > 0:
                shard_spans[name].append(Span(at - seconds, at, kind, args))
            else:
                instants[name].append(Instant(at, kind, args))
            for r in ranks:
                key = (name, r)
                if kind in SYNC_EVENTS and seconds > 0:
                    rank_marks.setdefault(key, []).append((at - seconds, at, "sync", _SYNC))
                elif kind in SWITCH_EVENTS and seconds > 0:
                    rank_marks.setdefault(key, []).append((at - seconds, at, "switch", _SWITCH))
                if kind == "sleep" and seconds > 0:
                    sleeps.setdefault(key, []).append((at - seconds, at, "switch", _PREV_SLEEP))
                if kind in ACTIVATING:
                    activations.setdefault(key, []).append(at)
    for v in activations.values():
        v.sort()
    for v in instants.values():
        v.sort(key=lambda i: i.at)
    for v in shard_spans.values():
        v.sort(key=lambda s: (s.start, s.end))

    def classify(gpu: int, t0: float, t1: float, role: str, reason: str, prev: str) -> Holding:
        pipeline, kind, rank = parse_role(role)
        if pipeline is None:
            return Holding(gpu, t0, t1, role, reason, None, kind, None, (Part(t0, t1, kind),))
        marks: list[tuple[float, float, str, int]] = []
        prev_pipeline, prev_kind, prev_rank = parse_role(prev) if prev else (None, "idle", None)
        if prev_pipeline is not None and prev_kind == "generate":  # its shard sleeps on our time
            marks += sleeps.get((prev_pipeline, prev_rank), [])
        if kind == "generate":
            marks += rank_marks.get((pipeline, rank), [])
            base = "generate"
            if pipeline in has_events:
                acts = activations.get((pipeline, rank), [])
                i = bisect.bisect_left(acts, t0)
                if i < len(acts) and acts[i] < t1:
                    active = acts[i]
                elif i > 0 and acts[i - 1] >= t0 - ACTIVATION_SLACK_S:
                    active = t0  # activated as the scheduler's clock says it got the GPU
                else:
                    active = t1  # never served here
                if active > t0:
                    marks.append((t0, active, "switch", _BASE))
        else:
            base = "waiting" if pipeline in has_records else "train"
            marks += train_marks[pipeline].overlapping(t0, t1) if pipeline in train_marks else []
        return Holding(gpu, t0, t1, role, reason, pipeline, kind, rank, tile(t0, t1, base, marks))

    holdings: dict[int, list[Holding]] = {}
    by_gpu: dict[int, list[dict]] = {}
    for c in changes:
        by_gpu.setdefault(int(c["gpu"]), []).append(c)
    for g in gpus:
        own = by_gpu.get(g, [])
        state = (own[0]["before"] or "idle") if own else "idle"
        reason, since, prev, out = "", start, "", []
        for c in own:
            t = min(max(_num(c["at"]), start), end)
            # a lost GPU stays lost (its holdings leave the ledger as "idle")
            lost = c["reason"] == "lost" or (state == "lost" and c["after"] == "idle")
            after = "lost" if lost else c["after"]
            if t > since:
                out.append(classify(g, since, t, state, reason, prev))
                since, prev = t, state
            state, reason = after, c["reason"]
        if end > since or not out:
            out.append(classify(g, since, max(end, since), state, reason, prev))
        holdings[g] = out
    return Timeline(start, end, gpus, node_of, holdings, pipelines, phases, shard_spans, instants,
                    changes)
