"""Two GRPO pipelines time-shared on 2 fake GPUs vs the same two each pinned to one GPU.

Same config, same seeds, one process, back to back: `rlix run` in mode rlix (the scheduler moves
both GPUs between the pipelines and between training and generation) and in mode standalone
(pipeline i keeps GPU i: its shard and its trainer). On CPU the fake GPUs share the same cores,
so this measures what the control plane costs, not GPU packing:

  timeshared_vs_pinned     total train steps per hour, time-shared / pinned (goal >= 0.9)
  tokens_ratio             total rollout tokens per second, time-shared / pinned
  control_plane_fraction   time-shared, on each step's critical path, over the step's wall
                           time, summed over steps (goal <= 0.1): the sleeps of the shards
                           moved off the GPUs it trains on (while it waits for them), the
                           release and the refit of active shards, and the wake and sync of its
                           shards while it has none active and waits for its next batch
                           (`control_plane_ms_per_step` splits it). The rest of the wait for
                           GPUs is contention (the other pipeline training there).
  control_plane_upper      every sleep, wake and sync of both pipelines, on the path or not
                           (most overlap the other pipeline's work), over the same total.
Per step, where the wall time went (mean seconds): generate, wait for GPUs, train, cache
build, offload, release, sync (release and sync run together, from the end of offload).
With --rounds N the pair runs N times, alternating which mode goes first, and the figures are
pooled (total steps over total time): the machine's drift between runs falls on both modes.

    .venv/bin/python bench/pipelines_cpu.py [--config examples/two_pipelines.yaml] [--steps N]
                                            [--rounds N] [--keep raw.json]
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

PHASES = ("generate_s", "wait_gpus_s", "reload_s", "train_s", "cache_s", "offload_s", "release_s", "sync_s")


def one_run(cfg: dict, mode: str, workdir: Path) -> dict:
    from rlix.run import run

    workdir.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, run_dir=str(workdir / mode))
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    result = run(str(path), mode=mode, out=sys.stderr)
    result["measured_s"] = time.perf_counter() - t0
    return result


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [a, b) intervals (overlapping control operations count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def clip(a: float, b: float, w0: float, w1: float) -> tuple[float, float]:
    return max(a, w0), min(b, w1)


def idle_windows(events: list, until: float) -> list[tuple[float, float]]:
    """When a pipeline had no active shard: from a sleep's start (the shard is marked preempted
    first) with nothing active left, to the next activation."""
    active: set[int] = set()
    out, since = [], None
    for at, kind, ranks, _, secs in sorted(events, key=lambda e: e[0] - e[4]):
        if kind == "sleep":
            active -= set(ranks)
            if not active and since is None:
                since = at - secs
        elif kind == "activate":
            if since is not None:
                out.append((since, at))
                since = None
            active |= set(ranks)
    if since is not None:
        out.append((since, until))
    return out


def shrunk_for(result: dict, name: str, w0: float, w1: float) -> list[tuple[str, int]]:
    """(pipeline, dp rank) of the shards the scheduler moved off the GPUs it gave `name` for
    training in [w0, w1], from the role log; without one (standalone), `name`'s own shards."""
    if result.get("mode") == "standalone":
        return [(name, -1)]
    changes = result.get("role_changes") or []
    out = []
    for c in changes:
        if c["after"] == f"{name}/train" and w0 - 0.05 <= c["at"] <= w1 + 0.05 and "/generate#" in c["before"]:
            owner, rank = c["before"].split("/generate#")
            out.append((owner, int(rank)))
    return out


def on_path_s(result: dict) -> tuple[float, dict[str, float]]:
    """Control-plane seconds on the steps' critical path, summed over steps, and per kind.

    Per step, the union of: the sleeps of the shards that had to leave the GPUs the step
    trains on (inside its wait for them); the release call and the refit of active shards
    (they run together); and, inside the wait for the next batch while the pipeline has no
    active shard, its shards' wake and sync (bringing a shard back is what that wait is
    waiting for). Pinned pipelines wake inside their release call; time-shared ones after it,
    through the scheduler: both are counted."""
    pipes = result["pipelines"]
    total, kinds = 0.0, {"sleep": 0.0, "release_refit": 0.0, "wake_sync": 0.0}
    for name, p in pipes.items():
        end = max(r["finished_at"] for r in p["records"])
        idle = idle_windows(p["events"], end)
        bring_up = [(at - secs, at) for at, kind, _, _, secs in p["events"] if kind in ("wake", "sync")]
        for r in p["records"]:
            start = r["finished_at"] - r["step_s"]
            g1 = start + r["generate_s"]
            w1 = g1 + r["wait_gpus_s"]
            sleeps = [(at - secs, at) for owner, rank in shrunk_for(result, name, g1, w1)
                      for at, kind, ranks, _, secs in pipes[owner]["events"]
                      if kind == "sleep" and (rank < 0 or rank in ranks)]
            off = r["finished_at"] - r["sync_s"]  # release and refit both start here
            parts = {
                "sleep": [clip(a, b, g1, w1) for a, b in sleeps],
                "release_refit": [(off, r["finished_at"])],
                "wake_sync": [clip(*clip(a, b, start, g1), i0, i1) for a, b in bring_up
                              for i0, i1 in idle],
            }
            for k, iv in parts.items():
                kinds[k] += union_s(iv)
            total += union_s([i for iv in parts.values() for i in iv])
    return total, kinds


