"""A timeline as a Chrome trace (the JSON object format: chrome://tracing, ui.perfetto.dev).

Processes: one per node ("node N"; "GPUs" when the nodes are not known) with one thread per
GPU, and one "pipelines" process with, per pipeline, a thread for its steps' phases (weight
versions are instant events there) and as many threads for its shard events as they need to
never overlap. On a GPU's thread every holding is a complete ("X") event (idle ones too, so
the thread tiles the run), with its parts nested inside it, and every role change an instant
("i") event named by its reason. Times are microseconds since the run started
(`otherData.started_at` is that moment in Unix seconds).
"""

from __future__ import annotations

from typing import Any

from rlix.timeline.model import Span, Timeline

GPU_CATEGORY = "gpu"  # a holding (cat "gpu") and its parts (cat "gpu part")


def _lanes(spans: list[Span]) -> list[list[Span]]:
    """Spans placed on as few lanes as possible with no two on one lane overlapping."""
    lanes: list[list[Span]] = []
    ends: list[float] = []
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        for i, end in enumerate(ends):
            if s.start >= end:
                lanes[i].append(s)
                ends[i] = s.end
                break
        else:
            lanes.append([s])
            ends.append(s.end)
    return lanes


def chrome_trace(tl: Timeline, title: str = "") -> dict[str, Any]:
    def us(t: float) -> float:
        return round((min(max(t, tl.start), tl.end) - tl.start) * 1e6, 3)

    events: list[dict[str, Any]] = []

    def meta(name: str, pid: int, tid: int | None, args: dict[str, Any]) -> None:
        e: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": args}
        e["tid"] = 0 if tid is None else tid
        events.append(e)

    def complete(pid: int, tid: int, name: str, cat: str, start: float, end: float,
                 args: dict[str, Any]) -> None:
        ts = us(start)
        events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts,
                       "dur": round(us(end) - ts, 3), "args": args})

    def instant(pid: int, tid: int, name: str, cat: str, at: float, args: dict[str, Any]) -> None:
        events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": pid, "tid": tid,
                       "ts": us(at), "args": args})

    nodes = sorted({n for n in tl.node_of.values() if n is not None})
    pid_of = {n: i + 1 for i, n in enumerate(nodes)}
    unknown = len(nodes) + 1
    for n, pid in pid_of.items():
        meta("process_name", pid, None, {"name": f"node {n}"})
        meta("process_sort_index", pid, None, {"sort_index": pid})
    if any(n is None for n in tl.node_of.values()):
        meta("process_name", unknown, None, {"name": "GPUs"})
        meta("process_sort_index", unknown, None, {"sort_index": unknown})
    for g in tl.gpus:
        node = tl.node_of.get(g)
        pid = unknown if node is None else pid_of[node]
        tid = g + 1
        meta("thread_name", pid, tid, {"name": f"GPU {g}"})
        meta("thread_sort_index", pid, tid, {"sort_index": tid})
        for h in tl.holdings[g]:
            complete(pid, tid, h.label, GPU_CATEGORY, h.start, h.end,
                     {"gpu": g, "node": node, "role": h.role, "pipeline": h.pipeline,
                      "reason": h.reason or "at start"})
            for part in h.parts:
                complete(pid, tid, part.category, f"{GPU_CATEGORY} part", part.start, part.end,
                         {"gpu": g, "pipeline": h.pipeline, "category": part.category})
    for c in tl.changes:
        g = int(c["gpu"])
        if g not in tl.node_of:
            continue
        node = tl.node_of[g]
        pid = unknown if node is None else pid_of[node]
        instant(pid, g + 1, c["reason"], "role change", float(c["at"]),
                {"gpu": g, "before": c["before"], "after": c["after"], "seq": c.get("seq")})

    ppid = unknown + 1
    meta("process_name", ppid, None, {"name": "pipelines"})
    meta("process_sort_index", ppid, None, {"sort_index": ppid})
    tid = 0
    for p in tl.pipelines:
        tid += 1
        steps_tid = shard_tid = tid
        meta("thread_name", ppid, tid, {"name": f"{p} steps"})
        meta("thread_sort_index", ppid, tid, {"sort_index": tid})
        for s in tl.phases.get(p, []):
            complete(ppid, tid, s.name, "phase", s.start, s.end, {"pipeline": p, **s.args})
        for i, lane in enumerate(_lanes(tl.shard_spans.get(p, [])) or [[]]):
            tid += 1
            if not i:
                shard_tid = tid
            meta("thread_name", ppid, tid, {"name": f"{p} shards" + (f" ({i + 1})" if i else "")})
            meta("thread_sort_index", ppid, tid, {"sort_index": tid})
            for s in lane:
                complete(ppid, tid, f"{s.name} {list(s.args.get('ranks', []))}", "shard", s.start,
                         s.end, {"pipeline": p, "kind": s.name, **s.args})
        for i in tl.instants.get(p, []):
            instant(ppid, steps_tid if i.cat == "version" else shard_tid, i.name, i.cat, i.at,
                    {"pipeline": p, **i.args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": title, "started_at": tl.start, "ended_at": tl.end,
                          "span_s": tl.span_s, "gpus": len(tl.gpus)}}
