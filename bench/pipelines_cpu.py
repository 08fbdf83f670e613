"""Two GRPO pipelines time-shared on 2 fake GPUs vs the same two each pinned to one GPU.

Same config, same seeds, one process, back to back: `rlix run` in mode rlix (the scheduler moves
both GPUs between the pipelines and between training and generation) and in mode standalone
(pipeline i keeps GPU i: its shard and its trainer). On CPU the fake GPUs share the same cores,
so this measures what the control plane costs, not GPU packing:

  timeshared_vs_pinned     total train steps per hour, time-shared / pinned (goal >= 0.9)
  tokens_ratio             total rollout tokens per second, time-shared / pinned
  control_plane_fraction   time-shared, on each step's path: preempting shards while the step
                           waits for its GPUs (sleep intervals of either pipeline inside that
                           wait) + releasing the GPUs + refitting active shards, over the step's
                           wall time, summed over steps (goal <= 0.1). The rest of the wait is
                           contention (the other pipeline training there) and scheduling.
  control_plane_upper      every sleep, wake and sync of both pipelines, on the path or not
                           (most overlap the other pipeline's work), over the same total.
Per step, where the wall time went (mean seconds): generate, wait for GPUs, train, cache
build, offload, release, sync.

    .venv/bin/python bench/pipelines_cpu.py [--config examples/two_pipelines.yaml] [--steps N]
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

PHASES = ("generate_s", "wait_gpus_s", "train_s", "cache_s", "offload_s", "release_s", "sync_s")


def one_run(cfg: dict, mode: str, workdir: Path) -> dict:
    from rlix.run import run

    cfg = dict(cfg, run_dir=str(workdir / mode))
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    result = run(str(path), mode=mode, out=sys.stderr)
    result["measured_s"] = time.perf_counter() - t0
    return result


def figures(result: dict) -> dict:
    pipes = result["pipelines"].values()
    records = [r for p in pipes for r in p["records"]]
    # the span in which steps ran: from the first pipeline's first step start to the last end
    ends = [r["finished_at"] for r in records]
    starts = [r["finished_at"] - r["step_s"] for r in records]
    span = max(ends) - min(starts)
    steps = len(records)
    tokens = sum(p["collector"].get("tokens", 0) for p in pipes)
    step_time = sum(r["step_s"] for r in records)
    control = sum(p["sync_s"] + p["sleep_s"] + p["wake_s"] for p in pipes) + sum(
        r["release_s"] for r in records)
    sleeps = [(at - secs, at) for p in pipes for at, kind, _, _, secs in p["events"] if kind == "sleep"]
    on_path = 0.0
    for r in records:
        w0 = r["finished_at"] - r["step_s"] + r["generate_s"]
        w1 = w0 + r["wait_gpus_s"]
        on_path += sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in sleeps) + r["release_s"] + r["sync_s"]
    return {
        "steps": steps, "span_s": span, "steps_per_hour": steps / span * 3600,
        "tokens_per_s": tokens / span, "rewards_gain": {
            n: round(p["reward_last5"] - p["reward_first5"], 3) for n, p in result["pipelines"].items()},
        "control_plane_fraction": on_path / step_time if step_time else 0.0,
        "control_plane_upper": control / step_time if step_time else 0.0,
        "wait_gpus_fraction": sum(r["wait_gpus_s"] for r in records) / step_time if step_time else 0.0,
        "phases": {k: round(sum(r[k] for r in records) / max(steps, 1), 3) for k in PHASES},
        "dropped": {n: p["accounting"].get("dropped", {}) for n, p in result["pipelines"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" / "two_pipelines.yaml"))
    ap.add_argument("--steps", type=int, default=None, help="override every pipeline's steps")
    ap.add_argument("--max-shards", type=int, default=None, help="override every pipeline's max_shards")
    ap.add_argument("--keep", default=None, help="write both runs' raw summaries to this JSON file")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    for p in cfg["pipelines"]:
        if args.steps:
            p["steps"] = args.steps
        if args.max_shards:
            p["max_shards"] = args.max_shards
            p["min_shards"] = min(p.get("min_shards", 1), args.max_shards)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlix-bench-") as tmp:
        raw_shared = one_run(cfg, "rlix", Path(tmp))
        import ray

        ray.shutdown()
        raw_pinned = one_run(cfg, "standalone", Path(tmp))
        ray.shutdown()
    if args.keep:
        Path(args.keep).write_text(json.dumps({"rlix": raw_shared, "standalone": raw_pinned}, default=str))
    shared, pinned = figures(raw_shared), figures(raw_pinned)
    out = {
        "timeshared_vs_pinned": round(shared["steps_per_hour"] / pinned["steps_per_hour"], 3),
        "tokens_ratio": round(shared["tokens_per_s"] / pinned["tokens_per_s"], 3),
        "control_plane_fraction": round(shared["control_plane_fraction"], 4),
        "control_plane_upper": round(shared["control_plane_upper"], 4),
        "pinned_control_plane_fraction": round(pinned["control_plane_fraction"], 4),
        "wait_gpus_fraction": round(shared["wait_gpus_fraction"], 4),
        "timeshared_steps_per_hour": round(shared["steps_per_hour"], 1),
        "pinned_steps_per_hour": round(pinned["steps_per_hour"], 1),
        "timeshared_tokens_per_s": round(shared["tokens_per_s"], 1),
        "pinned_tokens_per_s": round(pinned["tokens_per_s"], 1),
        "timeshared_phases_s": shared["phases"], "pinned_phases_s": pinned["phases"],
        "timeshared_reward_gain": shared["rewards_gain"], "pinned_reward_gain": pinned["rewards_gain"],
        "timeshared_dropped": shared["dropped"], "wall_s": round(time.perf_counter() - t0, 1),
    }
    for k, v in out.items():
        print(f"{k:28s} {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
