"""The head's reaper: whatever the head leaves in its session is ended once the head is gone,
whether it exits or is SIGKILLed; a SIGTERM to the reaper reaches the head."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlix.cluster.intake import SOCKET_DIR_PREFIX
from rlix.cluster.reaper import session_members

# a stand-in head: starts a child that outlives it (as Ray's agents do), writes both PIDs, waits
HEAD = """
import os, subprocess, sys, time, signal
ready = sys.argv[1] + ".ready"
child = subprocess.Popen([sys.executable, "-c", "import sys, time, signal; signal.signal(signal.SIGTERM, "
                          "signal.SIG_IGN); open(sys.argv[1], 'w').close(); time.sleep(120)", ready])
while not os.path.exists(ready):
    time.sleep(0.01)
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
time.sleep(float(sys.argv[2]))
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


#: the head's book file: one job still running, one that ended
BOOK = {"jobs": [{"name": "live", "user": "ann", "state": "running", "reason": "", "ended_at": None},
                 {"name": "old", "user": "ann", "state": "done", "reason": "", "ended_at": 1.0}]}


def start(tmp_path: Path, head_s: float, state_text: str = "{}") -> tuple[subprocess.Popen, int, int, Path]:
    pids, state = tmp_path / "pids", tmp_path / "state.json"
    state.write_text(state_text)
    (tmp_path / "jobs.json").write_text(json.dumps(BOOK))
    reaper = subprocess.Popen([sys.executable, "-m", "rlix.cluster.reaper", "--state", str(state),
                               "--jobs", str(tmp_path / "jobs.json"), "--",
                               sys.executable, "-c", HEAD, str(pids), str(head_s)],
                              start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    head, child = map(int, pids.read_text().split())
    return reaper, head, child, state


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the reaper reads /proc")
def test_a_sigkilled_heads_leftovers_are_ended(tmp_path):
    # the head's job submission socket, in the directory it made under /tmp (rlix.cluster.intake)
    sock_dir = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir="/tmp"))
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(sock_dir / "submit.sock"))
    listening.close()  # its file stays, as a SIGKILLed head leaves it
    reaper, head, child, state = start(tmp_path, 120, json.dumps({"submit_socket": str(sock_dir / "submit.sock")}))
    try:
        assert set(session_members(reaper.pid, reaper.pid)) >= {head, child}
        os.kill(head, signal.SIGKILL)
        t0 = time.monotonic()
        assert reaper.wait(timeout=30) == 128 + signal.SIGKILL
        assert not alive(child)  # it ignored SIGTERM: the reaper's SIGKILL ended it
        assert time.monotonic() - t0 >= 4.0  # after the grace period, not before
        assert not state.exists()  # the dead head's state file is not left to mislead `rlix status`
        assert not sock_dir.exists()  # nor its socket in /tmp
        assert "ended 1 process(es)" in reaper.stderr.read()
        # the job that was running is recorded as ended, with how; the one that ended is kept
        book = tmp_path / "jobs.json"
        jobs = {j["name"]: j for j in json.loads(book.read_text())["jobs"]}
        assert jobs["live"]["state"] == "failed" and jobs["live"]["ended_at"] is not None
        assert jobs["live"]["reason"] == (f"the cluster's head (pid {head}) was killed by signal 9 (SIGKILL) "
                                          f"while the job was running"), jobs["live"]
        assert jobs["old"] == BOOK["jobs"][1]
        assert book.stat().st_mode & 0o777 == 0o600
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        for pid in (head, child, reaper.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the reaper reads /proc")
def test_a_sigterm_reaches_the_head_which_exits_cleanly(tmp_path):
    reaper, head, child, state = start(tmp_path, 120)
    try:
        reaper.send_signal(signal.SIGTERM)
        assert reaper.wait(timeout=30) == 0
        assert not alive(head) and not alive(child)
        assert state.exists()  # a clean exit: the head owns its state file
        assert json.loads((tmp_path / "jobs.json").read_text()) == BOOK  # and its book
    finally:
        for pid in (head, child, reaper.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
