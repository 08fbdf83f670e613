"""The main job on one real GPU: issue 12's gates 1, 2 and 4, through `rlix run` itself.

gate 1 (`solo`): one pipeline alone on GPU 0, its trainer and its shard time-sharing it, >= 20
  steps with the weight audit on. Passes when the free GPU memory measured at the start of every
  train phase (the trainer's reload, after the shard slept at level 2) is within 1% of the first
  step's (no leak), every sync was checksum-audited equal, and `gpu_control_fraction` <= 0.10:
  everything but generating and training (sleep, reload, cache, offload, release/refit, and the
  wake + sync of the shard, which sits on the next batch's path) over the step wall time.
gate 2 (`shared` vs `queue`): two pipelines time-sharing the GPU through the scheduler, against
  the same two run one after the other on it (exclusive queue), same seeds, in one invocation:
  `gpu_steps_per_hour_ratio` = steps/hour shared / queue (goal >= 1.2), and the GPU busy fraction
  of each mode (NVML utilisation sampled every 50 ms while the steps run).
gate 4: the shared mode IS `rlix run examples/gpu_two_pipelines.yaml` (run through the CLI, its
  output kept): it must end with rc 0, every step done and GPU moves in its log.

Steps before `--warmup` are left out of the per-step figures (the first reload comes from
pageable memory, pinned buffers are allocated, CUDA graphs are captured).

    python bench/gpu_pipelines.py [--steps 20] [--gate2-steps 12] [--gates 1,2,4] [--out DIR]
Ends by printing one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpu_two_pipelines.yaml"


class BusySampler:
    """NVML GPU utilisation, sampled on a thread: the fraction of samples with the GPU busy."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s, self.samples = period_s, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.is_set():
            self.samples.append((time.time(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            time.sleep(self.period_s)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def mean_util(self, t0: float, t1: float) -> float:
        vals = [u for t, u in self.samples if t0 <= t <= t1]
        return sum(vals) / len(vals) / 100 if vals else 0.0


def run_config(cfg: dict, name: str, out: Path, bench: Bench, mode: str | None = None) -> tuple[dict, str]:
    """`rlix run` of one config through the CLI (`--mode` if given); returns the summary and the
    console output (captured, so the bench's bar stays on screen: each run is one of its rounds)."""
    steps = ", ".join(f"{p['name']}: {p.get('steps', '?')} steps" for p in cfg["pipelines"])
    bench.phase(f"rlix run {name} ({steps})")
    path = out / f"{name}.yaml"
    cfg = dict(cfg, run_dir=str(out / name))
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    # --overwrite: a bench run again with the same --out measures afresh in the same run dirs
    proc = subprocess.run([sys.executable, "-m", "rlix.cli", "run", str(path), "--overwrite"]
                          + (["--mode", mode] if mode else []),
                          capture_output=True, text=True, timeout=1200)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: rlix run exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    bench.advance()
    return json.loads((out / name / "summary.json").read_text()), proc.stdout


def span(summary: dict, warmup: int) -> tuple[float, float, int]:
    """(start, end, steps) of the steps after warm-up, over every pipeline (wall clock)."""
    starts, ends, n = [], [], 0
    for s in summary["pipelines"].values():
        recs = s["records"][warmup:]
        if recs:
            starts.append(recs[0]["finished_at"] - recs[0]["step_s"])
            ends.append(recs[-1]["finished_at"])
            n += len(recs)
    return min(starts), max(ends), n


def gate1(base: dict, steps: int, warmup: int, out: Path, sampler: BusySampler, bench: Bench,
          tokens: int | None = None) -> dict:
    """`tokens`: max_new_tokens of the rollouts (default: the example's); the fixed costs of a
    step (sleep, reload, offload, wake) weigh less as generation grows."""
    name = "solo" if tokens is None else f"solo{tokens}"
    p = dict(base["pipelines"][0], name=name, steps=steps, audit_weights=True)
    if tokens is not None:
        p["rollout"] = dict(p["rollout"], max_new_tokens=tokens, max_model_len=max(256, 2 * tokens))
    cfg = dict(base, pipelines=[p])
    summary, _ = run_config(cfg, name, out, bench)
    s = summary["pipelines"][name]
    recs = s["records"]
    # the shard's wake + sync runs in the scheduler's expand after each release, on the next
    # batch's path: the coordinator's "sync" events (wake inside the sync call)
    t_first = recs[warmup]["finished_at"] - recs[warmup]["step_s"]
    wake_sync = sum(e[4] for e in s["events"] if e[1] == "sync" and e[0] >= t_first)
    shard_audit = sum(e[4] for e in s["events"] if e[1] == "audit" and e[0] >= t_first)
    keep = recs[warmup:]
    tot = {k: sum(r[k] for r in keep) for k in ("generate_s", "wait_gpus_s", "reload_s", "train_s", "audit_s",
                                               "cache_s", "offload_s", "release_s", "sync_s", "step_s")}
    # the weight audit (checksums on both sides) is instrumentation: out of every figure
    step_total = tot["step_s"] - tot["audit_s"] - shard_audit
    tail = max(0.0, tot["generate_s"] - wake_sync - shard_audit)  # pure generation
    control = step_total - tail - tot["train_s"]
    # CUDA graphs released at each level-2 sleep are captured again by the first decode steps
    # after the wake: inside "generate", reported apart (the shard's cumulative counter)
    shard_rows = [r for r in s["gpu_memory"] if r["event"] == "release" and "graph_capture_ms" in r
                  and r["at"] >= t_first]
    capture_ms = (shard_rows[-1]["graph_capture_ms"] - shard_rows[0]["graph_capture_ms"]) if len(shard_rows) > 1 else 0.0
    captures = (shard_rows[-1]["graph_captures"] - shard_rows[0]["graph_captures"]) if len(shard_rows) > 1 else 0
    engine_sleep = {}
    for r in shard_rows:
        for k, v in r.get("sleep_phases_ms", {}).items():
            engine_sleep[k] = engine_sleep.get(k, 0.0) + v / len(shard_rows)
    acquire = [r for r in s["gpu_memory"] if r["event"] == "acquire" and r["device_free"] is not None]
    free = [r["device_free"] for r in acquire]
    drift = max(abs(f - free[0]) / free[0] for f in free) if free else None
    n = len(keep)
    t0, t1, _ = span(summary, warmup)
    fleet_sleep = {k: v / len(recs) for k, v in s["sleep_phases_ms"].items()}
    return {
        "solo_steps": len(recs),
        "solo_ms_per_step": {"generate": 1000 * tail / n, "sleep": 1000 * tot["wait_gpus_s"] / n,
                             "reload": 1000 * tot["reload_s"] / n, "train": 1000 * tot["train_s"] / n,
                             "cache": 1000 * tot["cache_s"] / n, "offload": 1000 * tot["offload_s"] / n,
                             "release_refit": 1000 * max(tot["release_s"], tot["sync_s"]) / n,
                             "wake_sync": 1000 * wake_sync / n, "step": 1000 * step_total / n,
                             "audit_excluded": 1000 * (tot["audit_s"] + shard_audit) / n},
        "sleep_path_ms": {"fleet": fleet_sleep, "engine": engine_sleep},
        "graph_recapture_ms_per_step": capture_ms / n, "graph_captures_per_step": captures / n,
        "gpu_control_fraction": control / step_total,
        "gpu_control_fraction_with_graph_recapture": (control + capture_ms / 1000) / step_total,
        "free_at_train_start_max_drift": drift,
        "free_at_train_start_gib": [round(f / 2**30, 3) for f in free],
        "checksum_checks": s["checksum_checks"], "checksum_mismatches": len(s["checksum_mismatches"]),
        "version_mismatches": len(s["version_mismatches"]),
        "solo_gpu_busy": sampler.mean_util(t0, t1),
        "gate1_pass": bool(drift is not None and drift <= 0.01 and control / step_total <= 0.10
                           and s["checksum_checks"] >= len(recs) and not s["checksum_mismatches"]),
    }


def gate2(base: dict, steps: int | None, warmup: int, out: Path, sampler: BusySampler,
          bench: Bench) -> dict:
    steps = steps or base["pipelines"][0]["steps"]
    shared_cfg = dict(base, pipelines=[dict(p, steps=steps) for p in base["pipelines"]])
    summary, console = run_config(shared_cfg, "shared", out, bench)
    t0, t1, n_shared = span(summary, warmup)
    shared_rate = n_shared / (t1 - t0) * 3600
    shared_busy = sampler.mean_util(t0, t1)
    moves = sum(1 for line in console.splitlines() if "gpu 0:" in line)
    all_steps = all(s["steps"] == steps for s in summary["pipelines"].values())
    queue_time, queue_steps, busy = 0.0, 0, []
    for p in base["pipelines"]:
        solo, _ = run_config(dict(base, pipelines=[dict(p, steps=steps)]), f"queue-{p['name']}", out, bench)
        a, b, n = span(solo, warmup)
        queue_time += b - a
        queue_steps += n
        busy.append((sampler.mean_util(a, b), b - a))
    queue_rate = queue_steps / queue_time * 3600
    return {
        "shared_steps_per_hour": shared_rate, "queue_steps_per_hour": queue_rate,
        "gpu_steps_per_hour_ratio": shared_rate / queue_rate,
        "shared_gpu_busy": shared_busy,
        "queue_gpu_busy": sum(u * d for u, d in busy) / sum(d for _, d in busy),
        "shared_reward_gain": {n: round(s["reward_last5"] - s["reward_first5"], 3)
                               for n, s in summary["pipelines"].items()},
        "gate4_example_rc0_all_steps": all_steps, "gate4_gpu_moves_logged": moves,
        "gate4_pass": bool(all_steps and moves > 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gate2-steps", type=int, default=None,
                    help="steps of each pipeline in gate 2 (default: the example's, so it runs as written)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gates", default="1,2,4")
    ap.add_argument("--solo-tokens", default="",
                    help="also run gate 1 with these max_new_tokens (comma-separated), e.g. 256")
    ap.add_argument("--only-solo-tokens", action="store_true", help="skip gate 1 at the example's tokens")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(EXAMPLE.read_text())
    gates = set(args.gates.split(","))
    figures: dict = {}
    solo_tokens = list(filter(None, args.solo_tokens.split(",")))
    runs = ((1 + len(base["pipelines"])) * bool(gates & {"2", "4"})  # shared, then each queued
            + ("1" in gates) * (int(not args.only_solo_tokens) + len(solo_tokens)))
    with BusySampler() as sampler, Bench("gpu_pipelines", total=runs) as bench:
        if gates & {"2", "4"}:
            figures.update(gate2(base, args.gate2_steps, args.warmup, out, sampler, bench))
            bench.log(json.dumps({"gate2": figures}, default=str))
        if "1" in gates and not args.only_solo_tokens:
            figures.update(gate1(base, args.steps, args.warmup, out, sampler, bench))
            bench.log(json.dumps({"gate1": figures}, default=str))
        if "1" in gates:
            for tokens in solo_tokens:
                more = gate1(base, args.steps, args.warmup, out, sampler, bench, int(tokens))
                figures[f"tokens{tokens}"] = more
                bench.log(json.dumps({f"gate1_{tokens}": more}, default=str))
    import torch

    figures["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(figures, default=lambda v: round(v, 4) if isinstance(v, float) else str(v)))


if __name__ == "__main__":
    main()
