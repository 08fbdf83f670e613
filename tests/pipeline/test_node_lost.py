"""The run's only Ray node dies (its raylet SIGKILLed by PID) during a two-pipeline `rlix run`
(CPU, 2 fake GPUs): the run ends with one line saying so (NodeLostError), its summary says why,
and no /dev/shm weight-cache segment of its trainers is left (their workers outlive the raylet
until the run ends them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlix.cluster.reaper import session_members

pytestmark = pytest.mark.slow  # a whole run: ~1 min on 2 cores


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _trainers(processes: Path) -> set[int]:
    """The trainer PIDs processes.json lists (a pipeline still setting up has none yet)."""
    try:
        listed = json.loads(processes.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-replace
        return set()
    return {int(p["trainer"]) for p in listed.values() if p.get("trainer") is not None}


@pytest.mark.skipif(not Path("/proc").is_dir() or not Path("/dev/shm").is_dir(), reason="Linux /proc, /dev/shm")
def test_a_killed_raylet_ends_the_run_with_its_reason_and_no_segment_left(tmp_path):
    pipe = {"model": "tiny", "train_gpus": 1, "min_shards": 1, "max_shards": 2, "steps": 500,
            "checkpoint_every": 0, "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 4, "group_size": 4, "max_new_tokens": 8, "concurrency": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "control_plane": "rlix", "run_dir": str(tmp_path / "run"),
           "pipelines": [{**pipe, "name": "pa", "seed": 1}, {**pipe, "name": "pb", "seed": 2}]}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    raylet = None
    try:
        metrics = tmp_path / "run" / "pb" / "metrics.jsonl"
        trainers: set[int] = set()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            trainers = _trainers(tmp_path / "run" / "processes.json")
            # both pipelines have placed their trainers (one may still be setting up when the
            # other has trained), and one has trained twice
            if len(trainers) == 2 and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert len(trainers) == 2, trainers
        segments = [n for n in os.listdir("/dev/shm") if n.startswith("rlix-w-")
                    and int(n.split("-")[2]) in trainers]
        assert segments, "the trainers hold no weight cache to leave behind"
        raylet = next(p for p in _children(proc.pid) if b"raylet/raylet" in _cmdline(p))
        os.kill(raylet, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("rlix: error: the Ray node(s) ") and "running this run died" in last, last
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["ending"].startswith("failed: NodeLostError: the Ray node(s)"), summary["ending"]
        left = [n for n in os.listdir("/dev/shm") if n.startswith("rlix-w-") and int(n.split("-")[2]) in trainers]
        assert left == [], left
        assert not any(Path(f"/proc/{t}").exists() and b"ray::" in _cmdline(t) for t in trainers)
        # what Ray's own shutdown left of its session (GCS, agents) is gone within a few seconds
        deadline = time.monotonic() + 30
        while session_members(proc.pid, os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [_cmdline(p)[:80] for p in session_members(proc.pid, os.getpid())] == []
    finally:
        for pid in session_members(proc.pid, os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
