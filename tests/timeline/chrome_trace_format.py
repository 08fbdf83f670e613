"""A small validator of the Chrome trace event format (the JSON object form that chrome://tracing
and ui.perfetto.dev load), for the phases a trace may hold, plus what viewers need to draw one
correctly: complete events on one thread nest and never partly overlap, and every process and
thread that has events is named."""

from __future__ import annotations

import json
import math
from numbers import Real
from typing import Any

PHASES = {"B", "E", "X", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D", "M",
          "R", "c", "(", ")"}
METADATA = {"process_name": ("name", str), "process_labels": ("labels", str),
            "process_sort_index": ("sort_index", int), "thread_name": ("name", str),
            "thread_sort_index": ("sort_index", int)}
INSTANT_SCOPES = {"g", "p", "t"}
TOLERANCE_US = 1e-3


class TraceFormatError(AssertionError):
    pass


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def validate(trace: Any) -> None:
    """Raise TraceFormatError naming the first event that breaks the format."""
    try:
        json.dumps(trace, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"not strict JSON: {exc}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceFormatError("the object form needs a traceEvents list")
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        raise TraceFormatError(f"displayTimeUnit {trace['displayTimeUnit']!r} is not ms or ns")
    if "otherData" in trace and not isinstance(trace["otherData"], dict):
        raise TraceFormatError("otherData must be an object")
    named_pids, named_threads = set(), set()
    used: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for i, e in enumerate(trace["traceEvents"]):
        where = f"event {i} ({e!r:.160})"
        if not isinstance(e, dict):
            raise TraceFormatError(f"{where}: not an object")
        ph = e.get("ph")
        if ph not in PHASES:
            raise TraceFormatError(f"{where}: ph {ph!r} is not an event phase")
        if not isinstance(e.get("name"), str):
            raise TraceFormatError(f"{where}: needs a string name")
        if not _is_int(e.get("pid")) or not _is_int(e.get("tid", 0)):
            raise TraceFormatError(f"{where}: pid and tid must be integers")
        if "cat" in e and not isinstance(e["cat"], str):
            raise TraceFormatError(f"{where}: cat must be a string")
        if "args" in e and not isinstance(e["args"], dict):
            raise TraceFormatError(f"{where}: args must be an object")
        if ph == "M":
            if e["name"] not in METADATA:
                raise TraceFormatError(f"{where}: unknown metadata event {e['name']!r}")
            key, kind = METADATA[e["name"]]
            value = e.get("args", {}).get(key)
            if not (isinstance(value, str) if kind is str else _is_int(value)):
                raise TraceFormatError(f"{where}: args.{key} must be a {kind.__name__}")
            if e["name"] == "process_name":
                named_pids.add(e["pid"])
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            continue
        if not _is_number(e.get("ts")):
            raise TraceFormatError(f"{where}: ts must be a number (microseconds)")
        if ph == "X":
            if not _is_number(e.get("dur")) or e["dur"] < 0:
                raise TraceFormatError(f"{where}: a complete event needs dur >= 0")
            used.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], i))
        elif ph in ("i", "I"):
            if e.get("s", "t") not in INSTANT_SCOPES:
                raise TraceFormatError(f"{where}: instant scope s must be g, p or t")
            used.setdefault((e["pid"], e["tid"]), [])
        elif ph == "C" and not isinstance(e.get("args"), dict):
            raise TraceFormatError(f"{where}: a counter needs args")
        else:
            used.setdefault((e["pid"], e["tid"]), [])
    for (pid, tid), spans in used.items():
        if pid not in named_pids:
            raise TraceFormatError(f"pid {pid} has events but no process_name")
        if (pid, tid) not in named_threads:
            raise TraceFormatError(f"pid {pid} tid {tid} has events but no thread_name")
        check_nesting(spans, f"pid {pid} tid {tid}")


def check_nesting(spans: list[tuple[float, float, int]], where: str) -> None:
    """Complete events on one thread: each either inside the enclosing one or after it."""
    stack: list[tuple[float, float, int]] = []
    for start, end, i in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and start >= stack[-1][1] - TOLERANCE_US:
            stack.pop()
        if stack and end > stack[-1][1] + TOLERANCE_US:
            raise TraceFormatError(f"{where}: event {i} [{start}, {end}] partly overlaps event "
                                   f"{stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}]")
        stack.append((start, end, i))
