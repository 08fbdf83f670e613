"""`rlix run CONFIG.yaml`: start (or join) Ray, start the scheduler, run every pipeline, show
progress, end with a summary.

Live view: one line per finished step (step, reward, seconds) and one line per GPU whose role or
owner changed (read from the scheduler's ledger), so the log shows GPUs moving between pipelines
and between training and generation. On a terminal a table of every pipeline is redrawn too.
Everything also goes to RUN_DIR/run.log; per-pipeline metrics to RUN_DIR/NAME/metrics.jsonl and
the final summary to RUN_DIR/summary.json.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import ray

from rlix import env
from rlix.config import load_config
from rlix.config.models import RlixConfig
from rlix.devices import resolve_dtype
from rlix.errors import ConfigError, PipelineFailedError
from rlix.pipeline.actor import PipelineActor
from rlix.pipeline.runner import DevicePlan
from rlix.placement import GpuReservation
from rlix.scheduler.core import gpu_roles
from rlix.scheduler.planner import PlannerParams
from rlix.scheduler.service import start_scheduler, topology_from_ray


class RunLog:
    """Prints to the console and appends to run.log."""

    def __init__(self, path: Path, out: TextIO = sys.stdout) -> None:
        self.fh = path.open("a")
        self.out = out
        self.t0 = time.time()

    def __call__(self, line: str) -> None:
        stamped = f"[{time.time() - self.t0:7.1f}s] {line}"
        print(stamped, file=self.out, flush=True)
        self.fh.write(stamped + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()



def gpu_share(snapshot: dict, shares: dict[str, float], dt: float) -> None:
    """Accumulate GPU-seconds held per pipeline (both roles)."""
    for what in gpu_roles(snapshot).values():
        name = what.split("/", 1)[0]
        shares[name] = shares.get(name, 0.0) + dt


def run(config_path: str, *, resume: bool = False, mode: str | None = None,
        out: TextIO = sys.stdout) -> dict:
    """Run a config to the end; returns the summary (also written to RUN_DIR/summary.json)."""
    cfg: RlixConfig = load_config(config_path)
    mode = mode or env.control_plane(cfg.control_plane)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = RunLog(run_dir / "run.log", out)
    if cfg.cluster.is_auto and env.ray_address() is None:
        raise ConfigError(f"{config_path}: cluster is auto but no Ray cluster to read GPUs from "
                          "(set RAY_ADDRESS, or give nodes and gpus_per_node)")
    total = None if cfg.cluster.is_auto else int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)
    t_start = time.perf_counter()
    if not ray.is_initialized():
        address = env.ray_address()
        if address:
            ray.init(address=address, namespace="rlix", log_to_driver=False)
        else:  # a local cluster; on CPU its GPUs are fake (num_gpus): reserved and placed all the same
            ray.init(num_cpus=max(4, 2 * len(cfg.pipelines) + 2), num_gpus=total, namespace="rlix",
                     include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    api_key = env.api_key() or secrets.token_urlsafe(24)
    topology = topology_from_ray() if cfg.cluster.is_auto else cfg.cluster.topology()
    total = topology.num_gpus
    reservation = GpuReservation.reserve(topology)
    scheduler = None
    actors: dict[str, Any] = {}
    try:
        devices = device_plan(cfg, reservation)
        say(f"rlix run {config_path}: {len(cfg.pipelines)} pipeline(s), mode {mode}, {total} GPU(s) "
            f"({devices.device}{', ' + devices.dtype if devices.dtype else ''}), run dir {run_dir}")
        if mode == "rlix":
            params = PlannerParams(dwell_s=cfg.scheduler.dwell_s, aging_s=cfg.scheduler.aging_s)
            scheduler = start_scheduler(topology, params)
            ray.get(scheduler.hold.remote())  # one first plan, once every pipeline is registered
        all_gpus = list(range(total))
        for p in cfg.pipelines:
            gpus = p.gpus if p.gpus is not None else all_gpus
            actors[p.name] = PipelineActor.remote(p.model_dump(), mode=mode, run_dir=str(run_dir),
                                                  api_key=api_key, gpus=gpus, resume=resume,
                                                  devices=devices)
        for info in ray.get([a.setup.remote() for a in actors.values()]):
            say(f"{info['pipeline']}: ready in {info['setup_s']}s, shards {info['shards']}, "
                f"starting at step {info['start_step']}")
        if scheduler is not None:
            ray.get(scheduler.resume.remote())
        summaries, role_changes = _drive(actors, scheduler, say)
    finally:
        t_stop = time.perf_counter()
        stopping = {name: a.shutdown.remote() for name, a in actors.items()}
        for name, ref in stopping.items():
            try:
                took = ray.get(ref, timeout=120)
                slow = {k: v for k, v in took.items() if v > 2}
                if slow:
                    say(f"{name}: slow shutdown {slow}")
            except Exception as exc:  # noqa: BLE001 - keep shutting the others down
                say(f"{name}: shutdown failed: {type(exc).__name__}: {exc}")
            ray.kill(actors[name])
        say(f"stopped in {time.perf_counter() - t_stop:.1f}s")
        if scheduler is not None:
            ray.kill(scheduler)
        reservation.release()
    result = {"config": config_path, "mode": mode, "wall_s": round(time.perf_counter() - t_start, 1),
              "pipelines": summaries, "role_changes": role_changes}
    (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    (run_dir / "gpu_memory.json").write_text(json.dumps(memory_ledger(summaries), indent=1))
    for line in summary_table(result):
        say(line)
    say.close()
    return result


def _drive(actors: dict[str, Any], scheduler: Any, say: RunLog) -> tuple[dict[str, dict], list[dict]]:
    """Wait for every pipeline, logging steps and GPU moves; returns the summaries and the GPU
    role changes (with `at` in wall-clock seconds, like the pipelines' step records)."""
    runs = {name: a.run.remote() for name, a in actors.items()}
    pending = dict(runs)
    seen_steps: dict[str, int] = {}
    seen_change = 0
    role_changes: list[dict] = []
    shares: dict[str, float] = {}
    last = time.perf_counter()
    failed: dict[str, str] = {}
    while pending:
        done, _ = ray.wait(list(pending.values()), timeout=0.25, num_returns=len(pending))
        for ref in done:
            name = next(n for n, r in pending.items() if r == ref)
            del pending[name]
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - one pipeline's failure ends it alone
                failed[name] = one_line(exc)
                say(f"{name}: failed: {failed[name]}")
                _stop_pipeline(name, actors[name], say)  # its GPUs go back to the scheduler now
        now = time.perf_counter()
        if scheduler is not None:
            snap = ray.get(scheduler.snapshot.remote())
            gpu_share(snap, shares, now - last)
            # from the scheduler's numbered log: changes between two polls are not lost
            # the scheduler's clock is monotonic; the step records are wall-clock
            to_wall = time.time() - snap["now"]
            for change in ray.get(scheduler.role_changes.remote(seen_change)):
                say(f"gpu {change['gpu']}: {change['before']} -> {change['after']}")
                seen_change = change["seq"]
                role_changes.append(dict(change, at=change["at"] + to_wall))
        last = now
        for name, prog in zip(actors, ray.get([a.progress.remote() for a in actors.values()])):
            if prog["step"] != seen_steps.get(name) and prog["reward"] is not None:
                seen_steps[name] = prog["step"]
                share = shares.get(name, 0.0)
                say(f"{name}: step {prog['step']}/{prog['steps']} reward {prog['reward']:.3f} "
                    f"active shards {prog['active_shards']} gpu-s {share:.0f}")
    summaries: dict[str, dict] = {}
    for name, actor in actors.items():
        try:
            summaries[name] = ray.get(actor.summary.remote())
        except Exception as exc:  # noqa: BLE001 - a pipeline that never got going has no summary
            summaries[name] = {"pipeline": name, "steps": 0, "rewards": [], "error": one_line(exc)}
        summaries[name]["gpu_seconds"] = round(shares.get(name, 0.0), 1)
        if name in failed:
            summaries[name]["error"] = failed[name]
    if failed and len(failed) == len(actors):
        raise PipelineFailedError("; ".join(f"{n}: {e}" for n, e in failed.items()))
    return summaries, role_changes


def _stop_pipeline(name: str, actor: Any, say: RunLog) -> None:
    try:
        ray.get(actor.shutdown.remote(), timeout=120)
    except Exception as exc:  # noqa: BLE001 - the run goes on with the others
        say(f"{name}: shutdown after its failure failed: {one_line(exc)}")


def one_line(exc: BaseException) -> str:
    """A pipeline's error as one line: Ray's wrapping and tracebacks dropped, the cause kept."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    last = next((line for line in reversed(text) if line.strip()), "") if text else ""
    return f"{type(cause).__name__}: {last.strip()}"[:500]


def device_plan(cfg: RlixConfig, reservation: GpuReservation) -> DevicePlan:
    """The run's device, dtype and placement: `device: auto` is cuda when the reserved GPUs are
    real CUDA devices, else cpu (Ray's GPUs are then fake ones)."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if reservation.has_cuda else "cpu"
    elif device == "cuda" and not reservation.has_cuda:
        raise ConfigError("device is cuda but the Ray cluster's GPUs are not CUDA devices "
                          "(no /dev/nvidia* on their nodes); use device: cpu or auto")
    if device == "cuda":
        wide = [p.name for p in cfg.pipelines if p.train_gpus > 1]
        if wide:
            raise ConfigError(f"pipelines {wide}: train_gpus > 1 on cuda needs one trainer process "
                              f"per GPU, which rlix does not place yet; use train_gpus: 1")
    return DevicePlan(device=device, dtype=resolve_dtype(cfg.dtype, device), reservation=reservation,
                      release_timeout_s=cfg.release_timeout_s)


def memory_ledger(summaries: dict[str, dict]) -> dict[str, list[dict]]:
    """The GPU memory ledger of the run: per GPU, every hand-off (holder, event, bytes it still
    held, free memory on the device) in time order."""
    out: dict[str, list[dict]] = {}
    for name, s in summaries.items():
        for row in s.get("gpu_memory", []):
            for g in row.get("gpus") or ["-"]:
                out.setdefault(str(g), []).append({"pipeline": name, **row})
    return {g: sorted(rows, key=lambda r: r.get("at", 0.0)) for g, rows in sorted(out.items())}


def summary_table(result: dict) -> list[str]:
    rows = [("pipeline", "steps", "reward first5", "reward last5", "gain", "dropped", "gpu-s", "sync s")]
    for name, s in result["pipelines"].items():
        if "reward_first5" not in s:  # failed before its first summary
            rows.append((name, str(s.get("steps", 0)), "-", "-", "-", "-", str(s.get("gpu_seconds", "-")), "-"))
            continue
        dropped = sum(s["accounting"].get("dropped", {}).values())
        rows.append((name, str(s["steps"]), f"{s['reward_first5']:.3f}", f"{s['reward_last5']:.3f}",
                     f"{s['reward_last5'] - s['reward_first5']:+.3f}", str(dropped),
                     str(s.get("gpu_seconds", "-")), f"{s['sync_s']:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"summary ({result['mode']}, {result['wall_s']}s):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines += [f"  {name} FAILED: {s['error']}" for name, s in result["pipelines"].items() if s.get("error")]
    return lines
