"""TRL's GRPOTrainer beside rlix's own GRPO on real GPUs, one `rlix run` (issue 39, acceptance 4).

examples/trl_grpo/config.yaml on N GPUs: the `native` pipeline (rlix's loop) and `trl-grpo`
(examples/trl_grpo/train.py: trl's GRPOTrainer through rlix.client.trl), both on --model. On
CUDA the TRL program trains on the GPU rlix grants it: its model and AdamW state leave that GPU
after every step (pinned host memory, measured free) and come back at before_training, and each
new version is packed on its GPU so that its shards asleep there are refit device to device
(CUDA IPC); shards elsewhere read its host cache.

Figures (from the run's summary.json, whole run timed from launch to exit):
  wall_s                        the `rlix run`, start-up included
  steps                         {pipeline: steps done}; failed_pipelines: those that did not finish
  trl_ipc_syncs                 TRL shards synced from the program's GPU copy (CUDA IPC), all steps
  trl_ipc_sync_ms_median        one such sync call (the coordinator's, median)
  trl_host_syncs                TRL refits from the host cache (active shards, wakes elsewhere)
  trl_release_s_median          the program's state off its GPU, freed and measured (median)
  trl_reload_s_median           back on it, after waiting for its previous holders (median)
  trl_checksum_checks / _mismatches   audited syncs of the TRL pipeline's versions
  reward_first / reward_last    {pipeline: mean of its first / last steps' rewards}

    python3 bench/external_gpu.py [--gpus N] [--model M] [--trl-steps S] [--native-steps S] [--out DIR]
    python3 bench/external_gpu.py --dry-run      # tiny model, 2 fake GPUs on the CPU
Ends by printing one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, run_dir: Path) -> dict:
    cfg = yaml.safe_load((ROOT / "examples" / "trl_grpo" / "config.yaml").read_text())
    cfg["run_dir"] = str(run_dir)
    cfg["cluster"]["gpus_per_node"] = args.gpus
    cfg["device"] = "cpu" if args.dry_run else "auto"
    native, trl = cfg["pipelines"]
    for p in (native, trl):
        p["model"] = args.model
        p["max_shards"] = args.gpus
    native["steps"], trl["steps"] = args.native_steps, args.trl_steps
    native["rollout"].update(groups_per_step=8, group_size=8, max_new_tokens=args.tokens, concurrency=64)
    trl["external"]["command"] = [sys.executable, str(ROOT / "examples" / "trl_grpo" / "train.py")]
    trl["external"]["cwd"] = str(run_dir.parent)
    return cfg


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def figures(summary: dict, wall_s: float, steps: dict[str, int]) -> dict:
    pipes = summary.get("pipelines", {})
    trl = pipes.get("trl-grpo", {})
    events = trl.get("events", [])
    ipc = [e for e in events if e[1] == "device_sync"]
    host = [e for e in events if e[1] in ("sync", "wake_sync", "refit")]
    handoffs = [m for m in trl.get("gpu_memory", []) if str(m.get("holder", "")).startswith("program of")]
    done = {name: int(p.get("steps") or 0) for name, p in pipes.items()}
    return {
        "wall_s": round(wall_s, 1), "steps": done,
        "failed_pipelines": sorted(n for n, want in steps.items() if done.get(n, 0) < want
                                   or pipes.get(n, {}).get("state") != "done"),
        "trl_ipc_syncs": sum(len(e[2]) for e in ipc),
        "trl_ipc_sync_ms_median": median([float(x) for x in trl.get("device_sync_calls_ms", [])]),
        "trl_host_syncs": sum(len(e[2]) for e in host),
        "trl_release_s_median": median([float(m["release_s"]) for m in handoffs if "release_s" in m]),
        "trl_reload_s_median": median([float(m["reload_s"]) for m in handoffs if m.get("reload_s")]),
        "trl_checksum_checks": trl.get("checksum_checks"),
        "trl_checksum_mismatches": len(trl.get("checksum_mismatches", [])),
        "reward_first": {n: p.get("reward_first5") for n, p in pipes.items()},
        "reward_last": {n: p.get("reward_last5") for n, p in pipes.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--trl-steps", type=int, default=8)
    ap.add_argument("--native-steps", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens of both pipelines")
    ap.add_argument("--out", default="/tmp/external_gpu")
    ap.add_argument("--timeout", type=float, default=540.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        args.model, args.gpus, args.trl_steps, args.native_steps, args.tokens = "tiny", 2, 2, 3, 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    cfg = config(args, run_dir)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, TRL_MAX_COMPLETION=str(args.tokens), TRL_LR=os.environ.get("TRL_LR", "1e-5"),
               TRL_OUTPUT_DIR=str(out / "trl-output"))
    print(f"rlix run {path} (native {args.native_steps} steps, trl-grpo {args.trl_steps}, {args.model}, "
          f"{args.gpus} GPU(s)); its console in {out / 'run.log'}", flush=True)
    t0 = time.perf_counter()
    with open(out / "run.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "rlix.cli", "run", str(path)], stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=args.timeout,
                              check=False)
    wall = time.perf_counter() - t0
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        print(f"no summary (rc {proc.returncode}); the run's console:\n"
              + (out / "run.log").read_text()[-3000:], flush=True)
        return 1
    result = figures(json.loads(summary_path.read_text()), wall,
                     {p["name"]: p["steps"] for p in cfg["pipelines"]})
    result["rc"] = proc.returncode
    (out / "figures.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0 if proc.returncode == 0 and not result["failed_pipelines"] else 1


if __name__ == "__main__":
    sys.exit(main())
