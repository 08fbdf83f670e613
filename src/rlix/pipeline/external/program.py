"""The program of an external pipeline: started under rlix.procguard (so it ends when the
pipeline's actor dies, SIGKILL included), in a session of its own (ending it ends what it
spawned), its output in a private log file in the run dir, its environment naming the pipeline
(rlix.env.ClientTarget) and holding no token."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlix import env
from rlix.config.models import PYTHON_WORDS
from rlix.private_files import open_private
from rlix.procguard import guarded_pid, stop_session


class ProgramProcess:
    """One start of `command` (argv, no shell) in `cwd`, with `extra_env` added."""

    def __init__(self, command: list[str], *, log_path: Path, extra_env: dict[str, str], cwd: str | None = None) -> None:
        self.command, self.log_path, self.extra_env, self.cwd = list(command), log_path, extra_env, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        guard = [sys.executable, "-m", "rlix.procguard", "--parent", str(os.getpid()), "--"]
        command = list(self.command)
        if command[0] in PYTHON_WORDS:  # rlix's own interpreter, where rlix.client imports
            command[0] = sys.executable
        with open_private(self.log_path, "a") as log:
            self.proc = subprocess.Popen(guard + command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.cwd, start_new_session=True,
                                         env=env.child_env(self.extra_env, drop=env.TOKEN_VARS))

    def poll(self) -> int | None:
        """Its exit code once it ended (the guard's: the program's own, 128+N if a signal N
        ended it), else None."""
        return None if self.proc is None else self.proc.poll()

    def pid(self) -> int | None:
        """The program's own PID (the guard's child), None when it is not running."""
        return None if self.proc is None else guarded_pid(self.proc.pid)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> int | None:
        """End it and its session (SIGTERM, SIGKILL after `grace_s`); its exit code."""
        return None if self.proc is None else stop_session(self.proc, grace_s)
