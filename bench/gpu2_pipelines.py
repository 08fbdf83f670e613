"""The main job on two GPUs of one host: issue 21's gates, through `rlix run` itself.

gate 1 (`overlap`): one pipeline, inference on both GPUs (two shards), training on GPU 0 only
  (`train_gpus: 1`, partial overlap), >= 20 steps, weight audit on. Its rollouts are set up as
  the case partial overlap is for, generation slower than training: a step's groups all in
  flight at once, each shard decoding 8 sequences at a time (as a shard whose KV cache holds
  few long sequences would), so each batch needs both shards, and no checkpoint mid-run. (With
  64 at a time one H100 shard alone nearly keeps up with the trainer at this size: the next
  batch was sometimes complete when a train phase ended, and the scheduler then rightly gave
  GPU 0 straight back to the trainer instead of waking its shard for nothing.)
  Passes when the shard on GPU 1 generated tokens in every one of GPU 0's train phases (its
  tokens/s is shown per phase: during GPU 0's training and outside it), the shard on GPU 0
  slept before every train phase and was woken after it, the free GPU memory at the start of
  every train phase is within 1% of the first, and every sync was checksum-audited equal. The
  run's last train phase has no rollout work in or after it: its tokens and wake are shown
  apart and not asked for.
gate 2 (`timeshared` vs `partition` vs `queue`): two pipelines, same seeds, one invocation, on
  each workload (`pattern`: GRPO on the pattern task at the 0.5B shape; `agentic`: the multi-turn
  tool-calling example, tools taking --tool-latency s): time-shared by the scheduler on both GPUs,
  each pinned to one GPU (exclusive partition: standalone mode), and one after the other with
  both GPUs each (exclusive queue). Total rollout tokens/s and train steps/hour of each mode,
  `gpu2_vs_partition` and `gpu2_vs_queue` (steps/hour ratios), each run's GPU-time account and
  its timeline picture (copied beside the figures).
gate 3 (`dp`): `train_gpus: 2`, two shards: each step trains on both ranks in one process group
  made and destroyed inside the step; both shards, asleep beside the ranks, are synced every step
  from the ranks' GPU copies (CUDA IPC, before the trainer offloads), audited. The sync's time
  (both shards at once) is compared, in the same invocation, with the two physical bounds of its
  bytes: a pinned host-to-GPU copy (the path from the CPU cache) and an NCCL broadcast from GPU 0
  to GPU 1 (`nccl_sync_vs_broadcast`: the sync as the trainer ranks time it; with the
  coordinator's Ray call to them, `nccl_sync_vs_broadcast_with_rpc`). `--gate3-model` picks the
  model, the 1.5B shape by default: the bound grows with the bytes and the sync's fixed control
  costs (an HTTP call per shard, a handle exported and opened, an allocation: ~4-5 ms) do not,
  so at the examples' 0.5B shape (bound ~2 ms) the ratio measures them rather than the transfer
  (docs/BENCHMARKS.md has both).

Throughput is counted over the steps after each pipeline's first `--warmup` (the first start of
every process, CUDA graphs, pinned buffers). On a machine without two GPUs, `--dry-run` runs
the same configs with the tiny model on 2 fake GPUs (CPU), to check the script itself.

    python3 bench/gpu2_pipelines.py [--gates 1,2,3] [--steps 20] [--gate2-steps 12] [--gate3-model M]
                                    [--workloads pattern,agentic] [--out DIR] [--dry-run]
Ends by printing one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402
from gpu_pipelines import run_config as run_and_capture  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PATTERN = ROOT / "examples" / "gpu_two_pipelines.yaml"
AGENTIC = ROOT / "examples" / "agentic_two_pipelines.yaml"


class ShardTokens:
    """Every engine server's `vllm:generation_tokens_total` sampled on a thread, with the GPU
    each process sees (its CUDA_VISIBLE_DEVICES): tokens/s of the shard on a GPU over any window.
    Servers are found by their command line (`rlix.cli serve ... --port N`); a server's guard
    (rlix.procguard, its parent) carries the same command line, so a server is known by its URL
    (a port is fresh for every process start)."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, str, str, float]] = []  # (time, url, visible devices, tokens)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def servers() -> dict[str, str]:
        """URL -> CUDA_VISIBLE_DEVICES of every engine server running on this host."""
        out: dict[str, str] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if "rlix.cli" not in argv or "serve" not in argv or "--port" not in argv:
                    continue
                env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace")
                           .split("\0") if "=" in kv)
            except OSError:
                continue
            host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
            out[f"http://{host}:{argv[argv.index('--port') + 1]}"] = env.get("CUDA_VISIBLE_DEVICES", "")
        return out

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.is_set():
                for url, visible in self.servers().items():
                    try:
                        text = http.get(url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    tokens = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                 if line.startswith("vllm:generation_tokens_total"))
                    self.samples.append((time.time(), url, visible, tokens))
                time.sleep(self.period_s)

    def __enter__(self) -> ShardTokens:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def tokens(self, visible: str, t0: float, t1: float) -> float:
        """Tokens the servers on GPU `visible` generated in [t0, t1] (each process's counter
        interpolated at the window's ends; a process that started or ended inside counts its part)."""
        total = 0.0
        for url in {u for _, u, v, _ in self.samples if v == visible}:
            rows = [(t, n) for t, u, _, n in self.samples if u == url]
            total += _at(rows, t1) - _at(rows, t0)
        return total


