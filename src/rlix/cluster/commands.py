"""`rlix up | submit | jobs | cancel | logs | down`: a cluster that many people submit to.

The cluster is found through its state file (`RLIX_CACHE_DIR/cluster/state.json`, written by
the head process `rlix up` leaves running); `RAY_ADDRESS` or `--address` name a Ray cluster
directly instead. Every command that reads or changes jobs is a short Ray driver that talks to
the job registry by name; `rlix submit` hands its job to the head's submission socket (its path
from the registry), which names the job's user by the account that connects (rlix.cluster.intake).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import ray

from rlix import env
from rlix.cluster.intake import submit_job
from rlix.cluster.jobs import FINAL, Job, PipelineNeeds, jobs_file, parse_quotas
from rlix.cluster.reaper import GRACE_S, session_members
from rlix.cluster.registry import ask, get_registry
from rlix.config import load_config
from rlix.config.preflight import preflight, refuse_reused_run_dir
from rlix.errors import ConfigError
from rlix.httpkit import check_ray_address
from rlix.private_files import open_private
from rlix.procguard import pid_alive
from rlix.scheduler.planning.planner import PlannerParams

#: how long `rlix up` waits for the head to answer (a Ray start takes seconds, more on busy cores)
UP_TIMEOUT_S = 120.0
#: how long `rlix down` waits for the head to stop its jobs and Ray (the head's drain, 180 s at
#: most, then Ray's own shutdown)
DOWN_TIMEOUT_S = 240.0


def cluster_dir() -> Path:
    return env.cache_dir() / "cluster"


def state_path() -> Path:
    return cluster_dir() / "state.json"


def read_state() -> dict | None:
    """The running head's state, or None (no file, or its head process is gone)."""
    path = state_path()
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if pid_alive(int(state.get("pid", 0))) else None


def cluster_address(address: str | None = None) -> str:
    """Where the cluster's Ray is: --address, RAY_ADDRESS, else the head's state file."""
    address = address or env.ray_address()
    if address:
        return address
    state = read_state()
    if state is None:
        raise ConfigError("no rlix cluster is up (start one with `rlix up`, or give --address)")
    return state["address"]


def reachable(address: str, timeout_s: float = 3.0) -> None:
    """See httpkit.check_ray_address (Ray itself would retry an unreachable one for minutes)."""
    check_ray_address(address, timeout_s)


def connect(address: str | None = None) -> str:
    """Join the cluster's Ray as a short driver. A cluster `rlix up` starts admits only holders
    of its Ray token (its owner's, mode 0600): without one here, the cluster from the state file
    is refused at once, and a failed join to another address names the missing token."""
    state = None if address or env.ray_address() else read_state()
    address = cluster_address(address)
    reachable(address)
    if not ray.is_initialized():
        token = env.ray_token_path()
        no_token = f"no Ray token at {token}: the cluster admits only holders of its token (its owner's, mode 0600)"
        if state is not None and state.get("token_auth") and not os.access(token, os.R_OK):
            raise ConfigError(f"cannot join the rlix cluster at {address}: {no_token}")
        try:
            ray.init(address=address, namespace="rlix", log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError) as exc:
            why = no_token if not os.access(token, os.R_OK) else exc.__class__.__name__
            raise ConfigError(f"no Ray cluster answers at {address} ({why})") from None
    return address