def figures(result: dict) -> dict:
    """One run's sums (pooled over rounds by `pooled`)."""
    pipes = result["pipelines"].values()
    records = [r for p in pipes for r in p["records"]]
    # the span in which steps ran: from the first pipeline's first step start to the last end
    ends = [r["finished_at"] for r in records]
    starts = [r["finished_at"] - r["step_s"] for r in records]
    on_path, kinds = on_path_s(result)
    return {
        "steps": len(records), "span_s": max(ends) - min(starts),
        "tokens": sum(p["collector"].get("tokens", 0) for p in pipes),
        "step_time_s": sum(r["step_s"] for r in records), "on_path_s": on_path, "kinds_s": kinds,
        "control_s": sum(p["sync_s"] + p["sleep_s"] + p["wake_s"] for p in pipes) + sum(
            r["release_s"] for r in records),
        "wait_s": sum(r["wait_gpus_s"] for r in records),
        "phase_sums": {k: sum(r[k] for r in records) for k in PHASES},
        "rewards_gain": {n: round(p["reward_last5"] - p["reward_first5"], 3)
                         for n, p in result["pipelines"].items()},
        "dropped": {n: p["accounting"].get("dropped", {}) for n, p in result["pipelines"].items()},
    }


def pooled(runs: list[dict]) -> dict:
    """Throughput and fractions over all runs of one mode: total steps over total span, etc."""
    tot = lambda k: sum(r[k] for r in runs)  # noqa: E731
    steps, span, step_time = tot("steps"), tot("span_s"), tot("step_time_s")
    return {
        "steps_per_hour": steps / span * 3600, "tokens_per_s": tot("tokens") / span,
        "control_plane_fraction": tot("on_path_s") / step_time,
        "control_plane_ms_per_step": {k: round(sum(r["kinds_s"][k] for r in runs) / steps * 1000, 1)
                                      for k in runs[0]["kinds_s"]},
        "control_plane_upper": tot("control_s") / step_time,
        "wait_gpus_fraction": tot("wait_s") / step_time,
        "phases": {k: round(sum(r["phase_sums"][k] for r in runs) / steps, 3) for k in PHASES},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "two_pipelines.yaml"))
    ap.add_argument("--steps", type=int, default=None, help="override every pipeline's steps")
    ap.add_argument("--max-shards", type=int, default=None, help="override every pipeline's max_shards")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the pair this many times, alternating which mode goes first "
                         "(2: time-shared, pinned, pinned, time-shared), and pool the figures")
    ap.add_argument("--keep", default=None, help="write every run's raw summary to this JSON file")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    for p in cfg["pipelines"]:
        if args.steps:
            p["steps"] = args.steps
        if args.max_shards:
            p["max_shards"] = args.max_shards
            p["min_shards"] = min(p.get("min_shards", 1), args.max_shards)
    import ray

    t0 = time.perf_counter()
    raw: dict[str, list[dict]] = {"rlix": [], "standalone": []}
    with tempfile.TemporaryDirectory(prefix="rlix-bench-") as tmp, \
            Bench("pipelines_cpu", total=2 * args.rounds) as bench:
        for i in range(args.rounds):
            order = ("rlix", "standalone") if i % 2 == 0 else ("standalone", "rlix")
            for mode in order:
                bench.phase(f"round {i + 1}: {'time-shared' if mode == 'rlix' else 'pinned'} ({mode})")
                with bench.aside():  # the run draws its own bars
                    raw[mode].append(one_run(cfg, mode, Path(tmp) / f"round{i}"))
                    ray.shutdown()
                bench.advance()
    if args.keep:
        Path(args.keep).write_text(json.dumps(raw, default=str))
    runs = {mode: [figures(r) for r in rs] for mode, rs in raw.items()}
    shared, pinned = pooled(runs["rlix"]), pooled(runs["standalone"])
    per_round = [round((a["steps"] / a["span_s"]) / (b["steps"] / b["span_s"]), 3)
                 for a, b in zip(runs["rlix"], runs["standalone"])]
    out = {
        "timeshared_vs_pinned": round(shared["steps_per_hour"] / pinned["steps_per_hour"], 3),
        "timeshared_vs_pinned_per_round": per_round,
        "tokens_ratio": round(shared["tokens_per_s"] / pinned["tokens_per_s"], 3),
        "control_plane_fraction": round(shared["control_plane_fraction"], 4),
        "control_plane_per_round": [round(r["on_path_s"] / r["step_time_s"], 4) for r in runs["rlix"]],
        "control_plane_ms_per_step": shared["control_plane_ms_per_step"],
        "control_plane_upper": round(shared["control_plane_upper"], 4),
        "pinned_control_plane_fraction": round(pinned["control_plane_fraction"], 4),
        "wait_gpus_fraction": round(shared["wait_gpus_fraction"], 4),
        "timeshared_steps_per_hour": round(shared["steps_per_hour"], 1),
        "pinned_steps_per_hour": round(pinned["steps_per_hour"], 1),
        "timeshared_tokens_per_s": round(shared["tokens_per_s"], 1),
        "pinned_tokens_per_s": round(pinned["tokens_per_s"], 1),
        "timeshared_phases_s": shared["phases"], "pinned_phases_s": pinned["phases"],
        "timeshared_reward_gain": [r["rewards_gain"] for r in runs["rlix"]],
        "pinned_reward_gain": [r["rewards_gain"] for r in runs["standalone"]],
        "timeshared_dropped": [r["dropped"] for r in runs["rlix"]],
        "rounds": args.rounds, "wall_s": round(time.perf_counter() - t0, 1),
    }
    for k, v in out.items():
        print(f"{k:32s} {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