def _at(rows: list[tuple[float, float]], t: float) -> float:
    """A cumulative counter's value at t, linear between samples, flat outside them."""
    if not rows or t <= rows[0][0]:
        return rows[0][1] if rows else 0.0
    for (ta, na), (tb, nb) in zip(rows, rows[1:]):
        if ta <= t <= tb:
            return na + (nb - na) * (t - ta) / (tb - ta) if tb > ta else nb
    return rows[-1][1]


def run_config(cfg: dict, name: str, out: Path, bench: Bench, mode: str | None = None) -> dict:
    """`rlix run` through the CLI (gpu_pipelines'; console kept in NAME.log): its summary."""
    return run_and_capture(cfg, name, out, bench, mode)[0]


def span(summary: dict, warmup: int) -> tuple[float, float, int]:
    """(start, end, steps) of the steps after each pipeline's first `warmup` (wall clock)."""
    starts, ends, n = [], [], 0
    for s in summary["pipelines"].values():
        recs = s["records"]
        if len(recs) > warmup:
            starts.append(recs[warmup - 1]["finished_at"] if warmup else recs[0]["finished_at"] - recs[0]["step_s"])
            ends.append(recs[-1]["finished_at"])
            n += len(recs) - warmup
    return min(starts), max(ends), n


def train_windows(run_dir: Path, gpu: int) -> list[tuple[float, float]]:
    """[start, end] of every train role GPU `gpu` held, from the run's timeline."""
    tl = json.loads((run_dir / "timeline.json").read_text())
    t0 = tl["otherData"]["started_at"]
    return [(t0 + e["ts"] / 1e6, t0 + (e["ts"] + e["dur"]) / 1e6) for e in tl["traceEvents"]
            if e.get("cat") == "gpu" and e["args"].get("gpu") == gpu
            and str(e["args"].get("role", "")).endswith("/train")]


def memory_drift(p: dict, holder: str = "trainer") -> tuple[float | None, list[float]]:
    free = [r["device_free"] for r in p["gpu_memory"]
            if r["event"] == "acquire" and r["holder"].startswith(holder) and r["device_free"] is not None]
    if not free:
        return None, []
    return max(abs(f - free[0]) / free[0] for f in free), [round(f / 2**30, 3) for f in free]


def ranks_on(p: dict, gpu: int) -> set[int]:
    return {s["rank"] for s in p["shard_placements"] if gpu in s["gpus"]}


def events_of(p: dict, kind: str, ranks: set[int], after: float = 0.0) -> list[list]:
    return [e for e in p["events"] if e[1] == kind and set(e[2]) & ranks and e[0] >= after]


def pipeline_cfg(base: dict, gpus: int, **overrides) -> dict:  # type: ignore[no-untyped-def]
    return dict(base, cluster={"nodes": 1, "gpus_per_node": gpus}, device="auto", **overrides)


