"""Faults of an external pipeline, caused for real: its program SIGKILLed by PID mid-run (its
GPUs go back, the native pipeline beside it finishes), and a program that holds its training
GPUs past external.after_training_timeout_s (failed, with that reason)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from rlix.procguard import pid_alive
from rlix.run import run

HERE = Path(__file__).resolve().parent
NATIVE = {"name": "native", "model": "tiny", "steps": 6, "seed": 1, "max_shards": 2,
          "task": {"name": "pattern", "patterns": ["a"]},
          "rollout": {"groups_per_step": 2, "group_size": 4, "max_new_tokens": 8, "concurrency": 2}}


def write(tmp_path: Path, pipelines: list[dict]) -> Path:
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "control_plane": "rlix", "run_dir": str(tmp_path / "run"),
           "scheduler": {"dwell_s": 0.2, "aging_s": 5}, "pipelines": pipelines}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_a_killed_program_fails_its_pipeline_only_and_its_gpus_go_back(tmp_path):
    pid_file = tmp_path / "program.pid"
    ext = {"name": "ext", "model": "tiny", "steps": 200, "max_shards": 2,
           "external": {"command": [sys.executable, str(HERE / "pid_then_loop.py"), str(pid_file)]}}
    # the native pipeline runs long enough (~0.1-0.3 s a step) to be running at the kill
    path = write(tmp_path, [dict(NATIVE, steps=150), ext])
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "run" / "ext" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and metrics.read_text().strip()):  # a step of its own done
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.2)
        program = int(pid_file.read_text())
        os.kill(program, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not pid_alive(program)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    native, failed = summary["pipelines"]["native"], summary["pipelines"]["ext"]
    assert native["state"] == "done" and native["steps"] == 150, out
    assert failed["state"] == "failed" and "its program exited with code" in failed["error"], failed["error"]
    # its GPUs went back to the scheduler (unregistered), and the native pipeline, still running,
    # took GPUs after the kill
    killed_at = max(json.loads(line)["finished_at"] for line in metrics.read_text().splitlines())
    later = [c for c in summary["role_changes"] if c["at"] > killed_at]
    assert [c for c in later if c["before"].startswith("ext/") and c["reason"] == "unregister"], later
    assert [c for c in later if c["after"].startswith("native/")], later
    # and no process of the failed pipeline is left: its shards ended with it
    shard_pids = [p["pid"] for p in failed.get("shard_placements", []) if p.get("pid")]
    assert shard_pids and not [p for p in shard_pids if pid_alive(p)], failed.get("shard_placements")


@pytest.mark.slow
def test_a_step_that_never_calls_after_training_fails_with_the_reason(tmp_path):
    ext = {"name": "stuck", "model": "tiny", "steps": 3,
           "external": {"command": [sys.executable, str(HERE / "stuck_program.py")], "after_training_timeout_s": 3}}
    path = write(tmp_path, [dict(NATIVE, steps=3), ext])
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    stuck = summary["pipelines"]["stuck"]
    assert stuck["state"] == "failed", stuck
    assert "held its training GPUs" in stuck["error"] and "after_training_timeout_s" in stuck["error"], stuck["error"]
    assert summary["pipelines"]["native"]["state"] == "done" and summary["pipelines"]["native"]["steps"] == 3
