"""Time-sharing vs exclusive partition vs exclusive queue on N GPUs: whole `rlix run`s (issue 35).

Three workloads, each run three ways in one invocation on one machine, same seeds:

  timeshared  `rlix run --mode rlix`: every pipeline on all N GPUs through the scheduler
  partition   `rlix run --mode standalone`: pipeline i pinned to GPU i (its shard and its trainer)
  queue       one `rlix run --mode rlix` per pipeline, one after the other, each with all N GPUs
              (what a cluster that gives each job its GPUs exclusively does; each job starts up)

Workloads (N pipelines on N GPUs, the 0.5B shape by default; the k-th pipeline of a kind runs
round(steps x (1 + spread x k)) steps, so that they end at different times):

  mix       half "long" pipelines (--long-tokens per sample) and half "short" ones (--short-tokens)
  longtail  every pipeline's sample lengths drawn from a lognormal (`rollout.length_tail`: most
            short, a few up to --tail-max-tokens): a step waits for its longest samples
  agentic   the multi-turn tool-calling example (examples/agentic_two_pipelines.yaml), every tool
            call taking --tool-latency s; --agentic-tokens and --agentic-groups give each turn
            longer replies and each step more episodes (the example's 16 tokens and 4 groups
            leave the GPUs nearly idle: its steps are bound by the tool calls in every mode)

mix and longtail set `rollout.ignore_eos`: a model with random weights samples its end-of-text
token at random (~0.5% a token with the built-in 384-token vocabulary), which would cut every
length short; the samples then run to their limit, as the config says.

Figures per workload `w` (makespan = wall clock from launching `rlix run` to its exit, start-up
and shutdown included; the queue's is the sum of its runs'):
  w_makespan_s                  {mode: seconds}
  w_timeshared_vs_partition     makespan(partition) / makespan(timeshared)  (> 1: time-sharing
  w_timeshared_vs_queue         makespan(queue) / makespan(timeshared)       ended first)
  w_switch_share                the time-shared run's GPU-seconds of shards put to sleep, woken
                                and started, over all its GPU-seconds (N x its wall time)
  w_idle_share                  its GPU-seconds nobody held, over the same (with --slices, of the
                                slices'; w_idle_share_devices: device-seconds no slice was held)
  w_shard_starts_after_setup    shard processes started after each pipeline's set-up ended
and overall (all time-shared runs): switch_share, idle_share, shard_starts_after_setup, and
failed_pipelines (every pipeline of every run that did not finish its steps; [] = all did).
OUT/w.json has each run's details (GPU-time account by category, start-up, steps, move costs);
OUT/move_costs.json the median seconds of each move measured in the time-shared runs (sleep,
wake + sync, sync, graph recapture, trainer reload and offload, shard cold start) as the cost
table rlix reads (`{"costs": {...}, "about": ...}`: `scheduler: {move_costs: PATH}`, the
simulator); OUT/figures.json all
of it (written after every run, so a cut-short invocation leaves what it measured); each run's
timeline picture is copied beside them as OUT/<run>.timeline.png.

    python3 bench/timeshare_gpu.py [--gpus N] [--pipelines P] [--workloads mix,longtail,agentic]
                                   [--modes timeshared,partition,queue] [--slices S] [--out DIR] [--dry-run]
`--pipelines P` (default N) runs P pipelines per workload; with P > N there is no partition, and
w_gpu_steps_per_hour_ratio (steps finished per hour of makespan, time-shared over queued) is
issue 35's figure for two pipelines on one GPU (`--gpus 1 --pipelines 2 --slices 2`).
`--slices S`: the time-shared and queued runs schedule every GPU as S slices (`cluster.gpu_slices`),
so one pipeline's shard can generate on a GPU where another (or its own) trainer trains; the
partition keeps whole GPUs, each pipeline's shard sleeping while its trainer trains there.
Before the timed runs, one untimed one-step `rlix run` per model warms the machine (the preset
written, kernels compiled, libraries read): otherwise the first mode timed pays for all of them
(`--no-warmup` skips it; `warmup_s` says what it took).
`--dry-run`: the same configs with the tiny model on N fake GPUs on the CPU (default 2), a few
steps each, to check the script. Ends by printing one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import timeshare as ts  # noqa: E402
from benchlib.benchkit import Bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGENTIC = ROOT / "examples" / "agentic_two_pipelines.yaml"
WORKLOADS = ("mix", "longtail", "agentic")
MODES = ("timeshared", "partition", "queue")
#: characters no multi-character token of the built-in tokenizer contains (the examples' choice)
PATTERNS = ("z", "7", "q", "4", "x", "5", "k", "9")
#: what every child process gets unless already set (the lent GPU machines' rules; rlix sets the
#: NCCL ones again where it starts processes)
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "RAY_USAGE_STATS_ENABLED": "0"}


# -- configs --------------------------------------------------------------------------------------
def steps_of(base: int, k: int, spread: float) -> int:
    """The k-th pipeline of a kind: base x (1 + spread x k) steps."""
    return max(1, round(base * (1 + spread * k)))


def pipeline(name: str, i: int, gpus: int, steps: int, model: str, rollout: dict, train: dict,
             env: dict | None = None) -> dict:
    """Pipeline i: on all the GPUs when time-shared (up to one shard per GPU), on GPU i in
    standalone (the partition, which needs a GPU per pipeline)."""
    return {"name": name, "model": model, "min_shards": 1, "max_shards": gpus, "gpus": [i % gpus], "steps": steps,
            "seed": i + 1, "checkpoint_every": 0, "task": {"name": "pattern", "patterns": [PATTERNS[i % len(PATTERNS)]]},
            "rollout": rollout, "train": train, **({"env": env} if env else {})}


def rollout(args: argparse.Namespace, tokens: int, **more) -> dict:  # type: ignore[no-untyped-def]
    return {"groups_per_step": args.groups, "group_size": args.group_size, "max_new_tokens": tokens,
            "concurrency": args.groups, "max_model_len": max(256, tokens + 128), "max_num_seqs": args.max_num_seqs,
            "ignore_eos": True, **more}


def workload_pipelines(workload: str, args: argparse.Namespace) -> list[dict]:
    """The workload's pipelines; every one with --max-staleness where given, and capturing its
    CUDA graphs at its shards' start with --capture-graphs."""
    pipes = _workload_pipelines(workload, args)
    if args.max_staleness is not None:
        pipes = [dict(p, max_staleness=args.max_staleness) for p in pipes]
    if args.capture_graphs:
        pipes = [dict(p, rollout=dict(p["rollout"], capture_graphs=True)) for p in pipes]
    return pipes