# -- gate 1 ---------------------------------------------------------------------------------------
def gate1(args: argparse.Namespace, base: dict, out: Path, tokens: ShardTokens, bench: Bench) -> dict:
    p = dict(base["pipelines"][0], name="overlap", steps=args.steps, audit_weights=True, train_gpus=1,
             min_shards=1, max_shards=2, partial_overlap=True)
    if args.tokens:
        p["rollout"] = dict(p["rollout"], max_new_tokens=args.tokens, max_model_len=max(256, 2 * args.tokens))
    if args.groups:
        p["rollout"] = dict(p["rollout"], groups_per_step=args.groups)
    # a step's groups all in flight at once: more sequences than one shard decodes at a time
    # (max_num_seqs), so the shard on GPU 0 is needed after every train phase
    p["rollout"] = dict(p["rollout"], concurrency=args.concurrency or p["rollout"]["groups_per_step"],
                        max_num_seqs=args.max_num_seqs or p["rollout"]["max_num_seqs"])
    p["checkpoint_every"] = 0  # one at the end: a save mid-run is a pause the gate is not about
    summary = run_config(pipeline_cfg(base, 2, pipelines=[p]), "overlap", out, bench)
    s = summary["pipelines"]["overlap"]
    recs = s["records"]
    after = recs[args.warmup - 1]["finished_at"] if args.warmup else 0.0
    windows = [w for w in train_windows(out / "overlap", 0) if w[0] >= after]
    # GPU 1's shard tokens/s inside each of GPU 0's train phases, and between them
    # (the last phase is the run's last step: no rollout is wanted in or after it)
    inside = [tokens.tokens("1", a, b) / (b - a) for a, b in windows[:-1] if b > a]
    inside_last = [tokens.tokens("1", a, b) / (b - a) for a, b in windows[-1:] if b > a]
    gaps = [(b0, a1) for (_, b0), (a1, _) in zip(windows, windows[1:]) if a1 > b0]
    outside = [tokens.tokens("1", a, b) / (b - a) for a, b in gaps]
    on0, on1 = ranks_on(s, 0), ranks_on(s, 1)
    # GPU 0's shard, around each of GPU 0's train phases: slept since the previous phase ended,
    # and woken (woken and synced) before the next one began. The last phase is the run's last
    # step: no rollout is wanted after it, so no wake either (it is counted apart).
    # (an event is stamped when it ends: a sleep ends once the train role is granted, before the
    # trainer's reload; a wake starts after the role is released)
    edges = [after] + [b for _, b in windows]
    nexts = [a for a, _ in windows[1:]] + [float("inf")]
    slept = sum(1 for (_, b), lo in zip(windows, edges)
                if any(lo <= e[0] <= b for e in events_of(s, "sleep", on0)))
    woke = [any(b <= e[0] - e[4] <= hi for k in ("sync", "wake") for e in events_of(s, k, on0))
            for (_, b), hi in zip(windows, nexts)]
    woken, woken_after_last = sum(woke[:-1]), bool(woke and woke[-1])
    sleeps1 = len(events_of(s, "sleep", on1 - on0, after))
    drift, free = memory_drift(s)
    n = len(recs) - args.warmup
    out_fig: dict = {
        "gate1_steps": len(recs),
        "gate1_gpu1_tok_s_while_gpu0_trains": {"median": _med(inside), "min": min(inside, default=0.0),
                                                "phases": len(inside)},
        "gate1_gpu1_tok_s_between_trains": {"median": _med(outside), "phases": len(outside)},
        "gate1_gpu1_train_phases_with_tokens": sum(1 for v in inside if v > 0) / max(1, len(inside)),
        "gate1_gpu1_tok_s_in_last_train": _med(inside_last),
        "gate1_train_phases": len(windows),
        "gate1_gpu0_shard_slept_before_train": slept,
        # of the phases with a step after them (all but the last)
        "gate1_gpu0_shard_woken_after_train": woken, "gate1_phases_with_a_step_after": len(windows) - 1,
        "gate1_gpu0_shard_woken_after_last": woken_after_last,
        "gate1_rollout_concurrency": p["rollout"]["concurrency"], "gate1_max_num_seqs": p["rollout"]["max_num_seqs"],
        "gate1_gpu1_shard_sleeps": sleeps1,
        "gate1_free_at_train_start_max_drift": drift, "gate1_free_at_train_start_gib": free,
        "gate1_checksum_checks": s["checksum_checks"], "gate1_checksum_mismatches": len(s["checksum_mismatches"]),
        "gate1_refits_in_flight": len(events_of(s, "refit", on1, after)),
        "gate1_ms_per_step": {k: round(1000 * statistics.mean(r[k] for r in recs[args.warmup:]), 1)
                              for k in ("generate_s", "wait_gpus_s", "reload_s", "train_s", "cache_s",
                                        "offload_s", "sync_s", "step_s")},
    }
    out_fig["gate1_pass"] = bool(
        inside and out_fig["gate1_gpu1_train_phases_with_tokens"] == 1.0 and slept == len(windows) >= n
        and woken == len(windows) - 1
        and drift is not None and drift <= 0.01 and s["checksum_checks"] >= len(recs)
        and not s["checksum_mismatches"] and len(recs) >= 20)
    return out_fig


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 1) if values else 0.0