# ---------------------------------------------------------------------- up / down
def up(*, num_gpus: int | None, num_cpus: int, gpu_slices: int, quotas: list[str],
       default_quota: int | None, address: str | None, dwell_s: float, aging_s: float,
       rotate_s: float = 120.0, report_stale_s: float | None = None, metrics_port: int | None = None, dashboard_port: int | None = None,
       out: Callable[[str], None] = print) -> dict:
    """Start the head process (or say where the running one is); returns the cluster's state."""
    state = read_state()
    if state is not None:
        out(f"rlix cluster already up at {state['address']} (head pid {state['pid']}): "
            f"{state['gpus']} GPU(s)" + (f"; dashboard {state['dashboard']}" if state.get("dashboard") else ""))
        return state
    if address is None and num_gpus is None:
        raise ConfigError("rlix up: give --num-gpus N for a local cluster, or --address of a Ray cluster")
    parse_quotas(quotas, default_quota)  # a bad --quota fails here, not in the head's log
    if gpu_slices < 1:
        raise ConfigError(f"rlix up: --gpu-slices {gpu_slices}: give 1 or more")
    try:  # the head's planner knobs, checked here rather than in the head's log
        PlannerParams(dwell_s=dwell_s, aging_s=aging_s, rotate_s=rotate_s, report_stale_s=report_stale_s)
    except ValueError as exc:
        raise ConfigError(f"rlix up: {exc}") from None
    for flag, port in (("--metrics-port", metrics_port), ("--dashboard-port", dashboard_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ConfigError(f"rlix up: {flag} {port}: give a port in 0..65535")
    if metrics_port and metrics_port == dashboard_port:
        raise ConfigError(f"rlix up: --metrics-port and --dashboard-port are both {metrics_port}; give each its own")
    cluster_dir().mkdir(parents=True, exist_ok=True)
    state_path().unlink(missing_ok=True)
    # the head runs under a reaper that ends whatever it leaves in its session when it dies
    cmd = [sys.executable, "-m", "rlix.cluster.reaper", "--state", str(state_path()),
           "--jobs", str(jobs_file(state_path())), "--",
           sys.executable, "-m", "rlix.cluster.head", "--state", str(state_path()),
           "--num-cpus", str(num_cpus), "--gpu-slices", str(gpu_slices),
           "--dwell-s", str(dwell_s), "--aging-s", str(aging_s), "--rotate-s", str(rotate_s)]
    if report_stale_s is not None:
        cmd += ["--report-stale-s", str(report_stale_s)]
    cmd += ["--address", address] if address else ["--num-gpus", str(num_gpus)]
    for q in quotas:
        cmd += ["--quota", q]
    if default_quota is not None:
        cmd += ["--default-quota", str(default_quota)]
    for flag, port in (("--metrics-port", metrics_port), ("--dashboard-port", dashboard_port)):
        if port is not None:
            cmd += [flag, str(port)]
    log = cluster_dir() / "head.log"
    head_env = env.child_env()
    env.keep_ray_on_loopback(head_env)  # a Ray it starts binds 127.0.0.1 only
    with open_private(log, "ab") as fh:  # it holds the cluster's address: the owner's alone
        head = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=head_env,
                                start_new_session=True)  # it outlives this command: that is the point
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        state = read_state()
        if state is not None:
            out(f"rlix cluster up at {state['address']} (head pid {state['pid']}): {state['gpus']} GPU(s)"
                f"{' as ' + str(state['scheduled_gpus']) + ' slices' if state['gpu_slices'] > 1 else ''}; "
                f"log {log}")
            for what in ("metrics", "dashboard"):
                if state.get(what):
                    out(f"{what}: {state[what]}")
            return state
        if head.poll() is not None:
            raise ConfigError(f"rlix up: the head exited with code {head.returncode}: "
                              f"{_last_line(log)}")
        time.sleep(0.2)
    head.kill()
    raise ConfigError(f"rlix up: the head did not come up within {UP_TIMEOUT_S:g} s (log {log})")


def down(out: Callable[[str], None] = print) -> None:
    state = read_state()
    if state is None:
        state_path().unlink(missing_ok=True)
        out("no rlix cluster is up")
        return
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)  # the head cancels the jobs, waits for them, ends Ray
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        raise ConfigError(f"rlix down: the head (pid {pid}) did not stop within {DOWN_TIMEOUT_S:g} s; killed it")
    session = state.get("session")
    while session and session_members(int(session), os.getpid()) and time.monotonic() < deadline + GRACE_S:
        time.sleep(0.2)  # the head's reaper ends what the head left, then itself
    out(f"rlix cluster at {state['address']} is down")


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


# ---------------------------------------------------------------------- jobs
def job_from_config(config_path: str, name: str | None, user: str, overrides: Sequence[str] = ()) -> Job:
    cfg = load_config(config_path, overrides)
    preflight(cfg, config_path)
    return Job(name=name or Path(config_path).stem, user=user, config=str(Path(config_path).resolve()),
               run_dir=str(Path(cfg.run_dir).resolve()),
               pipelines=[PipelineNeeds(p.name, p.train_gpus, p.tp, p.min_shards, p.max_shards, p.partial_overlap)
                          for p in cfg.pipelines])


