"""`rlix run CONFIG.yaml`: start (or join) Ray, start the scheduler, run every pipeline, show
progress, end with a summary.

Live view: one line per finished step (step, reward, seconds) and one line per GPU whose role or
owner changed (read from the scheduler's ledger), so the log shows GPUs moving between pipelines
and between training and generation. On a terminal a table of every pipeline is redrawn too.
Everything also goes to RUN_DIR/run.log; per-pipeline metrics to RUN_DIR/NAME/metrics.jsonl and
the final summary to RUN_DIR/summary.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import ray
from pydantic import ValidationError

from rlix import env
from rlix.simulated_cluster import SimulatedCluster
from rlix.config.loader import resolve_config
from rlix.config.models import RlixConfig
from rlix.config.preflight import preflight
from rlix.errors import ConfigError, NodeLostError, PipelineFailedError, format_validation_error, one_line
from rlix.httpkit import check_ray_address, is_loopback
from rlix.pipeline.device_plan import DevicePlan
from rlix.placement import GpuReservation
from rlix.procguard import pid_alive
from rlix.private_files import narrow_to_owner, write_private
from rlix.scheduler.service import check_scheduler, start_scheduler, topology_from_ray
from rlix.supervise import InterruptFlag, Supervisor
from rlix.run_log import RunLog
from rlix.run_summary import SUMMARY_FILE, GpuAccount, PipelineSummary, RunSpan, RunSummary
from rlix.timeline import account_lines, write_timeline


def prepare_run_dir(cfg: RlixConfig, config_path: str) -> Path:
    run_dir = Path(cfg.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{config_path}: run_dir: cannot create {run_dir}: {exc.strerror}") from None
    return run_dir


def run(config: str | Path | Mapping | RlixConfig, *, resume: bool = False, mode: str | None = None,
        address: str | None = None, overrides: Sequence[str] = (), out: TextIO = sys.stdout) -> dict:
    """Run a config to the end; returns the summary as summary.json's JSON data (the file is
    written whatever the ending: finished, failed, interrupted; `RunSummary.model_validate`
    reads the dict back typed). `config`: a YAML file's path, the same as a dict (relative
    paths from the working directory) or an RlixConfig; `overrides`: `path.to.field=value`
    items, as `--set` (rlix.config.overrides). `address` (else RAY_ADDRESS) attaches to a
    running Ray cluster; without one a local cluster is started: several simulated nodes on
    this machine when the config asks for more than one."""
    cfg, config_path = resolve_config(config, overrides)
    preflight(cfg, config_path)  # before Ray: a bad file, task or verifier fails in a second
    mode = mode or env.control_plane(cfg.control_plane)
    run_dir = prepare_run_dir(cfg, config_path)
    say = RunLog(run_dir / "run.log", out)
    address = address or env.ray_address()
    if cfg.cluster.is_auto and address is None and not ray.is_initialized():
        raise ConfigError(f"{config_path}: cluster is auto but no Ray cluster to read GPUs from "
                          "(give --address or set RAY_ADDRESS, or give nodes and gpus_per_node)")
    t_start = time.perf_counter()
    simulated = None
    if not ray.is_initialized():
        simulated = _start_ray(cfg, address, run_dir, say)
        keep_ray_token_private(say)
    try:
        return _run_on_ray(cfg, config_path, mode=mode, run_dir=run_dir, say=say, resume=resume,
                           t_start=t_start).to_dict()
    finally:
        say.close()
        if simulated is not None:
            ray.shutdown()
            simulated.shutdown()


def reap_local_segments(pids: list[int], wait_s: float = 10.0, end_them: bool = False) -> list[str]:
    """This machine's weight-cache segments of dead processes (trainers that died without closing:
    SIGKILLed, or lost with their node), once `pids` (the run's trainers) have exited or
    `wait_s` passed; done here, not through Ray, which may be gone. `end_them`: those of `pids`
    still running here as Ray workers are SIGKILLed first (their node is gone: they can do
    nothing more). Segments of live processes are never touched."""
    from rlix.weights.wire import reap_orphaned_segments  # deferred: torch

    if end_them:
        for pid in pids:
            if _ray_worker(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    try:
        return reap_orphaned_segments("rlix-w")
    except OSError:
        return []


def keep_ray_token_private(say: Callable[[str], None]) -> None:
    """Ray (2.60) writes the token that admits a process to the cluster it starts readable by
    every user of the machine (mode 0644): with it anyone here could join the run's cluster and
    act as it. Narrowed to its owner after every Ray start (a no-op once it is 0600)."""
    path = env.ray_token_path()
    was = narrow_to_owner(path)
    if was is not None:
        say(f"{path}: Ray's cluster token was readable by others (mode {was:o}); made 0600")


def say_where_ray_listens(say: Callable[[str], None]) -> None:
    """After this process started a Ray cluster: one line when its servers listen beyond this
    machine. A Ray started with the loopback address as its node IP binds loopback only; the rlix
    commands ask for that before Ray is imported (env.keep_ray_on_loopback), which a program that
    imported Ray itself first cannot have done."""
    ip = ray.util.get_node_ip_address()
    if is_loopback(ip):
        return
    why = (f"{env.RAY_CLUSTER_VAR} asks for it" if env.ray_widened() else
           f"Ray was imported before {env.RAY_CLUSTER_VAR}=0 could be set; the rlix commands set it first")
    say(f"Ray listens beyond this machine (node IP {ip}, its gRPC servers on every interface): {why}")


def _start_ray(cfg: RlixConfig, address: str | None, run_dir: Path, say: RunLog) -> SimulatedCluster | None:
    """Attach to `address`, or start a local cluster: one node, or as many simulated nodes as
    the config names (the simulated cluster is returned: the caller ends it)."""
    init = {"namespace": "rlix", "log_to_driver": False, "logging_level": "ERROR"}
    if address:
        check_ray_address(address)
        try:
            ray.init(address=address, **init)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"cannot attach to the Ray cluster at {address}: {one_line(exc)}") from None
        return None
    cpus = max(4, 2 * len(cfg.pipelines) + 2)
    if cfg.cluster.is_auto or int(cfg.cluster.nodes) == 1:
        # on CPU its GPUs are fake (num_gpus): reserved and placed all the same
        # "local": a new cluster, never one another program started on this machine
        ray.init(address="local", num_cpus=cpus, num_gpus=None if cfg.cluster.is_auto else cfg.cluster.physical_gpus,
                 include_dashboard=False, **init)
        say_where_ray_listens(say)
        return None
    nodes, per_node = int(cfg.cluster.nodes), int(cfg.cluster.gpus_per_node)
    simulated = SimulatedCluster(nodes, per_node, cpus_per_node=max(2, -(-cpus // nodes)))
    simulated.connect(**init)
    say_where_ray_listens(say)
    shown = simulated.nodes()
    write_private(run_dir / "cluster.json", json.dumps({"address": simulated.address,  # an address: 0600
                                                         "nodes": [asdict(n) for n in shown]}, indent=1))
    say(f"no cluster given: simulating {nodes} nodes of {per_node} GPU(s) on this machine "
        f"(raylet PIDs {[n.raylet_pid for n in shown]}; {run_dir / 'cluster.json'})")
    return simulated


def _run_on_ray(cfg: RlixConfig, config_path: str, *, mode: str, run_dir: Path, say: RunLog,
                resume: bool, t_start: float) -> RunSummary:
    gpus = topology_from_ray() if cfg.cluster.is_auto else cfg.cluster.physical_topology()
    reservation = GpuReservation.reserve(gpus, slices=cfg.cluster.gpu_slices, fake=cfg.device == "cpu")
    topology = gpus.sliced(cfg.cluster.gpu_slices)  # what the scheduler hands out
    scheduler = None
    try:
        devices = device_plan(cfg, reservation)
        sliced = f" as {topology.num_gpus} slices" if cfg.cluster.gpu_slices > 1 else ""
        say(f"rlix run {config_path}: {len(cfg.pipelines)} pipeline(s), mode {mode}, {gpus.num_gpus} GPU(s)"
            f"{sliced} ({devices.device}{', ' + devices.dtype if devices.dtype else ''}), run dir {run_dir}")
        if mode == "rlix":
            params = cfg.scheduler.params(resident_engines=devices.resident_engines)
            # held: no plan until every pipeline has registered (its training home known),
            # then each is planned for from its own `ready`; not waited for: the pipelines'
            # actors start beside it (a Ray worker start each)
            scheduler = start_scheduler(topology, params, real_gpus=devices.device == "cuda",
                                        metrics_port=cfg.scheduler.metrics_port,
                                        dashboard_port=cfg.scheduler.dashboard_port, held=True, wait=False)
        elif cfg.scheduler.dashboard_port is not None:
            say("scheduler.dashboard_port: no dashboard in standalone mode (there is no scheduler)")

        def scheduler_up() -> None:
            """Once the pipelines' actors are asked for: the scheduler answers (its topology
            checked), is held until they have all registered (one already running was not
            started held), its endpoints said."""
            check_scheduler(scheduler, topology)
            ray.get(scheduler.hold.remote([p.name for p in cfg.pipelines]))
            _say_metrics_endpoint(scheduler, cfg, say)
            _say_dashboard(scheduler, cfg, say)

        return follow(cfg, config_path, mode=mode, run_dir=run_dir, say=say, devices=devices,
                      scheduler=scheduler, all_gpus=list(range(topology.num_gpus)), resume=resume,
                      t_start=t_start, first_plan_held=scheduler is not None,
                      started=scheduler_up if scheduler is not None else None)
    finally:
        if scheduler is not None:
            ray.kill(scheduler)
        reservation.release()


def _say_scheduler_startup(scheduler, wall0: float, say: RunLog) -> None:  # type: ignore[no-untyped-def]
    """When the run's scheduler was up and when each pipeline's registration reached it, in
    seconds from the run's start: what a set-up's `reserve` waited for."""
    try:
        times = ray.get(scheduler.startup_times.remote(), timeout=30)
    except Exception as exc:  # noqa: BLE001 - a diagnostic line only
        say(f"scheduler start-up times not read: {one_line(exc)}")
        return
    regs = ", ".join(f"{name} {a - wall0:.1f}-{b - wall0:.1f}s" for name, (a, b) in sorted(times["registered"].items()))
    say(f"scheduler: started {times['init_at'] - wall0:.1f}-{times['up_at'] - wall0:.1f}s into the run; "
        f"registrations arrived-answered: {regs or 'none'}")


def _say_metrics_endpoint(scheduler, cfg: RlixConfig, say: RunLog) -> None:
    """The scheduler's Prometheus URL to the run log; a port it could not listen on ends the run."""
    _say_endpoint(scheduler.metrics_endpoint, "metrics_port", cfg.scheduler.metrics_port,
                  "scheduler metrics (Prometheus)", say)