def _med3(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else 0.0


# -- gate 2 ---------------------------------------------------------------------------------------
def mode_figures(summary: dict, warmup: int) -> dict:
    t0, t1, steps = span(summary, warmup)
    tokens = sum(p["collector"]["tokens"] for p in summary["pipelines"].values())
    return {"steps": steps, "span_s": t1 - t0, "tokens": tokens, "wall_s": summary["wall_s"],
            "gpu_account": summary.get("gpu_account"), "role_changes": len(summary.get("role_changes", [])),
            "reward_gain": {n: round(p["reward_last5"] - p["reward_first5"], 3)
                            for n, p in summary["pipelines"].items()}}


def gate2(args: argparse.Namespace, workload: str, out: Path, bench: Bench) -> dict:
    base = yaml.safe_load((PATTERN if workload == "pattern" else AGENTIC).read_text())
    pipes = []
    for i, p in enumerate(base["pipelines"][:2]):
        p = dict(p, steps=args.gate2_steps, gpus=[i], max_shards=2, min_shards=1)
        if workload == "agentic":
            p["env"] = dict(p.get("env") or {}, tool_latency_s=args.tool_latency)
        if args.dry_run:
            p["model"] = "tiny"
        pipes.append(p)
    cfg = pipeline_cfg(base, 2, pipelines=pipes)
    modes = args.modes.split(",")
    runs = {m: run_config(cfg, f"{workload}-{m}", out, bench, "rlix" if m == "timeshared" else "standalone")
            for m in ("timeshared", "partition") if m in modes}
    figs = {m: mode_figures(s, args.warmup) for m, s in runs.items()}
    if "queue" in modes:
        queue = [run_config(dict(cfg, pipelines=[p]), f"{workload}-queue-{p['name']}", out, bench, "rlix")
                 for p in pipes]
        qf = [mode_figures(s, args.warmup) for s in queue]
        figs["queue"] = {"steps": sum(q["steps"] for q in qf), "span_s": sum(q["span_s"] for q in qf),
                         "tokens": sum(q["tokens"] for q in qf), "wall_s": sum(q["wall_s"] for q in qf),
                         "gpu_account": [q["gpu_account"] for q in qf],
                         "role_changes": sum(q["role_changes"] for q in qf),
                         "reward_gain": {k: v for q in qf for k, v in q["reward_gain"].items()}}
    for m, f in figs.items():
        f["steps_per_hour"] = f["steps"] / f["span_s"] * 3600
        # tokens over the whole run (the collector counts from the first request on)
        f["rollout_tok_s"] = f["tokens"] / f["wall_s"]
    runs_named = [f"{workload}-timeshared", f"{workload}-partition"] + [f"{workload}-queue-{p['name']}" for p in pipes]
    for run_name in runs_named:
        for f in ("timeline.png", "timeline.json"):  # the picture needs matplotlib where the run was
            if (out / run_name / f).exists():
                shutil.copy(out / run_name / f, out / f"{run_name}.{f}")
    rate = {m: figs[m]["steps_per_hour"] for m in figs}
    ratios = {f"{workload}_gpu2_vs_{m}": round(rate["timeshared"] / rate[m], 3)
              for m in ("partition", "queue") if m in rate and "timeshared" in rate}
    return {**ratios, f"{workload}_steps_per_hour": {m: round(v, 1) for m, v in rate.items()},
            f"{workload}_rollout_tok_s": {m: round(figs[m]["rollout_tok_s"], 1) for m in figs},
            f"{workload}_modes": figs}


# -- gate 3 ---------------------------------------------------------------------------------------
def model_bytes(model: str) -> int:
    """Bytes of the model's weights in bfloat16, as the shards are synced (tied embedding once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlix.models.presets import resolve_model

    cfg = AutoConfig.from_pretrained(str(resolve_model(model)))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    seen, total = set(), 0
    for p in m.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 2
    return total


def _phase_medians(syncs: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    rows = [phases for one in syncs for phases in one.values()]
    return {k: _med3([r[k] for r in rows if k in r]) for k in (rows[0] if rows else {})}


def gate3(args: argparse.Namespace, base: dict, out: Path, bench: Bench) -> dict:
    p = dict(base["pipelines"][0], name="dp", steps=args.gate3_steps, audit_weights=True, train_gpus=2,
             min_shards=1, max_shards=2, partial_overlap=True)
    if args.gate3_model and not args.dry_run:
        p["model"] = args.gate3_model
    summary = run_config(pipeline_cfg(base, 2, pipelines=[p]), "dp", out, bench)
    s = summary["pipelines"]["dp"]
    recs = s["records"]
    after = recs[args.warmup - 1]["finished_at"] if args.warmup else 0.0
    ranks = {r["gpu"] for r in s["trainer_placement"]["ranks"]}
    syncs = [e for e in s["events"] if e[1] in ("sync", "device_sync") and e[0] >= after]
    beside = [e for e in syncs if e[1] == "device_sync"]
    wakes = [e for e in s["events"] if e[1] == "wake" and e[0] >= after]
    # each train phase (both GPUs): both shards synced to its version before the next one, from
    # the trainer's GPU copies before its offload (device_sync, inside the phase) or after it
    windows = [w for w in train_windows(out / "dp", 0) if w[0] >= after]
    nexts = [a for a, _ in windows[1:]] + [float("inf")]
    both_synced = sum(1 for (a, _), hi in zip(windows, nexts)
                      if len({r for e in syncs if a <= e[0] - e[4] <= hi for r in e[2]}) == 2)
    fig = {
        "gate3_steps": len(recs), "gate3_trainer_gpus": sorted(ranks),
        "gate3_steps_on_2_ranks": sum(1 for r in recs if r["train_ranks"] == 2),
        "gate3_groups_destroyed": sum(1 for r in recs if r["group_destroyed"] is True),
        "gate3_group_setup_ms": _med([1000 * r["group_setup_s"] for r in recs[args.warmup:]]),
        "gate3_group_teardown_ms": _med([1000 * r["group_teardown_s"] for r in recs[args.warmup:]]),
        "gate3_train_phases": len(windows), "gate3_both_shards_synced_after": both_synced,
        # the sync of both shards at once, and (after the trainer's release) their KV wake
        "gate3_sync_ms": _med3([1000 * e[4] for e in beside]),
        # sender-timed, no Ray hops: one per device_sync event, in order (the warm-up's dropped)
        "gate3_sync_call_ms": _med3(list(s.get("device_sync_calls_ms", []))[-len(beside):] if beside else []),
        # where the shards' time went (each shard's own timing of its call; medians over both)
        "gate3_shard_phases_ms": _phase_medians(list(s.get("device_sync_phases_ms", []))[-len(beside):] if beside else []),
        "gate3_host_sync_ms": _med3([1000 * e[4] for e in syncs if e[1] == "sync"]),
        "gate3_syncs_from_trainer_gpu": sum(len(e[2]) for e in beside),
        "gate3_syncs_from_host_cache": sum(len(e[2]) for e in syncs if e[1] == "sync"),
        "gate3_wake_after_sync_ms": _med3([1000 * e[4] for e in wakes]),
        "gate3_device_sync_ms_per_step": _med3([1000 * r.get("device_sync_s", 0.0) for r in recs[args.warmup:]]),
        "gate3_checksum_checks": s["checksum_checks"], "gate3_checksum_mismatches": len(s["checksum_mismatches"]),
        "gate3_free_at_train_start_max_drift": memory_drift(s)[0],
    }
    if not args.dry_run:
        import torch

        from weight_sync import h2d_seconds, raw_broadcast_seconds

        total = model_bytes(p["model"])
        fig["gate3_sync_bytes"] = total
        fig["gate3_h2d_bound_ms"] = round(1000 * h2d_seconds(total, 5), 2)
        fig["gate3_broadcast_bound_ms"] = round(1000 * raw_broadcast_seconds(total, 5), 2)
        torch.cuda.empty_cache()
        # The sync as its sender times it (each rank: exporting the handle, the /sync_weights
        # call to its shard, the shard's wake, allocation, copies and finish; both ranks at once),
        # like the bound, a broadcast between processes already told to run it. The coordinator's
        # figure adds the Ray call that tells the ranks to sync: shown beside it.
        sync, with_rpc = fig["gate3_sync_call_ms"], fig["gate3_sync_ms"]
        bound = fig["gate3_broadcast_bound_ms"]
        fig["gate3_sync_vs_h2d"] = round(fig["gate3_h2d_bound_ms"] / sync, 3) if sync else None
        fig["nccl_sync_vs_broadcast"] = round(bound / sync, 3) if sync else None
        fig["nccl_sync_vs_broadcast_with_rpc"] = round(bound / with_rpc, 3) if with_rpc else None
    fig["gate3_pass"] = bool(
        len(recs) == args.gate3_steps and fig["gate3_steps_on_2_ranks"] == len(recs)
        and fig["gate3_groups_destroyed"] == len(recs) and not s["checksum_mismatches"]
        and both_synced == len(windows) > 0 and (fig.get("nccl_sync_vs_broadcast") or 0) >= 0.8)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gates", default="1,2,3")
    ap.add_argument("--steps", type=int, default=20, help="gate 1's steps")
    ap.add_argument("--tokens", type=int, default=512, help="gate 1's max_new_tokens (0: the example's)")
    ap.add_argument("--groups", type=int, default=16,
                    help="gate 1's groups_per_step (0: the example's): enough rollouts a step that one "
                         "shard cannot make the next batch while the other GPU trains, so both are needed")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="gate 1's groups in flight at once (0: groups_per_step: a step's sequences, "
                         "more than one shard's max_num_seqs)")
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="gate 1's sequences one shard decodes at once (0: the example's 64): generation "
                         "slower than training, so each batch needs both shards (partial overlap's case)")
    ap.add_argument("--gate2-steps", type=int, default=12)
    ap.add_argument("--gate3-steps", type=int, default=8)
    ap.add_argument("--gate3-model", default="qwen2-1.5b-shape",
                    help="gate 3's model preset (its bytes set the bound; '': the example's 0.5B shape)")
    ap.add_argument("--workloads", default="pattern,agentic")
    ap.add_argument("--modes", default="timeshared,partition,queue", help="gate 2's modes (the ratios need all three)")
    ap.add_argument("--tool-latency", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="tiny model on 2 fake GPUs (CPU): checks the script")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu2_bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(PATTERN.read_text())
    if args.dry_run:
        for p in base["pipelines"]:
            p["model"] = "tiny"
    gates = set(args.gates.split(","))
    workloads = [w for w in args.workloads.split(",") if w]
    modes = args.modes.split(",")
    per_workload = ("timeshared" in modes) + ("partition" in modes) + 2 * ("queue" in modes)
    total = ("1" in gates) + ("3" in gates) + per_workload * len(workloads) * ("2" in gates)
    figures: dict = {}
    t0 = time.perf_counter()
    with ShardTokens() as tokens, Bench("gpu2_pipelines", total=total) as bench:
        if "1" in gates:
            figures.update(gate1(args, base, out, tokens, bench))
            bench.log(json.dumps({k: v for k, v in figures.items() if k.startswith("gate1")}, default=str))
        if "3" in gates:
            figures.update(gate3(args, base, out, bench))
            bench.log(json.dumps({k: v for k, v in figures.items() if k.startswith("gate3")}, default=str))
        if "2" in gates:
            for w in workloads:
                more = gate2(args, w, out, bench)
                (out / f"gate2_{w}.json").write_text(json.dumps(more, indent=1, default=str))
                figures.update({k: v for k, v in more.items() if not k.endswith("_modes")})
                bench.log(json.dumps({k: v for k, v in more.items() if not k.endswith("_modes")}, default=str))
    if not args.dry_run:
        import torch

        figures["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(figures, default=lambda v: round(v, 4) if isinstance(v, float) else str(v)))


if __name__ == "__main__":
    main()