def submit(config_path: str, *, name: str | None = None, user: str | None = None, resume: bool = False,
           overwrite: bool = False, address: str | None = None, overrides: Sequence[str] = (),
           out: Callable[[str], None] = print) -> dict:
    """Queue a config's pipelines as one job and start its driver; returns the job's row. A
    run_dir holding a previous run is refused unless `resume` or `overwrite` (as `rlix run`).
    The job goes through the head's socket with this process's Ray token proved: the head names
    its user by this account (`user` is honoured for the cluster's owner only) and says so when
    it is not the one asked for."""
    job = job_from_config(config_path, name, user or env.user(), overrides)
    if not (resume or overwrite):
        refuse_reused_run_dir(load_config(config_path, overrides), config_path)
    address = connect(address)
    info = ray.get(get_registry().cluster_info.remote())
    answer = submit_job(getattr(info, "submit_socket", ""), job, token=env.ray_token())
    row = answer["row"]
    if answer["note"]:
        out(answer["note"])
    log = Path(job.run_dir) / "driver.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlix.cluster.driver", "--job", job.name, "--config", job.config,
           "--address", address] + (["--resume"] if resume else []) + [f"--set={o}" for o in overrides]
    driver_env = env.child_env()
    env.keep_ray_on_loopback(driver_env)  # so it can join a cluster on 127.0.0.1
    with open_private(log, "ab") as fh:  # it holds the cluster's address: the owner's alone
        subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=driver_env,
                         start_new_session=True)  # an independent Ray job: it outlives this shell
    where = (f"queued, position {row['queue_position']}: {row['reason']}" if row["state"] == "queued"
             else row["state"])
    out(f"submitted job {job.name} (user {row['user']}; pipelines {', '.join(p.name for p in job.pipelines)}): "
        f"{where}; log: rlix logs {job.name}")
    return row


def jobs(address: str | None = None) -> list[dict]:
    connect(address)
    return ray.get(get_registry().jobs.remote())


def jobs_table(rows: list[dict]) -> list[str]:
    """What `rlix jobs` prints: one line per job, the queue's reasons under it."""
    head = ("job", "user", "state", "pipelines", "min/max GPUs", "queue", "since")
    table = [head]
    now = time.time()
    for r in rows:
        since = r["ended_at"] or r["started_at"] or r["submitted_at"]
        table.append((r["name"], r["user"], r["state"] + (" (cancelling)" if r["cancel_requested"]
                                                          and r["state"] not in FINAL else ""),
                      ",".join(r["pipelines"]), f"{r['minimum_gpus']}/{r['most_gpus']}",
                      str(r["queue_position"] or "-"), f"{now - since:.0f}s"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines += [f"  {r['name']}: {r['reason']}" for r in rows if r["reason"]]
    return lines


def cancel(name: str, *, wait_s: float = 60.0, address: str | None = None,
           out: Callable[[str], None] = print) -> dict:
    """Cancel a job (by its name or a pipeline's); waits until it has ended, up to `wait_s`."""
    connect(address)
    registry = get_registry()
    row = ask(registry.cancel.remote(name))
    deadline = time.monotonic() + wait_s
    while row["state"] not in FINAL and time.monotonic() < deadline:
        ray.get(registry.wait_change.remote(1.0))
        row = ray.get(registry.job.remote(row["name"]))
    if row["state"] not in FINAL:
        out(f"job {row['name']}: cancel asked; still {row['state']} after {wait_s:g} s")
    else:
        out(f"job {row['name']}: {row['state']}{' (' + row['reason'] + ')' if row['reason'] else ''}")
    return row


def logs(name: str, *, follow: bool = False, address: str | None = None,
         write: Callable[[str], None] = lambda s: print(s, end="", flush=True)) -> None:
    """Print a job's driver log; with `follow`, keep printing until the job has ended."""
    connect(address)
    registry = get_registry()
    row = ask(registry.job.remote(name))
    path = Path(row["run_dir"]) / "driver.log"
    pos = 0
    while True:
        try:
            with path.open("r", errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
        except FileNotFoundError:
            chunk = ""
        if chunk:
            write(chunk)
        if not follow or ray.get(registry.job.remote(name))["state"] in FINAL:
            if follow:  # what was written between the last read and the end
                with path.open("r", errors="replace") as fh:
                    fh.seek(pos)
                    write(fh.read())
            return
        time.sleep(0.5)