def _say_dashboard(scheduler, cfg: RlixConfig, say: RunLog) -> None:
    """The dashboard's URL to the console and run log; a port it could not listen on ends the run."""
    _say_endpoint(scheduler.dashboard_endpoint, "dashboard_port", cfg.scheduler.dashboard_port,
                  "dashboard", say)


def _say_endpoint(method, field: str, port: int | None, label: str, say: RunLog) -> None:  # type: ignore[no-untyped-def]
    if port is None:
        return
    endpoint = ray.get(method.remote())
    if endpoint["error"]:
        raise ConfigError(f"scheduler.{field}: {endpoint['error']}")
    if endpoint["url"]:
        say(f"{label}: {endpoint['url']}")


def follow(cfg: RlixConfig, config_path: str, *, mode: str, run_dir: Path, say: RunLog,
           devices: DevicePlan, scheduler, all_gpus: list[int], resume: bool, t_start: float,
           first_plan_held: bool = False, role_log_from: int = 0,
           started: Callable[[], None] | None = None) -> RunSummary:
    """Start a config's pipelines against a scheduler (None: standalone), follow them to the
    end, stop them, and write the summary whatever the ending. The scheduler plans for each
    pipeline once it is set up (SchedulerHooks.join); `first_plan_held`: a run's own scheduler,
    held until every pipeline registered (never a shared one), is resumed at the latest once
    every pipeline has set up or failed (one that failed before registering lifts no hold).
    `started`: called once the pipelines' actors are asked for (a run's own scheduler is
    confirmed there, while they start).
    Raises PipelineFailedError when every pipeline failed."""
    supervisor: Supervisor | None = None
    ending = "finished"
    node_lost = False
    interrupt = InterruptFlag()
    try:
        interrupt.install()
        supervisor = Supervisor(cfg.pipelines, mode=mode, run_dir=run_dir, api_key=env.api_key() or
                                secrets.token_urlsafe(24), devices=devices, scheduler=scheduler, say=say,
                                on_step=say.step, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                setup_timeout_s=cfg.setup_timeout_s,
                                all_gpus=all_gpus, resume=resume, vllm_python=cfg.vllm_python,
                                role_log_from=role_log_from, experiment_log=cfg.logging)
        supervisor.start_all()
        if started is not None:
            started()
        supervisor.wait_setup(interrupt.check)
        interrupt.check()
        if first_plan_held:
            ray.get(scheduler.resume.remote())
            _say_scheduler_startup(scheduler, time.time() - (time.perf_counter() - t_start), say)
        supervisor.drive(interrupt.check)
    except KeyboardInterrupt:
        ending = "interrupted"
        say("interrupted: stopping every pipeline (each saves a checkpoint)")
        raise
    except BaseException as exc:
        lost = _lost_nodes(devices)
        if lost and devices.reservation is not None and len(lost) == len(devices.reservation.node_ids):
            # every node of the run is gone: every actor's death below is this one's, said once
            exc = NodeLostError(f"the Ray node(s) {', '.join(n[:12] for n in lost)} running this run died "
                                f"(a raylet exited, or a machine left the cluster): the pipelines there "
                                f"ended with them")
            ending = f"failed: {one_line(exc)}"
            node_lost = True
            raise exc from None
        ending = f"failed: {one_line(exc)}"
        raise
    finally:
        interrupt.restore()  # a Ctrl-C while stopping raises where it lands
        t_stop = time.perf_counter()
        trainers = supervisor.trainer_pids() if supervisor is not None else []
        if supervisor is not None:
            supervisor.stop_all()
            audit = supervisor.audit_ledger("end of run")
            if audit is not None and not audit["ok"]:
                say(f"scheduler ledger at the end of the run: {audit['error']}")
        if ending.startswith("failed"):  # trainers killed or lost with their node leave their caches
            # with their node gone, its workers linger until this process exits: ended here
            reaped = reap_local_segments(trainers, end_them=node_lost)
            if reaped:
                say(f"removed {len(reaped)} shared-memory segment(s) of dead trainers")
        say(f"stopped in {time.perf_counter() - t_stop:.1f}s")
        result = _write_summary(config_path, mode, run_dir, supervisor, ending,
                                round(time.perf_counter() - t_start, 1), say,
                                gpu_nodes=_gpu_nodes(devices, all_gpus))
    failed = {n: s.error for n, s in result.pipelines.items() if s.failed}
    if failed and len(failed) == len(result.pipelines):
        raise PipelineFailedError("; ".join(f"{n}: {e}" for n, e in failed.items()))
    return result


