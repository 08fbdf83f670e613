"""`rlix status`: the table's rows from a real scheduler's snapshot, and the live view against a
running cluster (a real Ray cluster and scheduler, `rlix status` as a subprocess)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from rich.console import Console

from rlix.cluster.status_view import render
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.dashboard import DashboardFeed
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.service import start_scheduler, topology_from_ray
from rlix.scheduler.types import PipelineSpec, Progress, Stage, Topology

PARAMS = PlannerParams(dwell_s=0.0, aging_s=60.0)


def test_tables_show_the_ledger_and_the_reports():
    now = [100.0]
    core = SchedulerCore(Topology((2, 2)), PARAMS, clock=lambda: now[0])
    feed = DashboardFeed(clock=lambda: now[0])
    core.register(PipelineSpec("alpha", priority=1, max_shards=2))
    core.register(PipelineSpec("beta", max_shards=2))
    core.report_progress(Progress("alpha", remaining=12, target=16, step=3))
    core.replan("test")
    feed.start(core)
    now[0] = 104.0
    core.submit_request("alpha", Stage.TRAIN, 1)
    feed.refresh(core)
    now[0] = 105.0
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(feed.state(60), "127.0.0.1:1", ["job  user"]))
    screen = console.export_text()
    rows = table_rows(screen)
    held = {g for gs in core.shard_gpus("alpha").values() for g in gs}
    assert {int(r[0]) for r in rows if r[2] == "alpha" and r[3].startswith("generate")} == held
    assert all(r[4] == "5.0s" for r in rows if r[2] in ("alpha", "beta") and len(r) == 5)
    assert [r[1] for r in rows if len(r) == 5 and r[0].isdigit()] == ["0", "0", "1", "1"]
    alpha = next(r for r in rows if r[0] == "alpha")
    assert alpha[1] == "waiting" and alpha[6] == "3" and alpha[7] == "12"
    assert alpha[8] == "train 1 GPU for 1.0s"  # not planned yet: it waits, and for what
    beta = next(r for r in rows if r[0] == "beta")
    assert beta[6] == "-" and beta[8] == "-"
    assert "job  user" in screen

    core.replan("train")
    feed.refresh(core)
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(feed.state(60), "x"))
    rows = table_rows(console.export_text())
    assert any(r[2] == "alpha" and r[3] == "train" for r in rows)


def table_rows(screen: str) -> list[list[str]]:
    """The cells of every body row of the rich tables on a screen."""
    return [[c.strip() for c in line.strip().strip("│").split("│")]
            for line in screen.splitlines() if line.startswith("│")]


@ray.remote(num_cpus=0)
class Coordinator:
    async def resize_inference(self, remove, add):
        await asyncio.sleep(0)


def test_live_table_against_a_running_cluster(tmp_path):
    ray.shutdown()
    info = ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, namespace="rlix-test",
                    logging_level="warning")
    proc = None
    try:
        sched = start_scheduler(topology_from_ray(), PARAMS, liveness_interval_s=1.0)
        coords = [Coordinator.remote(), Coordinator.remote()]
        ray.get(sched.register.remote(PipelineSpec("alpha", max_shards=2), coords[0]))
        ray.get(sched.register.remote(PipelineSpec("beta", max_shards=2), coords[1]))
        ray.get(sched.request.remote("beta", "rollout"), timeout=30)
        out = tmp_path / "status.txt"
        with open(out, "w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlix.cli", "status", "--watch", "--interval", "0.5", "--count", "40",
                 "--address", info.address_info["gcs_address"]],
                stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        deadline = time.monotonic() + 60
        while out.read_text().count("--- rlix status at") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert out.read_text().count("--- rlix status at") >= 2, out.read_text()
        ray.get(sched.request.remote("alpha", "train", 1), timeout=30)  # a GPU changes role
        frames_before = out.read_text().count("--- rlix status at")
        while out.read_text().count("--- rlix status at") < frames_before + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends the live view quietly
        assert proc.wait(timeout=30) == 0
        frames = out.read_text().split("--- rlix status at")[1:]
        assert len(frames) >= 4
        for f in frames:
            assert "alpha" in f and "beta" in f, f
        gpu_tables = [f.split("pipeline(s) registered")[0] for f in frames]
        assert "train" not in gpu_tables[0] and "train" in gpu_tables[-1]
        assert "Traceback" not in out.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        ray.shutdown()


def test_against_no_cluster_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "rlix.cli", "status", "--address", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    assert "no Ray cluster answers" in done.stderr
