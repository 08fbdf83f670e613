"""Two agentic pipelines (multi-turn episodes, slow tools) time-shared vs pinned vs one after the other.

`examples/agentic_two_pipelines.yaml` with every tool call taking `--tool-latency` seconds (0.5 by
default), three ways in one invocation, same seeds:

  time-shared  mode rlix, both pipelines on the 2 fake GPUs (the scheduler moves them between the
               pipelines and between training and generation)
  pinned       mode standalone, pipeline i keeps GPU i (its shard and its trainer)
  queue        mode rlix, one pipeline at a time with both GPUs, the second after the first: what
               a cluster that gives each job its GPUs exclusively does

  agentic_timeshared_vs_queue   total steps per second of step time, time-shared / queue (goal >= 1.6)
  agentic_timeshared_vs_pinned  the same, time-shared / pinned

`--slices N` schedules every GPU as N slices (`cluster.gpu_slices`) in the time-shared and queue
runs, each pipeline with one shard: its shard and its trainer then need not take turns, and two
pipelines can be on one GPU at once while their episodes wait on tools. `--device cpu` computes on
the CPU even where CUDA is (fake GPUs on a many-core GPU host).

Throughput is counted over the steps after each pipeline's first (`--warmup`), from the end of
that first step to the end of the last (setup and first starts excluded; the queue's two spans
added). Episodes spend most of their time waiting on tools; time-sharing lets the other pipeline
generate or train meanwhile, which the queue cannot.

    .venv/bin/python bench/agentic_cpu.py [--steps N] [--tool-latency 0.5] [--slices N] [--device cpu]
                                          [--keep raw.json]
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402
from pipelines_cpu import one_run  # noqa: E402


def span(result: dict, warmup: int) -> tuple[int, float, dict]:
    """(steps, span of those steps in seconds, reward gain per pipeline) of one run: the steps
    after each pipeline's first `warmup` ones, from the end of the last warm-up step to the end
    of the last step (the first step also pays for the shards' and servers' first start)."""
    steps, start, end = 0, float("inf"), 0.0
    for p in result["pipelines"].values():
        ends = sorted(r["finished_at"] for r in p["records"])
        steps += len(ends) - warmup
        start = min(start, ends[warmup - 1] if warmup else min(r["finished_at"] - r["step_s"] for r in p["records"]))
        end = max(end, ends[-1])
    gains = {n: round(p["reward_last5"] - p["reward_first5"], 3) for n, p in result["pipelines"].items()}
    return steps, end - start, gains


def episode_stats(result: dict) -> dict:
    out = {}
    for name, p in result["pipelines"].items():
        c = p["collector"]
        out[name] = {"turns": c.get("episode_turns"), "tool_calls": c.get("tool_calls"),
                     "dropped": p["accounting"].get("dropped", {}), "env_restarts": p.get("env", {}).get("restarts")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "examples" /
                                            "agentic_two_pipelines.yaml"))
    ap.add_argument("--steps", type=int, default=12, help="every pipeline's steps")
    ap.add_argument("--tool-latency", type=float, default=0.5, help="seconds per tool call")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each pipeline left out of the rates")
    ap.add_argument("--one-gpu", action="store_true",
                    help="on a machine with CUDA: both pipelines on its one real GPU (time-shared vs queue; "
                         "no pinned mode: there is one GPU); figures named agentic_1gpu_*")
    ap.add_argument("--slices", type=int, default=1,
                    help="every GPU scheduled as this many slices (cluster.gpu_slices), so that two "
                         "pipelines' shards and trainers can be on one GPU at once, and each pipeline "
                         "keeps one shard; the queue gets the same slices (a job alone may use them "
                         "too); pinned keeps whole GPUs (one per pipeline, as a dedicated job has)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                    help="the runs' device (default: the config's); cpu on a GPU host runs fake GPUs there")
    ap.add_argument("--modes", default="timeshared,pinned,queue",
                    help="which runs, comma-separated (all three by default; the ratios need theirs)")
    ap.add_argument("--keep", default=None, help="write every run's raw summary to this JSON file")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    for p in cfg["pipelines"]:
        p["steps"] = args.steps
        p["env"] = dict(p.get("env") or {}, tool_latency_s=args.tool_latency)
    if args.device:
        cfg["device"] = args.device
    wanted = set(args.modes.split(","))
    if wanted - {"timeshared", "pinned", "queue"} or "queue" not in wanted:
        ap.error("--modes: a comma-separated subset of timeshared,pinned,queue that includes queue")
    pinned_cfg = copy.deepcopy(cfg)  # whole GPUs, pipeline i on GPU i
    if args.one_gpu:
        cfg["cluster"] = {"nodes": 1, "gpus_per_node": 1, "gpu_slices": args.slices}
        cfg["device"] = args.device or "auto"
        for p in cfg["pipelines"]:
            p.update(max_shards=1, min_shards=1, gpus=[0])
        wanted.discard("pinned")  # one GPU: nothing to pin a second pipeline to
    elif args.slices != 1:
        cfg["cluster"] = dict(cfg["cluster"], gpu_slices=args.slices)
        for p in cfg["pipelines"]:
            p.update(max_shards=1, min_shards=1)
    modes = [("timeshared", "rlix", cfg)] if "timeshared" in wanted else []
    modes += [("pinned", "standalone", pinned_cfg)] if "pinned" in wanted else []
    modes += [(f"queue{i}", "rlix", dict(cfg, pipelines=[p])) for i, p in enumerate(cfg["pipelines"])]
    import ray

    t0 = time.perf_counter()
    raw: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rlix-bench-agentic-") as tmp, \
            Bench("agentic_cpu", total=len(modes)) as bench:
        for label, mode, run_cfg in modes:
            bench.phase(f"{label} ({mode}, {len(run_cfg['pipelines'])} pipeline(s))")
            with bench.aside():  # the run draws its own bars
                raw[label] = [one_run(run_cfg, mode, Path(tmp) / label)]
                ray.shutdown()
            bench.advance()
    if args.keep:
        Path(args.keep).write_text(json.dumps(raw, default=str))
    runs = {label: span(rs[0], args.warmup) for label, rs in raw.items()}
    rate = {label: runs[label][0] / runs[label][1] for label in ("timeshared", "pinned") if label in runs}
    queue = [v for k, v in runs.items() if k.startswith("queue")]
    rate["queue"] = sum(s for s, _, _ in queue) / sum(t for _, t, _ in queue)
    tag = "agentic_1gpu" if args.one_gpu else "agentic"
    out = {
        **({f"{tag}_timeshared_vs_queue": round(rate["timeshared"] / rate["queue"], 3)} if "timeshared" in rate else {}),
        **({"agentic_timeshared_vs_pinned": round(rate["timeshared"] / rate["pinned"], 3)}
           if "pinned" in rate and "timeshared" in rate else {}),
        "agentic_steps_per_min": {k: round(v * 60, 2) for k, v in rate.items()},
        "agentic_spans_s": {k: round(v[1], 1) for k, v in runs.items()},
        "agentic_reward_gain": {k: v[2] for k, v in runs.items()},
        "agentic_episodes": {k: episode_stats(rs[0]) for k, rs in raw.items()},
        **({"gpu_slices": args.slices} if args.one_gpu or args.slices != 1 else {}),
        "tool_latency_s": args.tool_latency, "steps": args.steps, "warmup": args.warmup, "wall_s": round(time.perf_counter() - t0, 1),
    }
    for k, v in out.items():
        print(f"{k:32s} {v}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