def _write_summary(config_path: str, mode: str, run_dir: Path, supervisor: Supervisor | None,
                   ending: str, wall_s: float, say: RunLog, gpu_nodes: list[int] | None = None) -> RunSummary:
    """summary.json, gpu_memory.json and the timeline, whatever the ending; the summary table
    and the GPU-time account to the log."""
    raw = {"config": config_path, "mode": mode, "wall_s": wall_s, "ending": ending,
           "pipelines": supervisor.summaries() if supervisor is not None else {},
           "role_changes": supervisor.role_changes if supervisor is not None else [],
           "lost_nodes": supervisor.lost_nodes if supervisor is not None else [],
           "ledger_audits": supervisor.ledger_audits if supervisor is not None else []}
    try:
        summary = RunSummary.model_validate(raw)
    except ValidationError as exc:  # the summary is written whatever: without the parts that misfit
        say(f"{format_validation_error('summary.json', exc)}: written without the run's role log, "
            f"lost nodes and ledger audits")
        summary = RunSummary.model_validate(dict(raw, role_changes=[], lost_nodes=[], ledger_audits=[]))
    _timeline(run_dir, summary, wall_s, gpu_nodes, say)
    summary.write(run_dir / SUMMARY_FILE)
    (run_dir / "gpu_memory.json").write_text(json.dumps(memory_ledger(summary.pipelines), indent=1))
    for line in summary_table(summary):
        say(line)
    if summary.gpu_account is not None:
        for line in account_lines(summary.gpu_account.model_dump()):
            say(line)
    return summary


