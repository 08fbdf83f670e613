"""One submitted job's driver: the process `rlix submit` starts, in a session of its own.

It joins the shared cluster, waits for the registry to admit its job (saying its place in the
queue and why it waits), then runs the job's pipelines against the cluster's scheduler exactly
as `rlix run` runs its own (same output, same files under the job's run_dir), and reports how it
ended. A cancel (`rlix cancel`) reaches it through the registry: it stops its pipelines the way
Ctrl-C does (each saves a checkpoint) and leaves, so their GPUs go back to the others.
Its output is the job's log (`rlix logs NAME`).

    python -m rlix.cluster.driver --job NAME --config PATH --address ADDR [--resume] [--set PATH=VALUE ...]
"""

from __future__ import annotations

import _thread
import argparse
import os
import socket
import sys
import threading
import time

import ray

from rlix.cluster.registry import get_registry
from rlix.config import load_config
from rlix.errors import one_line
from rlix.run import device_plan, follow, prepare_run_dir
from rlix.run_log import RunLog

#: how often the driver looks for a cancel of its job
CANCEL_POLL_S = 0.5


def wait_for_admission(registry, name: str, say) -> bool:  # type: ignore[no-untyped-def]
    """Until the job is admitted (True) or cancelled while queued (False)."""
    said = None
    while True:
        job = ray.get(registry.job.remote(name))
        if job["state"] == "admitted":
            return True
        if job["state"] != "queued":
            say(f"job {name}: {job['state']} before it started ({job['reason']})")
            return False
        line = f"job {name}: queued, position {job['queue_position']}: {job['reason']}"
        if line != said:
            say(line)
            said = line
        ray.get(registry.wait_change.remote(5.0))


def watch_for_cancel(registry, name: str, done: threading.Event) -> None:  # type: ignore[no-untyped-def]
    """Interrupt the main thread (as Ctrl-C would) once the job's cancel is asked for."""
    while not done.wait(CANCEL_POLL_S):
        try:
            if ray.get(registry.job.remote(name), timeout=30)["cancel_requested"]:
                _thread.interrupt_main()
                return
        except Exception:  # noqa: BLE001 - the registry restarting: ask again next round
            continue


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlix-driver", description=__doc__.split("\n")[0])
    ap.add_argument("--job", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="rlix submit's --set items, in order")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    run_dir = prepare_run_dir(cfg, args.config)
    say = RunLog(run_dir / "run.log", sys.stdout)
    ray.init(address=args.address, namespace="rlix", log_to_driver=False, logging_level="ERROR")
    registry = get_registry()
    name = args.job
    ray.get(registry.attach_driver.remote(name, os.getpid(), socket.gethostname()))
    if not wait_for_admission(registry, name, say):
        return 0
    info = ray.get(registry.cluster_info.remote())
    from rlix.scheduler.service import get_scheduler  # deferred: only a running job needs it

    scheduler = get_scheduler()
    changes = ray.get(scheduler.role_changes.remote(0))
    done = threading.Event()
    threading.Thread(target=watch_for_cancel, args=(registry, name, done), daemon=True).start()
    state, reason = "done", ""
    t_start = time.perf_counter()
    try:
        ray.get(registry.set_state.remote(name, "running"))
        devices = device_plan(cfg, info.reservation)
        say(f"job {name} on the cluster at {info.address}: {len(cfg.pipelines)} pipeline(s), "
            f"{info.topology.num_gpus} GPU(s) shared ({devices.device}), run dir {run_dir}")
        result = follow(cfg, args.config, mode="rlix", run_dir=run_dir, say=say, devices=devices,
                        scheduler=scheduler, all_gpus=list(range(info.topology.num_gpus)),
                        resume=args.resume, t_start=t_start,
                        role_log_from=changes[-1]["seq"] if changes else 0)
        failed = [n for n, p in result.pipelines.items() if p.failed]
        if failed:
            state, reason = "failed", f"pipeline(s) {failed} failed"
    except KeyboardInterrupt:
        state, reason = "cancelled", "cancelled; checkpoints saved"
    except BaseException as exc:  # noqa: BLE001 - its end is reported, then it leaves
        state, reason = "failed", one_line(exc)
        say(f"job {name} failed: {reason}")
    finally:
        done.set()
        ray.get(registry.set_state.remote(name, state, reason), timeout=60)
        say(f"job {name}: {state}{f' ({reason})' if reason else ''}")
        say.close()
    return 0 if state != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
