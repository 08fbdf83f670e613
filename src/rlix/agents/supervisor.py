"""An environment's two server processes: started, health-checked, restarted when they die.

`EnvironmentProcesses` is the logic (a plain class): the resources server first, then the agent
server told its URL, each a `ShardProcess` (own session, under rlix.procguard, so a SIGKILLed
owner still ends them; ended by PID). A dead server, or one whose /health fails twice in a row,
is restarted on the port it had, so nobody needs to be told a new address. Past `max_restarts`
the environment has failed: AgentEnvError naming it and the server. `watch()` checks in a
thread of its own; `EnvironmentSupervisor` is the thin Ray actor around it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import ray

from rlix import env
from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError, EngineStateError, one_line
from rlix.inference.fleet.shard_process import ShardProcess

ROLES = ("resources", "agent")
CHECK_EVERY_S = 1.0
HEALTH_TIMEOUT_S = 2.0
#: a server that has not exited this long after SIGTERM is killed (its episodes are lost anyway)
STOP_GRACE_S = 3.0
#: a server being replaced gets less: it is dead or hung already
RESTART_GRACE_S = 1.0


class EnvServerSpec:
    """How to start one environment server (the shape ShardProcess takes of a backend)."""

    health_path = "/health"
    supports_sleep = False
    ready_requests: tuple[tuple[str, dict], ...] = ()
    #: no token: the servers are the user's code; each episode's request names the policy
    #: endpoint and its token (the gateway's own, never the shards')
    api_key_env: str | None = None
    startup_phases: tuple[tuple[str, tuple[str, ...]], ...] = ()  # its log marks none

    def __init__(self, role: str, cfg: EnvConfig, resources_url: str | None = None) -> None:
        self.name, self.cfg, self.resources_url = f"{cfg.name}-{role}", cfg, resources_url
        self.role = role
        self.startup_timeout_s = cfg.startup_timeout_s

    def command(self, *, host: str, port: int) -> list[str]:
        target = self.cfg.resources if self.role == "resources" else self.cfg.agent
        cmd = [sys.executable, "-m", "rlix.agents.serve", self.role, "--target", target, "--host", host,
               "--port", str(port)]
        return cmd + (["--resources-url", self.resources_url] if self.resources_url else [])

    def env(self) -> dict[str, str]:
        """The settings in the environment, not the command line: `options` are the user's and
        may hold credentials (every user of the machine can read a command line)."""
        return {env.ENV_SERVER_CONFIG_VAR: self.cfg.model_dump_json()}


def _exit_code(guard_code: int | None) -> int | None:
    """The server's exit code from its guard's: rlix.procguard exits 128+N for a server ended by
    signal N, reported here as -N (as Popen does)."""
    if guard_code is not None and guard_code > 128:
        return 128 - guard_code
    return guard_code


def _server_exited(proc: ShardProcess) -> bool:
    """The guard's server child is gone or a zombie its guard has not reaped yet."""
    pid = proc.server_pid()
    if pid is None:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class EnvironmentProcesses:
    """One environment's agent and resources servers (see the module's docstring)."""

    def __init__(self, cfg: EnvConfig, log_dir: str | Path) -> None:
        self.cfg, self.log_dir = cfg, Path(log_dir)
        self.procs: dict[str, ShardProcess] = {}
        self.restarts: list[str] = []  # what was restarted and why, oldest first
        self.error: str | None = None  # the watch's fatal error (a server past max_restarts)
        self.health_timeout_s = HEALTH_TIMEOUT_S
        self._restarted: Counter[str] = Counter()
        self._unhealthy: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop_watch = threading.Event()
        self._watch: threading.Thread | None = None
        #: one client for every health check: a new httpx client costs ~38 ms of CPU (its TLS
        #: context), which at two servers a second took a sixth of a core on 2 cores
        self._http: httpx.Client | None = None

    @property
    def resources_url(self) -> str:
        return self.procs["resources"].url

    @property
    def agent_url(self) -> str:
        return self.procs["agent"].url

    def urls(self) -> dict[str, str]:
        return {role: p.url for role, p in self.procs.items()}

    def pids(self) -> dict[str, int]:
        """The servers' own PIDs (not their guards'), by role; a server not running is left out."""
        out = {}
        for role, p in list(self.procs.items()):
            pid = p.server_pid()
            if pid is not None:
                out[role] = pid
        return out

    def _launch(self, role: str, port: int | None = None) -> None:
        spec = EnvServerSpec(role, self.cfg, self.resources_url if role == "agent" else None)
        proc = ShardProcess(spec, "", port=port, log_dir=self.log_dir / role)
        self.procs[role] = proc
        proc.start()
        try:
            proc.wait_ready()
        except EngineStateError as exc:
            proc.stop(grace_s=RESTART_GRACE_S)
            last = next((x for x in reversed(str(exc).splitlines()) if x.strip()), type(exc).__name__)
            raise AgentEnvError(f"environment {self.cfg.name}: the {role} server did not start: "
                                f"{last.strip()} (log: {proc.log_path})") from None

    def start(self) -> dict[str, str]:
        """Both servers, healthy; their URLs by role. If one does not start, neither runs."""
        with self._lock:
            try:
                for role in ROLES:
                    self._launch(role)
            except BaseException:
                self._stop_all()
                raise
            return self.urls()

    def check(self) -> list[str]:
        """Restart what is dead or unhealthy; what was restarted, for the logs. Raises
        AgentEnvError once a server needs a restart past max_restarts."""
        done = []
        with self._lock:
            for role in ROLES:
                proc = self.procs.get(role)
                if proc is None:
                    continue
                why = self._problem(role, proc)
                if why is None:
                    continue
                if self._restarted[role] >= self.cfg.max_restarts:
                    raise AgentEnvError(f"environment {self.cfg.name}: the {role} server {why} after "
                                        f"{self._restarted[role]} restarts (max_restarts)")
                proc.stop(grace_s=RESTART_GRACE_S)
                self._restarted[role] += 1
                self._unhealthy.pop(role, None)
                note = f"{role} restarted ({why})"
                try:
                    self._launch(role, port=proc.port)  # the same port: the agent keeps its resources URL
                except AgentEnvError as exc:  # counted; tried again at the next check
                    note = f"{note}; the restart failed: {exc}"
                self.restarts.append(note)
                done.append(note)
        return done

    def _problem(self, role: str, proc: ShardProcess) -> str | None:
        """Why `role` needs a restart, or None. A server that exited while its guard is still
        up died a moment ago: the guard is about to exit with its code."""
        if proc.alive() and _server_exited(proc) and proc.proc is not None:
            try:
                proc.proc.wait(1.0)
            except subprocess.TimeoutExpired:  # still up: judged by /health below
                pass
        if not proc.alive():
            return f"exited with code {_exit_code(proc.proc.poll() if proc.proc is not None else None)}"
        if self._http is None:
            self._http = httpx.Client()
        try:
            ok = self._http.get(proc.url + "/health", timeout=self.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self._unhealthy.pop(role, None)
            return None
        self._unhealthy[role] += 1
        return "failed /health twice" if self._unhealthy[role] >= 2 else None

    def watch(self, every_s: float = CHECK_EVERY_S) -> None:
        """`check()` every `every_s` in a thread until `stop()`; a fatal error ends the watch and
        is kept in `error` (the owner polls it)."""
        if self._watch is not None:
            return
        self._stop_watch.clear()
        self._watch = threading.Thread(target=self._watch_loop, args=(every_s,), name=f"env-watch-{self.cfg.name}",
                                       daemon=True)
        self._watch.start()

    def _watch_loop(self, every_s: float) -> None:
        while not self._stop_watch.wait(every_s):
            try:
                self.check()
            except AgentEnvError as exc:
                self.error = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a watch that died silently would supervise nothing
                self.error = f"environment {self.cfg.name}: its supervisor's check failed: {one_line(exc)}"
                return

    def stop(self) -> None:
        """The watch, then both servers by PID (the agent first: it calls the resources). Idempotent."""
        self._stop_watch.set()
        watch, self._watch = self._watch, None
        if watch is not None and watch is not threading.current_thread():
            watch.join(STOP_GRACE_S + 5.0)
        with self._lock:
            self._stop_all()
            if self._http is not None:
                self._http.close()
                self._http = None

    def _stop_all(self) -> None:
        for role in reversed(ROLES):
            proc = self.procs.pop(role, None)
            if proc is not None:
                proc.stop(grace_s=STOP_GRACE_S)


@ray.remote(num_cpus=0, max_concurrency=4)
class EnvironmentSupervisor:
    """One environment of one pipeline: its servers, checked every second; see
    EnvironmentProcesses. Threaded (max_concurrency) so its getters answer during a restart."""

    def __init__(self, cfg: EnvConfig, log_dir: str) -> None:
        self.procs = EnvironmentProcesses(cfg, log_dir)

    def start(self) -> dict[str, str]:
        urls = self.procs.start()
        self.procs.watch(CHECK_EVERY_S)
        return urls

    def urls(self) -> dict[str, str]:
        return self.procs.urls()

    def pids(self) -> dict[str, int]:
        return self.procs.pids()

    def restarts(self) -> list[str]:
        return list(self.procs.restarts)

    def error(self) -> str | None:
        return self.procs.error

    def stop(self) -> None:
        self.procs.stop()