def _ray_worker(pid: int) -> bool:
    """A process of this machine that Ray titled as one of its workers (`ray::...`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().startswith(b"ray::")
    except OSError:
        return False


def _lost_nodes(devices: DevicePlan) -> list[str]:
    """The run's nodes (those holding its GPUs) that Ray no longer has alive; [] if it cannot
    tell. Ray keeps a dead node's entry (Alive false) while its GCS lives."""
    if devices.reservation is None:
        return []
    try:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:  # noqa: BLE001 - no answer from Ray: nothing known
        return []
    return [n for n in devices.reservation.node_ids if n not in alive]


def _gpu_nodes(devices: DevicePlan, gpus: list[int]) -> list[int] | None:
    """The node (index) of each of the run's GPUs, for the timeline; None when not placed."""
    if devices.reservation is None:
        return None
    return [devices.reservation.slot(g).node for g in gpus]


def _timeline(run_dir: Path, summary: RunSummary, wall_s: float, gpu_nodes: list[int] | None,
              say: RunLog) -> None:
    """The summary's `run` span and `gpu_account`; RUN_DIR/timeline.json and timeline.png
    (rlix.timeline). A timeline that cannot be drawn is said, and the run's ending stands."""
    ended = time.time()
    summary.run = RunSpan(started_at=ended - wall_s, ended_at=ended, gpu_nodes=gpu_nodes or [])
    try:
        summary.gpu_account = GpuAccount.model_validate(write_timeline(run_dir, summary))
    except Exception as exc:  # noqa: BLE001 - the summary matters more than its chart
        say(f"timeline not written: {one_line(exc)}")