def _workload_pipelines(workload: str, args: argparse.Namespace) -> list[dict]:
    n = args.pipelines
    lr = args.lr
    if workload == "mix":
        long_n = n // 2 or 1
        out = []
        for i in range(n):
            k = i if i < long_n else i - long_n
            if i < long_n:
                out.append(pipeline(f"long-{k}", i, args.gpus, steps_of(args.long_steps, k, args.spread), args.model,
                                    rollout(args, args.long_tokens), {"lr": lr, "micro_batch_size": 8}))
            else:
                out.append(pipeline(f"short-{k}", i, args.gpus, steps_of(args.short_steps, k, args.spread), args.model,
                                    rollout(args, args.short_tokens), {"lr": lr, "micro_batch_size": 32}))
        return out
    if workload == "longtail":
        tail = {"dist": "lognormal", "median": args.tail_median, "sigma": args.tail_sigma, "min": args.tail_min}
        return [pipeline(f"tail-{i}", i, args.gpus, steps_of(args.tail_steps, i, args.spread), args.model,
                         rollout(args, args.tail_max_tokens, length_tail=tail), {"lr": lr, "micro_batch_size": 8})
                for i in range(n)]
    if workload == "agentic":
        example = yaml.safe_load(AGENTIC.read_text())["pipelines"][0]
        env = dict(example["env"], tool_latency_s=args.tool_latency)
        model = args.agentic_model or args.model
        turns = dict(example["rollout"])
        if args.agentic_tokens is not None:  # a turn's reply: the example's 16 tokens, or more
            turns.update(max_new_tokens=args.agentic_tokens,
                         max_model_len=max(turns["max_model_len"], 4 * (args.agentic_tokens + 64)))
        if args.agentic_groups is not None:
            turns.update(groups_per_step=args.agentic_groups, concurrency=2 * args.agentic_groups)
        return [pipeline(f"agent-{i}", i, args.gpus, steps_of(args.agentic_steps, i, args.spread), model,
                         dict(turns), {"lr": lr if model != "tiny" else example["train"]["lr"],
                                       "micro_batch_size": 32}, env)
                for i in range(n)]
    raise ValueError(f"unknown workload {workload!r}")


