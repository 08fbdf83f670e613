"""`python -m rlix.cluster.reaper -- CMD...`: run the cluster's head (CMD) and, once it has
exited for any reason, end every process left in this session.

Why: the head starts Ray's processes (GCS, raylet, their agents, actor workers) in the session
`rlix up` gives it. When the head is SIGKILLed, Ray ends most of them, but some agents are
re-parented to init and live on (seen: DashboardAgent and RuntimeEnvAgent). The reaper is the
session's leader, so whatever the head leaves behind shares its session id; it sends those
SIGTERM, then SIGKILL after a grace period, and removes the state file the dead head wrote (and
the job submission socket it names, with its directory: rlix.cluster.intake). A
SIGTERM to the reaper (as `rlix down` would send the head) is passed on to the head. Linux only
(/proc); the standard library and rlix's Ray-free modules only. When the head died, the jobs
still live in its book file are recorded as failed, with how the head ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlix.cluster.jobs import book_file_text, end_unfinished, read_book_file
from rlix.private_files import write_private

GRACE_S = 5.0


def session_members(sid: int, exclude: int) -> list[int]:
    """PIDs of live processes in session `sid`, but `exclude` (from /proc; [] off Linux)."""
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(") ", 1)[1].split()
        # fields after the name: state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def end_session(sid: int, me: int, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every other process of the session, SIGKILL what is left after `grace_s`; returns
    the PIDs found at first."""
    found = session_members(sid, me)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid in session_members(sid, me):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and session_members(sid, me):
            time.sleep(0.1)
    return found


def record_head_death(path: Path, why: str) -> int:
    """The jobs still live in the head's book file end as failed with `why`: the next `rlix up`
    lists them so. Returns how many."""
    records = read_book_file(path)
    n = end_unfinished(records, why)
    if n:
        write_private(path, book_file_text(records))
    return n


def remove_state(path: Path) -> None:
    """A dead head's state file, and the submission socket it names (with its directory)."""
    try:
        sock = json.loads(path.read_text()).get("submit_socket")
    except (OSError, ValueError, AttributeError):
        sock = None
    if isinstance(sock, str) and sock:
        from rlix.cluster.intake import remove_socket  # deferred: only a dead head's leftovers need it

        remove_socket(sock)
    path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlix.cluster.reaper")
    parser.add_argument("--state", default=None, help="the head's state file, removed if the head died")
    parser.add_argument("--jobs", default=None, help="the head's book file: live jobs there are failed, "
                                                     "with how the head ended, if it died")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command to run after --")
    head = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: head.send_signal(signum))
    code = head.wait()
    me = os.getpid()
    left = end_session(os.getsid(0), me)
    if code < 0 or left:  # killed, or it left processes behind: say so in the head's log
        print(f"rlix reaper: the head exited with {code}; ended {len(left)} process(es) it left",
              file=sys.stderr, flush=True)
    if code != 0 and args.state:
        remove_state(Path(args.state))
    if code != 0 and args.jobs:
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
               else f"exited with code {code}")
        record_head_death(Path(args.jobs), f"the cluster's head (pid {head.pid}) {how}")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
