"""rlix.procguard: the command ends when its owner dies (SIGKILL included), and a SIGTERM to
the group (the owner's normal stop) ends the command at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _state(pid) in (None, "Z"):
            return True
        time.sleep(0.02)
    return False


def test_command_and_cleanup_dir_end_when_the_owner_is_sigkilled(tmp_path):
    cleanup = tmp_path / "private"
    cleanup.mkdir()
    owner_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-m", "rlix.procguard", "--parent", str(os.getpid()),
                              "--cleanup", {str(cleanup)!r}, "--", "sleep", "300"],
                             start_new_session=True)
        while not os.path.exists(f"/proc/{{g.pid}}/task/{{g.pid}}/children") or \\
                not open(f"/proc/{{g.pid}}/task/{{g.pid}}/children").read().split():
            time.sleep(0.01)
        print(g.pid, open(f"/proc/{{g.pid}}/task/{{g.pid}}/children").read().split()[0], flush=True)
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    try:
        guard, child = map(int, owner.stdout.readline().split())
        assert _state(child) not in (None, "Z")
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(5)
        assert _gone(child, 5) and _gone(guard, 5)
        assert not cleanup.exists()
    finally:
        owner.kill()
        owner.wait(5)


def test_sigterm_to_the_group_ends_the_command_at_once():
    guard = subprocess.Popen([sys.executable, "-m", "rlix.procguard", "--parent", str(os.getpid()),
                              "--", "sleep", "300"], start_new_session=True)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.killpg(guard.pid, signal.SIGTERM)
        assert guard.wait(5) == 128 + signal.SIGTERM  # the command's end, reported as a shell would
        assert time.monotonic() - t0 < 2  # the command did not inherit an ignored SIGTERM
    finally:
        guard.kill()
        guard.wait(5)


def test_the_command_dies_with_its_guard_even_when_the_guard_is_sigkilled():
    """Ray SIGKILLs a dead worker's children, the guard among them; the kernel then ends the
    command (parent-death signal), so no server outlives both."""
    guard = subprocess.Popen([sys.executable, "-m", "rlix.procguard", "--parent", str(os.getpid()),
                              "--", "sleep", "300"], start_new_session=True)
    try:
        children = Path(f"/proc/{guard.pid}/task/{guard.pid}/children")
        deadline = time.monotonic() + 5
        while not (children.exists() and children.read_text().split()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child = int(children.read_text().split()[0])
        os.kill(guard.pid, signal.SIGKILL)
        guard.wait(5)
        assert _gone(child, 5)
    finally:
        guard.kill()
        guard.wait(5)