def run_config(args: argparse.Namespace, pipelines: list[dict], slices: int = 1) -> dict:
    """The run's config; `slices` > 1: the scheduler sees every GPU as that many (`cluster.gpu_slices`)."""
    cluster = {"nodes": 1, "gpus_per_node": args.gpus, **({"gpu_slices": slices} if slices > 1 else {})}
    return {"cluster": cluster, "device": "cpu" if args.dry_run else "auto",
            "scheduler": {"dwell_s": 0, "aging_s": 10}, "control_plane": "rlix", "pipelines": pipelines}


# -- running ---------------------------------------------------------------------------------------
def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in CHILD_ENV.items():
        env.setdefault(k, v)
    if not args.dry_run and "CUDA_VISIBLE_DEVICES" not in env and args.gpus < (cuda_devices() or 0):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(args.gpus))  # the first N only
    return env


def launch(cfg: dict, name: str, mode: str, args: argparse.Namespace, out: Path, bench: Bench,
           count: bool = True) -> dict:
    """`rlix run` of one config through the CLI, timed from launch to exit; its console in
    OUT/NAME.log, its run dir OUT/runs/NAME (checkpoints removed after). A run past
    --run-timeout is interrupted (SIGINT: it stops its pipelines and writes its summary)."""
    steps = ", ".join(f"{p['name']} {p['steps']}" for p in cfg["pipelines"])
    bench.phase(f"{name}: rlix run --mode {mode} ({steps} steps)")
    run_dir = out / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(cfg, run_dir=str(run_dir)), sort_keys=False))
    launched_at, t0 = time.time(), time.perf_counter()
    timed_out = False
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(path), "--mode", mode],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env(args), start_new_session=True)
        try:
            rc = proc.wait(args.run_timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                rc = proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    makespan = time.perf_counter() - t0
    ended_at = time.time()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    for ckpt in run_dir.glob("*/checkpoint"):  # GBs each at the 0.5B shape; nothing here reads them
        shutil.rmtree(ckpt, ignore_errors=True)
    if (run_dir / "timeline.png").is_file():
        shutil.copy(run_dir / "timeline.png", out / f"{name}.timeline.png")
    failed = ts.unfinished(summary, {p["name"]: p["steps"] for p in cfg["pipelines"]}, name)
    startup = ts.startup_s(summary, launched_at) if summary else None
    # from the summary written to the process's exit: Ray's shutdown (its workers' ends)
    after_summary = round(ended_at - summary_path.stat().st_mtime, 2) if summary else None
    bench.log(f"{name}: {makespan:.1f} s (start-up {startup} s, after the summary {after_summary} s), rc {rc}"
              + (", TIMED OUT" if timed_out else "") + (f", unfinished: {failed}" if failed else ""))
    if count:
        bench.advance()
    return {"name": name, "mode": mode, "rc": rc, "timed_out": timed_out, "makespan_s": round(makespan, 2),
            "launched_at": launched_at, "startup_s": startup, "after_summary_s": after_summary,
            "failed": failed, "summary": summary}


def warm_up(workloads: list[str], args: argparse.Namespace, out: Path, bench: Bench) -> dict[str, float]:
    """One untimed `rlix run` (standalone, one step) of each model's first pipeline before any
    timed run. A fresh machine's first run pays what later runs find done: the model preset
    written to disk, the kernels compiled and cached (a CUDA graph capture took ~1 s cold
    against ~0.2 s warm), libraries read from disk. Without it the first mode timed pays all
    of that and the comparison measures the order of the runs. Returns seconds per model."""
    firsts: dict[str, dict] = {}
    for w in workloads:
        first = workload_pipelines(w, args)[0]
        firsts.setdefault(first["model"], first)
    took = {}
    for model, first in firsts.items():
        cfg = run_config(args, [dict(first, name=f"warmup-{len(took)}", steps=1, gpus=[0])])
        run = launch(cfg, f"warmup-{len(took)}", "standalone", args, out, bench, count=False)
        if run["rc"] != 0 or run["failed"]:
            raise SystemExit(f"the warm-up run of {model} failed (rc {run['rc']}): see {out}/warmup-{len(took)}.log")
        took[model] = run["makespan_s"]
    return took


def run_details(run: dict) -> dict:
    """What OUT/w.json keeps of a run (not its whole summary: that stays in its run dir)."""
    s = run["summary"] or {}
    pipes = s.get("pipelines", {})
    return {k: run[k] for k in ("mode", "rc", "timed_out", "makespan_s", "startup_s", "after_summary_s",
                                "failed")} | {
        "rlix_wall_s": s.get("wall_s"),
        "steps": {n: p.get("steps") for n, p in pipes.items()},
        "tokens": {n: p.get("collector", {}).get("tokens") for n, p in pipes.items()},
        # samples started and not trained, by reason ("stale": generated too long before its step)
        "dropped": {n: p.get("accounting", {}).get("dropped", {}) for n, p in pipes.items()},
        "length_limits": {n: p["collector"]["length_limits"] for n, p in pipes.items()
                          if p.get("collector", {}).get("length_limits")},
        "shard_starts": ts.shard_starts(s) if s else None,
        "account": ts.account([s]) if s else None,
        "role_changes": len(s.get("role_changes", [])),
    }


def workload(w: str, args: argparse.Namespace, out: Path, bench: Bench, book: dict) -> dict:
    pipes = workload_pipelines(w, args)
    cfg = run_config(args, pipes)
    shared_cfg = run_config(args, pipes, args.slices)  # the modes that run through the scheduler
    runs: dict[str, list[dict]] = {}

    def keep(mode: str, run: dict) -> None:
        runs.setdefault(mode, []).append(run)
        book["runs"][run["name"]] = run_details(run)
        (out / "figures.json").write_text(json.dumps(book, indent=1, default=str))

    for mode in args.modes:
        if mode == "timeshared":
            keep(mode, launch(shared_cfg, f"{w}-timeshared", "rlix", args, out, bench))
        elif mode == "partition":
            keep(mode, launch(cfg, f"{w}-partition", "standalone", args, out, bench))
        else:
            for p in pipes:
                keep(mode, launch(dict(shared_cfg, pipelines=[p]), f"{w}-queue-{p['name']}", "rlix", args, out,
                                  bench))
    makespans = {m: round(sum(r["makespan_s"] for r in rs), 2) for m, rs in runs.items()}
    shared = [r["summary"] for r in runs.get("timeshared", []) if r["summary"]]
    acc = ts.account(shared)
    starts = sum(ts.shard_starts(s)["after_setup"] for s in shared) if shared else None
    figures = {f"{w}_makespan_s": makespans, **ts.ratios(w, makespans),
               f"{w}_switch_share": acc["switch_share"] if acc else None,
               f"{w}_idle_share": acc["idle_share"] if acc else None,
               f"{w}_shard_starts_after_setup": starts}
    rates = {m: steps_per_hour(rs) for m, rs in runs.items()}
    if rates.get("timeshared") and rates.get("queue"):  # steps done per hour of the mode's makespan
        figures[f"{w}_gpu_steps_per_hour_ratio"] = round(rates["timeshared"] / rates["queue"], 3)
    if args.slices > 1:  # the account counts slices; idle as the devices saw it
        traces = [out / "runs" / r["name"] / "timeline.json" for r in runs.get("timeshared", [])]
        shares = [ts.device_idle_share(json.loads(t.read_text()), args.slices) for t in traces if t.is_file()]
        figures[f"{w}_idle_share_devices"] = shares[0] if len(shares) == 1 else shares or None
    details = {
        **figures,
        f"{w}_account": {m: ts.account([r["summary"] for r in rs if r["summary"]]) for m, rs in runs.items()},
        f"{w}_startup_s": {m: [r["startup_s"] for r in rs] for m, rs in runs.items()},
        f"{w}_move_costs": ts.move_costs(shared),
        f"{w}_failed_pipelines": [f for rs in runs.values() for r in rs for f in r["failed"]],
        f"{w}_config": cfg, f"{w}_gpu_slices": args.slices,
        f"{w}_runs": {r["name"]: book["runs"][r["name"]] for rs in runs.values() for r in rs},
    }
    (out / f"{w}.json").write_text(json.dumps(details, indent=1, default=str))
    return {"figures": figures, "details": details, "shared": shared}


def steps_per_hour(runs: list[dict]) -> float | None:
    """Steps every pipeline of the mode's runs finished, per hour of their summed makespans."""
    done = sum(p.get("steps") or 0 for r in runs if r["summary"] for p in r["summary"].get("pipelines", {}).values())
    wall = sum(r["makespan_s"] for r in runs)
    return 3600 * done / wall if wall and done else None


def check_cost_table(path: Path) -> str | None:
    """What rlix's cost-table reader says of the file (None: it reads it; also None where this
    checkout has no reader)."""
    try:
        from rlix.scheduler.costs import load_move_costs  # deferred: not in every checkout
    except ImportError:
        return None
    try:
        load_move_costs(path)
    except Exception as exc:  # noqa: BLE001 - reported beside the figures, which stand
        return str(exc)
    return None


def cuda_devices() -> int | None:
    """CUDA devices on this machine (nvidia-smi's list; None without it)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def device_name(n: int) -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return f"{n} x ?"
    return f"{n} x {names[0].strip()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs (and pipelines per workload) to use: 2 or 4 "
                    "(default: every CUDA device; --dry-run: 2 fake ones)")
    ap.add_argument("--pipelines", type=int, default=None,
                    help="pipelines per workload (default: one per GPU); more than --gpus leaves no partition "
                         "to compare, only the queue (issue 35's two pipelines on one GPU)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--modes", default=",".join(MODES), help="the ratios need timeshared and the other")
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--agentic-model", default=None, help="the agentic workload's model (default: --model)")
    ap.add_argument("--groups", type=int, default=8, help="groups per step (all in flight at once)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="sequences one shard decodes at once (a step's samples fit one shard's batch)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--spread", type=float, default=0.4,
                    help="the k-th pipeline of a kind runs steps x (1 + spread x k): they end at different times")
    ap.add_argument("--long-tokens", type=int, default=1024, help="mix: a long pipeline's tokens per sample")
    ap.add_argument("--short-tokens", type=int, default=96, help="mix: a short pipeline's tokens per sample")
    ap.add_argument("--long-steps", type=int, default=5)
    ap.add_argument("--short-steps", type=int, default=10)
    ap.add_argument("--tail-max-tokens", type=int, default=1024, help="longtail: max_new_tokens (the cap)")
    ap.add_argument("--tail-median", type=float, default=64, help="longtail: the lognormal's median, tokens")
    ap.add_argument("--tail-sigma", type=float, default=1.2,
                    help="longtail: its sigma (1.2: p99 ~16x the median; ~1%% of samples reach the cap)")
    ap.add_argument("--tail-min", type=int, default=8)
    ap.add_argument("--tail-steps", type=int, default=6)
    ap.add_argument("--agentic-steps", type=int, default=6)
    ap.add_argument("--tool-latency", type=float, default=0.5, help="agentic: seconds per tool call")
    ap.add_argument("--agentic-tokens", type=int, default=None,
                    help="agentic: max_new_tokens of each turn's reply (default: the example's 16; a "
                         "GPU-bound agentic workload needs replies of hundreds)")
    ap.add_argument("--agentic-groups", type=int, default=None,
                    help="agentic: groups per step (default: the example's 4), all in flight")
    ap.add_argument("--run-timeout", type=float, default=300, help="seconds one rlix run may take (then SIGINT)")
    ap.add_argument("--max-staleness", type=int, default=None,
                    help="every pipeline's max_staleness (default: the config's, 1). Above 1 a pipeline "
                         "with GPUs free for it generates further ahead of its trainer")
    ap.add_argument("--capture-graphs", action="store_true",
                    help="every pipeline's shards capture all their CUDA graphs when they start "
                         "(rollout.capture_graphs), not on the steps' path")
    ap.add_argument("--slices", type=int, default=1,
                    help="the time-shared and queued runs see every GPU as this many (cluster.gpu_slices: a "
                         "pipeline's shards may generate beside a trainer on the same GPU); the partition "
                         "keeps whole GPUs")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed one-step run per model that warms the machine first")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on fake GPUs (CPU), a few steps: checks the script")
    ap.add_argument("--out", default=os.environ.get("OUT_DIR") or os.environ.get("OUT") or "runs/timeshare_gpu")
    args = ap.parse_args()
    given = {a.dest for a in ap._actions for opt in a.option_strings for arg in sys.argv[1:]
             if arg == opt or arg.startswith(opt + "=")}
    if args.dry_run:  # tiny sizes, unless named on the command line
        small = {"gpus": 2, "model": "tiny", "groups": 4, "group_size": 4, "lr": 3e-3, "long_tokens": 32,
                 "short_tokens": 8, "long_steps": 1, "short_steps": 2, "tail_max_tokens": 32, "tail_median": 6.0,
                 "tail_sigma": 1.0, "tail_min": 2, "tail_steps": 1, "agentic_steps": 1, "tool_latency": 0.2,
                 "spread": 1.0}
        for k, v in small.items():
            if k not in given:
                setattr(args, k, v)
    if args.gpus is None:
        args.gpus = cuda_devices() or 0
        if not args.gpus:
            ap.error("no CUDA devices found (nvidia-smi -L): name --gpus, or --dry-run on the CPU")
    workloads = [w for w in args.workloads.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    if set(workloads) - set(WORKLOADS) or set(args.modes) - set(MODES) or not workloads or not args.modes:
        ap.error(f"--workloads: some of {','.join(WORKLOADS)}; --modes: some of {','.join(MODES)}")
    if args.gpus < 1:
        ap.error("--gpus must be >= 1")
    args.pipelines = args.pipelines or args.gpus
    if args.pipelines > args.gpus and "partition" in args.modes:
        ap.error(f"--pipelines {args.pipelines} on --gpus {args.gpus}: no GPU each for a partition; "
                 "--modes timeshared,queue")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launches = sum((args.pipelines if m == "queue" else 1) for m in args.modes) * len(workloads)
    t0 = time.perf_counter()
    book: dict = {"args": vars(args), "runs": {}}
    headline: dict = {}
    shared: list[dict] = []
    failed: list[str] = []
    with Bench("timeshare_gpu", total=launches) as bench:
        if not args.no_warmup:
            book["warmup_s"] = warm_up(workloads, args, out, bench)
        for w in workloads:
            res = workload(w, args, out, bench, book)
            headline.update(res["figures"])
            shared += res["shared"]
            failed += res["details"][f"{w}_failed_pipelines"]
            book[w] = res["details"]
            bench.log(json.dumps(res["figures"], default=str))
    acc = ts.account(shared)
    costs = ts.move_costs(shared)
    device = "cpu (fake GPUs, --dry-run)" if args.dry_run else device_name(args.gpus)
    samples = ", ".join(f"{k} {n}" for k, n in costs["samples"].items())
    table = ts.cost_table(costs, f"{device}, {args.model}, bench/timeshare_gpu.py, the time-shared runs of "
                                 f"{','.join(workloads)}, {time.strftime('%Y-%m-%d')}; medians of {samples}")
    (out / "move_costs.json").write_text(json.dumps(table, indent=2) + "\n")
    refused = check_cost_table(out / "move_costs.json")
    if refused:
        print(f"move_costs.json: {refused}", file=sys.stderr)
    headline.update({
        "switch_share": acc["switch_share"] if acc else None, "idle_share": acc["idle_share"] if acc else None,
        "shard_starts_after_setup": sum(ts.shard_starts(s)["after_setup"] for s in shared) if shared else None,
        "failed_pipelines": failed, "move_costs": table["costs"],
        **({"move_costs_refused": refused} if refused else {}),
        "gpus": args.gpus, "pipelines": args.pipelines, "gpu_slices": args.slices, "device": device, "model": args.model, "dry_run": args.dry_run,
        "warmup_s": book.get("warmup_s"),
        "wall_s": round(time.perf_counter() - t0, 1)})
    book["headline"] = headline
    (out / "figures.json").write_text(json.dumps(book, indent=1, default=str))
    print(json.dumps(headline, default=str))


if __name__ == "__main__":
    main()
