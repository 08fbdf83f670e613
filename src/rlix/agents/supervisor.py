"""An environment's two server processes: started, health-checked, restarted when they die.

`EnvironmentProcesses` is the logic (a plain class): the resources server first, then the agent
server told its URL, each a `ShardProcess` (own session, under rlix.procguard, so a SIGKILLed
owner still ends them; ended by PID). A dead server, or one whose /health fails twice in a row,
is restarted on the port it had, so nobody needs to be told a new address. Past `max_restarts`
the environment has failed: AgentEnvError naming it and the server. `EnvironmentSupervisor` is
the thin Ray actor around it, checking once a second.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import ray

from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError, EngineStateError
from rlix.inference.fleet.shard_process import ShardProcess

ROLES = ("resources", "agent")
CHECK_EVERY_S = 1.0
#: a server that has not exited this long after SIGTERM is killed (its episodes are lost anyway)
STOP_GRACE_S = 3.0


class EnvServerSpec:
    """How to start one environment server (the shape ShardProcess takes of a backend)."""

    health_path = "/health"
    supports_sleep = False
    ready_requests: tuple[tuple[str, dict], ...] = ()

    def __init__(self, role: str, cfg: EnvConfig, resources_url: str | None = None) -> None:
        self.name, self.cfg, self.resources_url = f"{cfg.name}-{role}", cfg, resources_url
        self.role = role
        self.startup_timeout_s = cfg.startup_timeout_s

    def command(self, *, host: str, port: int, api_key: str) -> list[str]:
        target = self.cfg.resources if self.role == "resources" else self.cfg.agent
        cmd = [sys.executable, "-m", "rlix.agents.serve", self.role, "--target", target, "--host", host,
               "--port", str(port), "--config", self.cfg.model_dump_json()]
        return cmd + (["--resources-url", self.resources_url] if self.resources_url else [])

    def env(self) -> dict[str, str]:
        return {}


class EnvironmentProcesses:
    def __init__(self, cfg: EnvConfig, log_dir: str | Path) -> None:
        self.cfg, self.log_dir = cfg, Path(log_dir)
        self.procs: dict[str, ShardProcess] = {}
        self.restarts: list[str] = []
        self._unhealthy: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def resources_url(self) -> str:
        return self.procs["resources"].url

    @property
    def agent_url(self) -> str:
        return self.procs["agent"].url

    def urls(self) -> dict[str, str]:
        return {role: p.url for role, p in self.procs.items()}

    def pids(self) -> dict[str, int]:
        """The servers' own PIDs (not their guards'), by role."""
        out = {}
        for role, p in self.procs.items():
            pid = p.server_pid()
            if pid is not None:
                out[role] = pid
        return out

    def _spec(self, role: str) -> EnvServerSpec:
        return EnvServerSpec(role, self.cfg, self.resources_url if role == "agent" else None)

    def _launch(self, role: str, port: int | None = None) -> None:
        proc = ShardProcess(self._spec(role), "", port=port, log_dir=self.log_dir)
        self.procs[role] = proc
        proc.start()
        try:
            proc.wait_ready()
        except EngineStateError as exc:
            proc.stop()
            raise AgentEnvError(f"environment {self.cfg.name}: the {role} server did not start: "
                                f"{str(exc).splitlines()[-1] if str(exc) else exc}") from None

    def start(self) -> dict[str, str]:
        with self._lock:
            for role in ROLES:
                self._launch(role)
            return self.urls()

    def check(self) -> list[str]:
        """Restart what is dead or unhealthy; what was restarted, for the logs. Raises
        AgentEnvError once a server has needed more than max_restarts restarts."""
        done = []
        with self._lock:
            for role in ROLES:
                proc = self.procs.get(role)
                if proc is None:
                    continue
                why = self._problem(role, proc)
                if why is None:
                    continue
                if len([r for r in self.restarts if r.startswith(role)]) >= self.cfg.max_restarts:
                    raise AgentEnvError(f"environment {self.cfg.name}: the {role} server {why} and has been "
                                        f"restarted {self.cfg.max_restarts} times (max_restarts)")
                proc.stop(grace_s=2.0)
                note = f"{role} restarted ({why})"
                self.restarts.append(note)
                self._unhealthy.pop(role, None)
                try:
                    self._launch(role, port=proc.port)
                except AgentEnvError as exc:  # counted; tried again at the next check
                    self.restarts[-1] = f"{note}; the restart failed: {exc}"
                done.append(self.restarts[-1])
        return done

    def _problem(self, role: str, proc: ShardProcess) -> str | None:
        if not proc.alive():
            code = proc.proc.poll() if proc.proc is not None else None
            return f"exited (code {code})"
        try:
            ok = httpx.get(proc.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self._unhealthy.pop(role, None)
            return None
        self._unhealthy[role] = self._unhealthy.get(role, 0) + 1
        return "failed /health twice" if self._unhealthy[role] >= 2 else None

    def stop(self) -> None:
        with self._lock:
            for role in reversed(ROLES):
                proc = self.procs.pop(role, None)
                if proc is not None:
                    proc.stop(grace_s=STOP_GRACE_S)


@ray.remote(num_cpus=0, max_concurrency=4)
class EnvironmentSupervisor:
    """One environment of one pipeline; see EnvironmentProcesses."""

    def __init__(self, cfg: EnvConfig, log_dir: str) -> None:
        self.procs = EnvironmentProcesses(cfg, log_dir)
        self._error: str | None = None
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> dict[str, str]:
        urls = self.procs.start()
        self._watch = threading.Thread(target=self._loop, name="env-watch", daemon=True)
        self._watch.start()
        return urls

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            try:
                self.procs.check()
            except AgentEnvError as exc:
                self._error = str(exc)
                return

    def urls(self) -> dict[str, str]:
        return self.procs.urls()

    def pids(self) -> dict[str, int]:
        return self.procs.pids()

    def restarts(self) -> list[str]:
        return list(self.procs.restarts)

    def error(self) -> str | None:
        return self._error

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.join(5.0)
        self.procs.stop()
