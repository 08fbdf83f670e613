"""The figures of bench/timeshare_gpu.py, read from `rlix run` summaries (pure: no Ray, no I/O).

- `ratios`: makespan(partition or queue) / makespan(time-shared): above 1, time-sharing ended first.
- `account`: the GPU-time account of one or more runs (`summary["gpu_account"]`, summed), as
  GPU-seconds and shares of all GPU-seconds, with the account's "switch" split in two:
  `shard_switch` (shards put to sleep, woken, started: what a move of a shard costs) and
  `trainer_switch` (trainer reloads and offloads, the step phases on its GPUs).
- `shard_starts`: shard processes started after each pipeline's set-up ended (coordinator events
  "start" and "replace", one per rank), and how many of them were a rank's second or later
  process (a restart: a shard moved to other GPUs, or replaced).
- `move_costs`: the measured cost of each kind of move, medians; `cost_table`: them as the cost
  table `rlix.scheduler.costs.load_move_costs` reads (`scheduler: {move_costs: PATH}`, `rlix sim`).
- `unfinished`: the pipelines of a run that did not finish all their steps.

A pipeline's set-up is taken to have ended when its first step began (its loop starts as its
set-up returns); a pipeline without a step has not finished set-up.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from rlix.timeline import build_timeline

#: the account's held categories, and what nobody held
HELD = ("generate", "train", "sync", "switch", "waiting")
FREE = ("idle", "lost")
#: step phases on a trainer's GPUs that the account counts as switch
TRAINER_SWITCH_PHASES = ("reload", "offload")
#: the moves whose costs are measured (move_costs.json's keys, rlix.scheduler.costs.MoveCosts' fields)
MOVES = ("sleep_s", "wake_sync_s", "sync_s", "recapture_s", "trainer_reload_s", "trainer_offload_s",
         "cold_start_s")


def ratios(workload: str, makespans: Mapping[str, float | None]) -> dict[str, float]:
    """`<workload>_timeshared_vs_<mode>` = makespan(mode) / makespan(timeshared), for the
    modes measured (partition, queue)."""
    ts = makespans.get("timeshared")
    out = {}
    for mode in ("partition", "queue"):
        other = makespans.get(mode)
        if ts and other:
            out[f"{workload}_timeshared_vs_{mode}"] = round(other / ts, 3)
    return out


def first_step_start(pipeline: Mapping[str, Any]) -> float:
    """Wall-clock start of a pipeline's first step (its set-up's end); inf without steps."""
    starts = [r["finished_at"] - r.get("step_s", 0.0) for r in pipeline.get("records", [])
              if r.get("finished_at") is not None]
    return min(starts, default=math.inf)


def startup_s(summary: Mapping[str, Any], launched_at: float) -> float | None:
    """Seconds from launching `rlix run` to the first step of any pipeline (Ray, set-up)."""
    first = min((first_step_start(p) for p in summary.get("pipelines", {}).values()), default=math.inf)
    return None if math.isinf(first) else round(first - launched_at, 2)


def shard_starts(summary: Mapping[str, Any]) -> dict[str, Any]:
    """Shard process starts of a run, by each pipeline's set-up end: `after_setup` (the bench's
    figure), `during_setup`, `restarts` (after set-up, of a rank that already had a process in
    this run), and `after_setup` per pipeline."""
    after = during = restarts = 0
    per: dict[str, int] = {}
    for name, p in summary.get("pipelines", {}).items():
        setup_end = first_step_start(p)
        seen: set[int] = set()
        n = 0
        for e in sorted(p.get("events", []), key=lambda e: e[0]):
            if e[1] not in ("start", "replace"):
                continue
            for rank in e[2]:
                if e[0] > setup_end:
                    n += 1
                    restarts += rank in seen
                else:
                    during += 1
                seen.add(rank)
        per[name] = n
        after += n
    return {"after_setup": after, "during_setup": during, "restarts": restarts, "per_pipeline": per}


def _overlap(a0: float, a1: float, spans: Iterable[tuple[float, float]]) -> float:
    return math.fsum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def switch_split(summary: Mapping[str, Any]) -> tuple[float, float]:
    """The account's switch GPU-seconds of a run as (shards, trainers): a trainer's reload and
    offload on its GPUs are the trainer's; the rest (a shard starting, waking, or put to sleep
    on a GPU, its own or the GPU's next holder's) the shards'."""
    tl = build_timeline(summary)
    moves = {p: [(s.start, s.end) for s in spans if s.name in TRAINER_SWITCH_PHASES]
             for p, spans in tl.phases.items()}
    shard = trainer = 0.0
    for holdings in tl.holdings.values():
        for h in holdings:
            if h.pipeline is None:
                continue
            for part in h.parts:
                if part.category != "switch":
                    continue
                d = part.end - part.start
                t = _overlap(part.start, part.end, moves.get(h.pipeline, [])) if h.kind == "train" else 0.0
                trainer += min(t, d)
                shard += d - min(t, d)
    return shard, trainer


