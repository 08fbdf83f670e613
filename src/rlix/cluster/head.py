"""The head of a shared rlix cluster: the process `rlix up` leaves running.

It starts a local Ray cluster (or joins one given by address), reserves its GPUs for rlix,
starts the scheduler (detached, restarted by Ray when its worker dies) and the job registry, then
writes the cluster's state file, which is how every later command finds the cluster. Jobs come
in through its submission socket (rlix.cluster.intake), which names each job's user by the
account that connects, and reach the registry with a key only this process holds. It lives
until `rlix down` sends it SIGTERM: then it cancels the live jobs, waits for their drivers to
stop them (each saves a checkpoint), and takes everything down, its Ray cluster included.

    python -m rlix.cluster.head --state FILE [--num-gpus N] [--num-cpus N] [--gpu-slices K]
                                [--quota USER=N ...] [--default-quota N] [--address ADDR]
                                [--rotate-s S] [--report-stale-s S]
                                [--metrics-port N] [--dashboard-port N]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import ray

from rlix import env
from rlix.cluster.jobs import FINAL, Job, book_file_text, end_unfinished, jobs_file, parse_quotas, read_book_file
from rlix.cluster.intake import SUBMIT_TIMEOUT_S, SubmitServer
from rlix.cluster.registry import ClusterInfo, ask, start_registry
from rlix.httpkit import capped
from rlix.placement import GpuReservation
from rlix.private_files import write_private
from rlix.run import keep_ray_token_private, say_where_ray_listens
from rlix.scheduler.curves import JobRow
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.service import start_scheduler, topology_from_ray

#: how long `rlix down` lets running jobs stop (checkpoint, leave, summary) before ending the
#: cluster: more than a driver's own bound on stopping its pipelines (rlix.supervise's
#: STOP_TIMEOUT_S + SUMMARY_TIMEOUT_S), so that a slow stop is never cut short by the head
DRAIN_TIMEOUT_S = 180.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlix-head", description=__doc__.split("\n")[0])
    ap.add_argument("--state", required=True, help="where to write the cluster's state (JSON)")
    ap.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    ap.add_argument("--num-gpus", type=int, default=None, help="GPUs of the local Ray cluster (fake on CPU)")
    ap.add_argument("--num-cpus", type=int, default=16)
    ap.add_argument("--gpu-slices", type=int, default=1)
    ap.add_argument("--quota", action="append", default=[])
    ap.add_argument("--default-quota", type=int, default=None)
    ap.add_argument("--dwell-s", type=float, default=30.0)
    ap.add_argument("--aging-s", type=float, default=60.0)
    ap.add_argument("--rotate-s", type=float, default=120.0)
    ap.add_argument("--report-stale-s", type=float, default=None)
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--dashboard-port", type=int, default=None)
    args = ap.parse_args(argv)
    quotas = parse_quotas(args.quota, args.default_quota)
    state = Path(args.state)
    stop = threading.Event()
    if args.address:
        ray.init(address=args.address, namespace="rlix", log_to_driver=False, logging_level="ERROR")
    else:
        ray.init(num_cpus=args.num_cpus, num_gpus=args.num_gpus, namespace="rlix", include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        say_where_ray_listens(lambda line: print(f"rlix head: {line}", flush=True))
    keep_ray_token_private(lambda line: print(f"rlix head: {line}", flush=True))
    # what a client proves it holds to submit a job: the token this Ray admits its holders by
    token = env.ray_token() if env.ray_token_auth() else None
    if env.ray_token_auth() and token is None:
        ray.shutdown()
        print(f"rlix head: Ray uses token auth but no token is readable here ({env.ray_token_path()})",
              flush=True)
        return 2
    # after ray.init, which installs handlers of its own: `rlix down` must drain the jobs first
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    gpus = topology_from_ray()
    reservation = GpuReservation.reserve(gpus, slices=args.gpu_slices)
    topology = gpus.sliced(args.gpu_slices)
    params = PlannerParams(dwell_s=args.dwell_s, aging_s=args.aging_s, rotate_s=args.rotate_s,
                           report_stale_s=args.report_stale_s)
    scheduler = start_scheduler(topology, params, detached=True, real_gpus=reservation.has_cuda,
                                metrics_port=args.metrics_port, dashboard_port=args.dashboard_port)
    urls = _endpoints(scheduler)
    if isinstance(urls, str):  # a port it cannot listen on: `rlix up` shows this last line
        ray.kill(scheduler, no_restart=True)
        reservation.release()
        ray.shutdown()
        print(f"rlix head: {urls}", flush=True)
        return 2
    address = ray.get_runtime_context().gcs_address
    # the registry takes jobs from this process alone: a key made here, handed to it at its
    # construction (never on a command line or in a file)
    head_key = secrets.token_bytes(32)
    intake = SubmitServer(token, say=lambda line: print(f"rlix head: {line}", flush=True))
    info = ClusterInfo(address=address, reservation=reservation, topology=topology,
                       gpu_slices=args.gpu_slices, params=params, started_at=time.time(),
                       submit_socket=str(intake.path))
    # the jobs of the cluster's earlier life: ended by its reaper when its head died (or here,
    # when nothing ended them), shown by `rlix jobs`
    book_file = jobs_file(state)
    earlier = read_book_file(book_file)
    end_unfinished(earlier, "the cluster went down without ending it (its head did not stop cleanly)")
    registry = None
    try:
        registry = start_registry(info, quotas, tuple(Job.from_record(r) for r in earlier), head_key)
        ray.get(registry.jobs.remote())  # up and answering
        registry.watch_drivers.remote()  # for as long as the registry lives
        intake.serve(lambda job: ask(registry.submit.remote(job, head_key), timeout=SUBMIT_TIMEOUT_S))
    except BaseException:
        intake.close()
        raise
    # mode 0600: the cluster's address (and its endpoints') is for its owner's commands only
    write_private(state, json.dumps({"address": address, "pid": os.getpid(), "session": os.getsid(0),
                                     "gpus": gpus.num_gpus,
                                     "scheduled_gpus": topology.num_gpus, "gpu_slices": args.gpu_slices,
                                     "cuda": reservation.has_cuda, "started_at": info.started_at,
                                     "token_auth": env.ray_token_auth(), "submit_socket": str(intake.path),
                                     "quotas": {"users": quotas.users, "default": quotas.default}, **urls}))
    print(f"rlix head: up at {address}, {gpus.num_gpus} GPU(s)"
          f"{f' as {topology.num_gpus} slices' if args.gpu_slices > 1 else ''}", flush=True)
    for what, url in urls.items():
        if url:
            print(f"rlix head: {what} at {url}", flush=True)
    print(f"rlix head: takes jobs at {intake.path} (from any local account holding the cluster's token; "
          f"a job counts against the account that submits it)", flush=True)
    written = ""
    queue = _QueueShown(scheduler) if urls.get("dashboard") else None
    try:
        while not stop.wait(1.0):
            written = _save_book(registry, book_file, written)
            if queue is not None:
                queue.push(registry)
        intake.close()  # no new job while the live ones are stopped
        print("rlix head: going down: cancelling live jobs", flush=True)
        t_down = time.monotonic()
        live = ray.get(registry.live_jobs.remote(), timeout=30)
        for job in live:
            ray.get(registry.cancel.remote(job["name"]), timeout=30)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and ray.get(registry.live_jobs.remote(), timeout=30):
            time.sleep(0.5)
        left = ray.get(registry.live_jobs.remote(), timeout=30)
        for job in left:  # a driver that did not stop in time is ended by its PID
            if job.get("driver_pid"):
                print(f"rlix head: the driver of job {job['name']} (pid {job['driver_pid']}) did not "
                      f"stop within {DRAIN_TIMEOUT_S:g} s of its cancel; killing it", flush=True)
                try:
                    os.kill(job["driver_pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        print(f"rlix head: jobs stopped in {time.monotonic() - t_down:.1f} s", flush=True)
        ray.get(registry.forget.remote(), timeout=30)
        book_file.unlink(missing_ok=True)  # every job ended: a clean end keeps no book
    finally:
        intake.close()
        for actor in (registry, scheduler):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - going down anyway
                pass
        reservation.release()
        state.unlink(missing_ok=True)
        ray.shutdown()
        print("rlix head: down", flush=True)
    return 0


def _save_book(registry, path: Path, written: str) -> str:  # type: ignore[no-untyped-def]
    """The registry's jobs to `path` (0600) when they changed since `written`; returns what the
    file holds. A registry that does not answer (restarting) is asked again next time."""
    try:
        text = book_file_text(ray.get(registry.records.remote(), timeout=10))
    except Exception:  # noqa: BLE001 - Ray restarts the registry: the next round writes
        return written
    if text != written:
        write_private(path, text)
    return text


def job_row(row: dict) -> JobRow:
    """A job as the registry lists it (`JobBook.row`), as the dashboard's queue shows it."""
    state = str(row["state"])
    group = "ended" if state in FINAL else "waiting" if state == "queued" else "running"
    return JobRow(name=row["name"], user=row["user"], state=state, group=group,
                  pipelines=[str(p) for p in row["pipelines"]][:32], min_gpus=row["minimum_gpus"],
                  max_gpus=row["most_gpus"], queue_position=row.get("queue_position"),
                  reason=capped(str(row.get("reason") or ""), 300), submitted_at=row["submitted_at"],
                  started_at=row.get("started_at"), ended_at=row.get("ended_at"))