def device_plan(cfg: RlixConfig, reservation: GpuReservation) -> DevicePlan:
    """The run's device, dtype and placement: `device: auto` is cuda when the reserved GPUs are
    real CUDA devices, else cpu (Ray's GPUs are then fake ones)."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if reservation.has_cuda else "cpu"
    elif device == "cuda" and not reservation.has_cuda:
        raise ConfigError("device is cuda but the Ray cluster's GPUs are not CUDA devices "
                          "(no /dev/nvidia* on their nodes); use device: cpu or auto")
    return DevicePlan(device=device, dtype=cfg.dtype_on(device), reservation=reservation,
                      release_timeout_s=cfg.release_timeout_s,
                      resident_engines=cfg.cluster.resident_engines and device == "cuda")


def memory_ledger(summaries: Mapping[str, PipelineSummary]) -> dict[str, list[dict]]:
    """The GPU memory ledger of the run: per GPU, every hand-off (holder, event, bytes it still
    held, free memory on the device) in time order."""
    out: dict[str, list[dict]] = {}
    for name, s in summaries.items():
        for row in s.gpu_memory:
            for g in row.gpus or ["-"]:
                out.setdefault(str(g), []).append({"pipeline": name, **row.model_dump(mode="json", exclude_unset=True)})
    return {g: sorted(rows, key=lambda r: r["at"]) for g, rows in sorted(out.items())}


#: characters of a drop reason shown in the summary table (summary.json keeps it whole)
DROP_REASON_CHARS = 40


def dropped_cell(dropped: Mapping[str, int]) -> str:
    """Trajectories dropped, with the count of each reason beside the total (largest first; a
    failed group's reason is its error, cut to DROP_REASON_CHARS)."""
    total = sum(dropped.values())

    def short(reason: str) -> str:
        return reason if len(reason) <= DROP_REASON_CHARS else reason[:DROP_REASON_CHARS - 1] + "…"

    reasons = ", ".join(f"{short(reason)} {n}" for reason, n in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])) if n)
    return f"{total} ({reasons})" if total else "0"