def account(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """GPU-seconds by category over the runs (their accounts summed) and each as a share of all
    GPU-seconds; `switch_share` counts the shards' moves only (sleep, wake, start),
    `trainer_switch_share` the trainers' reloads and offloads. None without an account (a run
    in standalone mode has no scheduler, so nobody is known to have held a GPU)."""
    total: dict[str, float] = {c: 0.0 for c in (*HELD, *FREE, "gpu_s", "shard_switch", "trainer_switch")}
    n = 0
    for s in summaries:
        acc = s.get("gpu_account")
        if not acc or not acc.get("role_changes"):
            continue
        n += 1
        total["gpu_s"] += acc["gpu_s"]
        for c in FREE:
            total[c] += acc.get(f"{c}_s", 0.0)
        for row in acc["pipelines"].values():
            for c in HELD:
                total[c] += row.get(c, 0.0)
        shard, trainer = switch_split(s)
        total["shard_switch"] += shard
        total["trainer_switch"] += trainer
    if not n or not total["gpu_s"]:
        return None
    gpu_s = total["gpu_s"]
    return {"runs": n, "gpu_s": round(gpu_s, 2),
            "seconds": {c: round(v, 2) for c, v in total.items() if c != "gpu_s"},
            "shares": {c: round(total[c] / gpu_s, 4) for c in (*HELD, *FREE)},
            "switch_share": round(total["shard_switch"] / gpu_s, 4),
            "trainer_switch_share": round(total["trainer_switch"] / gpu_s, 4),
            "idle_share": round(total["idle"] / gpu_s, 4)}


def device_idle_share(trace: Mapping[str, Any], slices: int) -> float | None:
    """Of a run's physical GPU-seconds, those in which no slice of the device was held (its
    timeline.json: each slice's role spans). The account counts a slice as a GPU, so a device
    with one slice training and the other idle is half idle there; here it is busy. None
    without spans."""
    span_s = float(trace.get("otherData", {}).get("span_s") or 0.0)
    busy: dict[int, list[tuple[float, float]]] = {}
    slots: set[int] = set()
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "gpu":
            continue
        gpu = int(e["args"]["gpu"])
        slots.add(gpu)
        if e["args"].get("role") != "idle":
            t0 = float(e["ts"]) / 1e6
            busy.setdefault(gpu // slices, []).append((t0, t0 + float(e["dur"]) / 1e6))
    devices = {g // slices for g in slots}
    if not devices or span_s <= 0:
        return None
    idle = 0.0
    for d in devices:
        held, end = 0.0, float("-inf")
        for a, b in sorted(busy.get(d, [])):  # length of the union of the device's busy spans
            a = max(a, end)
            if b > a:
                held += b - a
                end = b
        idle += max(0.0, span_s - held)
    return round(idle / (span_s * len(devices)), 4)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def move_samples(summary: Mapping[str, Any]) -> dict[str, list[float]]:
    """Every measured move of one run, in seconds, by kind:
    - sleep_s: a shard put to sleep (coordinator "sleep" events; one call may sleep several ranks);
    - wake_sync_s: a sleeping shard brought back: its wake, sync and GPU-side sync seconds since
      it last slept, up to its activation (not after a process start: that is a cold start);
    - sync_s: the sync and GPU-side sync part of the same;
    - recapture_s: CUDA graphs captured again after a wake (a shard process's cumulative capture
      time, between two of its sleeps: its memory log's release rows);
    - cold_start_s: a shard process started after set-up, from the scheduler's grant of the
      rank's GPU (the role log) to the start's end;
    - trainer_reload_s, trainer_offload_s: each step's (StepRecord)."""
    out: dict[str, list[float]] = {k: [] for k in MOVES}
    grants: dict[str, list[float]] = {}
    for c in summary.get("role_changes", []):
        if "/generate#" in c.get("after", ""):
            grants.setdefault(c["after"], []).append(float(c["at"]))
    for name, p in summary.get("pipelines", {}).items():
        setup_end = first_step_start(p)
        for r in p.get("records", []):
            if r.get("reload_s", 0.0) > 0:
                out["trainer_reload_s"].append(r["reload_s"])
            if r.get("offload_s", 0.0) > 0:
                out["trainer_offload_s"].append(r["offload_s"])
        asleep: dict[int, float] = {}  # rank -> bring-up seconds so far (present: sleeping)
        synced: dict[int, float] = {}  # rank -> the sync part of it
        cold: set[int] = set()
        for at, kind, ranks, _version, seconds in sorted((tuple(e) + (0.0,) * (5 - len(e)))[:5]
                                                         for e in p.get("events", [])):
            if kind == "sleep":
                out["sleep_s"].append(seconds)
                for r in ranks:
                    asleep[r] = synced[r] = 0.0
                    cold.discard(r)
            elif kind in ("wake", "sync", "device_sync"):
                for r in ranks:
                    if r in asleep:
                        asleep[r] += seconds
                        synced[r] += seconds if kind != "wake" else 0.0
            elif kind == "cool":  # what was synced beside the trainer was dropped: it counts no more
                for r in ranks:
                    if r in asleep:
                        asleep[r] = synced[r] = 0.0
            elif kind == "start":
                for r in ranks:
                    cold.add(r)
                    asleep.pop(r, None)
                    if at > setup_end:
                        before = [t for t in grants.get(f"{name}/generate#{r}", []) if t <= at]
                        if before and at - max(before) < 600:
                            out["cold_start_s"].append(round(at - max(before), 4))
            elif kind == "activate":
                for r in ranks:
                    if r in asleep and r not in cold:
                        out["wake_sync_s"].append(asleep[r])
                        out["sync_s"].append(synced[r])
                    asleep.pop(r, None)
                    cold.discard(r)
        captured: dict[tuple[str, object], list[float]] = {}  # (holder, pid) -> cumulative ms at each sleep
        for row in p.get("gpu_memory", []):
            if row.get("event") == "release" and "graph_capture_ms" in row:
                captured.setdefault((row.get("holder", ""), row.get("pid")), []).append(float(row["graph_capture_ms"]))
        for ms in captured.values():
            out["recapture_s"] += [round((b - a) / 1000, 4) for a, b in zip(ms, ms[1:]) if b >= a]
    return out


def move_costs(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Median seconds of each kind of move over the runs (`move_samples`), and how many each
    median is of (`samples`)."""
    pooled: dict[str, list[float]] = {k: [] for k in MOVES}
    for s in summaries:
        for k, v in move_samples(s).items():
            pooled.setdefault(k, []).extend(v)
    return {**{k: _median(v) for k, v in pooled.items()}, "samples": {k: len(v) for k, v in pooled.items()}}


def cost_table(costs: Mapping[str, Any], about: str) -> dict[str, Any]:
    """The measured medians as a cost table (`{"costs": {...}, "about": ...}`, what
    rlix.scheduler.costs.load_move_costs reads): moves without a sample are left out (the
    table's defaults stand), and sync_s, part of wake_sync_s, is kept within it."""
    table = {k: float(costs[k]) for k in MOVES if costs.get(k) is not None}
    if "sync_s" in table and "wake_sync_s" in table:
        table["sync_s"] = min(table["sync_s"], table["wake_sync_s"])
    return {"costs": table, "about": about}


def unfinished(summary: Mapping[str, Any] | None, steps: Mapping[str, int], label: str) -> list[str]:
    """`label/pipeline` of each pipeline that did not finish its `steps` (all of them when the
    run left no summary), with why."""
    if summary is None:
        return [f"{label}/{name} (no summary)" for name in steps]
    out = []
    pipes = summary.get("pipelines", {})
    for name, want in steps.items():
        p = pipes.get(name)
        if p is None:
            out.append(f"{label}/{name} (not in the summary)")
        elif p.get("state") != "done" or int(p.get("steps", 0)) < want:
            why = p.get("error") or f"{p.get('state')}, {p.get('steps', 0)} of {want} steps"
            out.append(f"{label}/{name} ({str(why)[:160]})")
    return out