class _QueueShown:
    """The registry's jobs to the scheduler's dashboard: when they change, and every
    RESEND_S anyway (a restarted scheduler starts with no queue)."""

    RESEND_S = 10.0

    def __init__(self, scheduler) -> None:  # type: ignore[no-untyped-def]
        self.scheduler = scheduler
        self.shown: list[JobRow] | None = None
        self.at = 0.0

    def push(self, registry) -> None:  # type: ignore[no-untyped-def]
        try:
            rows = [job_row(r) for r in ray.get(registry.jobs.remote(), timeout=10)]
        except Exception:  # noqa: BLE001 - Ray restarts the registry: the next round pushes
            return
        if rows == self.shown and time.monotonic() - self.at < self.RESEND_S:
            return
        self.scheduler.show_jobs.remote(rows)  # not awaited: the dashboard waits, the head does not
        self.shown, self.at = rows, time.monotonic()


def _endpoints(scheduler) -> dict | str:
    """{"metrics": url, "dashboard": url} the scheduler serves (None: not asked for), or the
    one-line problem of a port it could not listen on."""
    urls = {}
    for what, field in (("metrics", "--metrics-port"), ("dashboard", "--dashboard-port")):
        endpoint = ray.get(getattr(scheduler, f"{what}_endpoint").remote())
        if endpoint["error"]:
            return f"{field}: {endpoint['error']}"
        urls[what] = endpoint["url"]
    return urls


if __name__ == "__main__":
    sys.exit(main())