def summary_table(summary: RunSummary) -> list[str]:
    """The run's table: per pipeline its steps, mean reward of its first and last steps (5 each,
    half a shorter run's each: `reward_window`; n/a below two steps), trajectories dropped with
    their reasons, GPU-seconds and sync seconds."""
    windows = {s.reward_window for s in summary.pipelines.values() if s.reward_first5 is not None}
    shared = next(iter(windows)) if len(windows) == 1 else None
    label = "" if shared is None else str(shared)
    rows = [("pipeline", "steps", f"reward first{label}", f"reward last{label}", "gain", "dropped", "gpu-s", "sync s")]
    for name, s in summary.pipelines.items():
        gpu_s = "-" if s.gpu_seconds is None else str(s.gpu_seconds)
        if s.accounting is None and s.reward_first5 is None:  # failed before its first summary
            rows.append((name, str(s.steps), "-", "-", "-", "-", gpu_s, "-"))
            continue
        # an external pipeline keeps no accounting of trajectories: its program does the rollouts
        dropped = dropped_cell(s.accounting.dropped) if s.accounting is not None else "-"
        if s.reward_first5 is None or s.reward_last5 is None:  # too few steps for two windows
            rows.append((name, str(s.steps), "n/a", "n/a", "n/a", dropped, gpu_s, f"{s.sync_s:.2f}"))
            continue
        own = "" if shared is not None else f" ({s.reward_window})"
        rows.append((name, str(s.steps), f"{s.reward_first5:.3f}{own}", f"{s.reward_last5:.3f}{own}",
                     f"{s.reward_last5 - s.reward_first5:+.3f}", dropped, gpu_s, f"{s.sync_s:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"summary ({summary.mode}, {summary.wall_s}s):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    for name, s in summary.pipelines.items():
        for f in s.failures:
            lines.append(f"  {name} failed at step {f.step}: {f.reason}" + (f" -> {f.then}" if f.then else ""))
        if s.failed:
            lines.append(f"  {name} FAILED: {s.error}")
    if summary.ending != "finished":
        lines.append(f"  run {summary.ending}")
    return lines


class _CallableModule(types.ModuleType):
    """`rlix.run(config)` is the package's documented entry point, and `rlix.run` is also this
    module (Python binds a submodule to its package's attribute once imported): calling the
    module runs `run`, looked up when called."""

    def __call__(self, config: str | Path | Mapping | RlixConfig, **kwargs: Any) -> dict:
        return run(config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
