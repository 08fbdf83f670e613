"""One engine server process: start it on a free port, wait until healthy, end it by its PID.

Plain class used both directly (tests, single-machine fleets) and inside the shard Ray actor.
The child runs in its own session, so ending it also ends whatever it spawned (vLLM starts an
engine-core process): SIGTERM to its process group (whose id is the child's PID), SIGKILL if it
has not exited after a grace period. The child is `rlix.procguard` running the server: if this
process dies without stopping it (SIGKILL), the guard ends the group and removes the log dir of
our own, so no server outlives its owner.

The bearer token reaches the server in its environment (backends.server_launch), never its
command line; the log (which holds the server's address) is mode 0600.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rlix import env
from rlix.errors import EngineStateError
from rlix.httpkit import free_port
from rlix.inference.fleet.api import EngineBackend
from rlix.inference.fleet.backends import server_launch
from rlix.inference.fleet.startup import ShardStartup, StartupWatch
from rlix.private_files import open_private
from rlix.procguard import guarded_pid, stop_session


#: a server that lost its port to another binder says this (uvicorn, from the OS's EADDRINUSE)
PORT_IN_USE = "address already in use"
PORT_RETRIES = 3


class ShardProcess:
    """A backend's server process for one shard."""

    def __init__(self, backend: EngineBackend, api_key: str, host: str = "127.0.0.1",
                 port: int | None = None, log_dir: str | Path | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.api_key = api_key
        self.host = host
        self.port = port or free_port(host)
        self._port_chosen_here = not port  # chosen again if another process takes it first
        # Without a log_dir the log lives in a temp dir of our own, removed by stop(): its
        # tail is already in any start-up error, and hundreds of shard starts leave nothing.
        self._own_log_dir = None if log_dir else tempfile.mkdtemp(prefix="rlix-shard-")
        self.log_path = Path(log_dir or self._own_log_dir) / f"shard-{self.port}.log"
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.ready = False  # answered its health check and its ready requests
        self.watch: StartupWatch | None = None  # its start-up, from the first start

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The guard's PID: its process group holds the server and whatever the server started."""
        return self.proc.pid if self.proc else None

    def server_pid(self) -> int | None:
        """The server's own PID (the guard's child), None if it is not running."""
        return None if self.proc is None else guarded_pid(self.proc.pid)

    def start(self) -> None:
        if self.proc is not None:
            raise EngineStateError(f"shard process on port {self.port} already started")
        cmd, child_env = self.launch()
        self.ready = False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open_private(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=child_env,
                                         start_new_session=True)
        if self.watch is None:
            self.watch = StartupWatch(self.log_path, self.backend.startup_phases,
                                      healthy=lambda: self.ready, alive=self.alive)
        self.watch.log_path = self.log_path  # a port chosen again has a log of its own

    def startup(self, key: int) -> ShardStartup | None:
        """Its start-up as seen now (None before it was started); `key`: its launcher's."""
        return self.watch.state(key, self.pid) if self.watch is not None else None

    def start_ready(self, timeout_s: float | None = None) -> None:
        """`start`, then `wait_ready`. A port chosen here that another process bound first (a
        free port is chosen before the server binds it: with a dozen shards starting at once,
        two once got the same one and a resident engine was lost) is chosen again, at most
        PORT_RETRIES times; any other failure is raised as it is."""
        for attempt in range(PORT_RETRIES + 1):
            self.start()
            try:
                self.wait_ready(timeout_s)
                return
            except EngineStateError:
                if attempt == PORT_RETRIES or not self._port_chosen_here or self.alive() \
                        or PORT_IN_USE not in self.log_tail().lower():
                    raise
            self.proc = None
            self.port = free_port(self.host)
            self.log_path = self.log_path.with_name(f"shard-{self.port}.log")

    def launch(self) -> tuple[list[str], dict[str, str]]:
        """(command line, whole environment) the guard and its server are started with: the
        token in the variable the backend names, no token anywhere else (an inherited one is
        dropped: an environment server, the user's code, gets none)."""
        server_cmd, server_env = server_launch(self.backend, host=self.host, port=self.port,
                                               api_key=self.api_key)
        cmd = [sys.executable, "-m", "rlix.procguard", "--parent", str(os.getpid()),
               *(["--cleanup", self._own_log_dir] if self._own_log_dir else []), "--", *server_cmd]
        return cmd, env.child_env({**server_env, **self.extra_env}, drop=env.TOKEN_VARS)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll the health path until 200; fail early (with the log's tail) if the child exits."""
        timeout_s = timeout_s or self.backend.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EngineStateError(f"shard server exited during start-up "
                                           f"(code {self.proc and self.proc.poll()}):\n{self.log_tail()}")
                try:
                    if http.get(self.url + self.backend.health_path).status_code == 200:
                        self._after_ready(http)
                        self.ready = True
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        tail = self.log_tail()  # before stop() removes a log dir of our own
        self.stop()
        raise EngineStateError(f"shard server not healthy after {timeout_s:g} s:\n{tail}")

    def _after_ready(self, http: httpx.Client) -> None:
        """The backend's first calls once healthy (e.g. vLLM told the version it serves)."""
        for path, body in self.backend.ready_requests:
            r = http.post(self.url + path, json=body, headers={"Authorization": f"Bearer {self.api_key}"})
            if r.status_code != 200:
                raise EngineStateError(f"shard server on port {self.port}: {path} answered {r.status_code}: "
                                       f"{r.text[:300]}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> int | None:
        """End the process (and its group) by PID; returns its exit code."""
        proc = self.proc
        if proc is None:
            self._remove_own_log_dir()
            return None
        server = self.server_pid()  # the guard's child: gone only once the kernel says so
        stop_session(proc, grace_s)
        if server is not None:
            _wait_exited(server, 5.0)  # the guard is reaped; its server may exit a moment later
        self._remove_own_log_dir()
        return proc.returncode

    def _remove_own_log_dir(self) -> None:
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)


def _wait_exited(pid: int, timeout_s: float) -> bool:
    """Until `pid` is gone or a zombie (dead, awaiting its reaper); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False
