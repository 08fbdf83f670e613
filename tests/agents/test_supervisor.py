"""An environment's supervised processes, for real: both servers started (`python -m
rlix.agents.serve` under rlix.procguard), episodes run through the agent against a scripted
policy, servers SIGKILLed (or hung with SIGSTOP) by their PIDs and restarted on the same port,
by `check()` and by the watch thread, until max_restarts; stop() leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlix.agents.protocol import Example, PolicyEndpoint, RunRequest, RunResult
from rlix.agents.supervisor import EnvironmentProcesses, EnvironmentSupervisor
from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError

from served_app import ServedApp


class Policy:
    """A chat-completions server in a thread that always answers the perfect reply; records the
    X-Session-ID of every call."""

    def __init__(self) -> None:
        self.sessions: list[str | None] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            self.sessions.append(request.headers.get("x-session-id"))
            return JSONResponse({"choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "z" * 12}}]})

        self.served = ServedApp(app).start()
        self.port = self.served.port

    def stop(self) -> None:
        self.served.stop()

    @property
    def endpoint(self) -> PolicyEndpoint:
        return PolicyEndpoint(base_url=f"http://127.0.0.1:{self.port}", model="m", api_key="k")


@pytest.fixture()
def policy():
    p = Policy()
    yield p
    p.stop()


def episode(agent_url: str, policy: Policy, episode_id: str) -> RunResult:
    req = RunRequest(episode_id=episode_id, session_id=f"s-{episode_id}",
                     example=Example(prompt="Repeat: z", answer="z"), policy=policy.endpoint)
    resp = httpx.post(f"{agent_url}/run", content=req.model_dump_json(), timeout=30)
    assert resp.status_code == 200, resp.text
    result = RunResult.model_validate_json(resp.content)
    assert result.episode_id == episode_id and result.turns == 2 and result.reward == 1.0
    assert policy.sessions[-2:] == [f"s-{episode_id}"] * 2
    return result


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie waiting for its reaper)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def wait_for(predicate, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def all_pids(procs: EnvironmentProcesses) -> set[int]:
    """The servers' PIDs and their guards'."""
    return set(procs.pids().values()) | {p.pid for p in procs.procs.values() if p.pid}


def test_killed_and_hung_servers_are_restarted_on_their_ports_until_max_restarts(tmp_path, policy):
    cfg = EnvConfig(name="sup-env", max_turns=2, max_restarts=2, startup_timeout_s=30)
    procs = EnvironmentProcesses(cfg, tmp_path / "logs")
    started: set[int] = set()
    try:
        urls = procs.start()
        assert set(urls) == {"resources", "agent"} and urls["resources"] != urls["agent"]
        assert procs.resources_url == urls["resources"] and procs.agent_url == urls["agent"]
        started |= all_pids(procs)
        assert set(procs.pids()) == {"resources", "agent"}
        assert list((tmp_path / "logs" / "resources").glob("*.log")) and list((tmp_path / "logs" / "agent").glob("*.log"))
        episode(procs.agent_url, policy, "e1")
        assert procs.check() == []  # healthy: nothing to do

        # the resources server SIGKILLed: restarted on its port; the agent (not restarted) reaches it
        for n, role in enumerate(("resources", "agent"), start=2):
            old = procs.pids()[role]
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: gone(old))  # SIGKILL is delivered asynchronously
            assert procs.check() == [f"{role} restarted (exited with code -9)"]
            started |= all_pids(procs)
            assert procs.urls() == urls and procs.pids()[role] != old and gone(old)
            episode(procs.agent_url, policy, f"e{n}")

        # a hung agent (alive, /health unanswered): restarted after its second failed check
        procs.health_timeout_s = 0.3
        hung = procs.pids()["agent"]
        os.kill(hung, signal.SIGSTOP)
        assert procs.check() == []  # once may be a hiccup
        assert procs.check() == ["agent restarted (failed /health twice)"]
        started |= all_pids(procs)
        assert gone(hung) and procs.urls() == urls
        episode(procs.agent_url, policy, "e4")

        # the watch thread does the same on its own
        procs.watch(every_s=0.2)
        old = procs.pids()["resources"]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: len(procs.restarts) == 4 and procs.pids().get("resources") not in (None, old))
        started |= all_pids(procs)
        assert procs.restarts[-1] == "resources restarted (exited with code -9)" and procs.urls() == urls
        episode(procs.agent_url, policy, "e5")

        # past max_restarts: the environment has failed, named with the server
        assert procs.error is None
        os.kill(procs.pids()["resources"], signal.SIGKILL)
        wait_for(lambda: procs.error is not None)
        expected = "environment sup-env: the resources server exited with code -9 after 2 restarts (max_restarts)"
        assert procs.error == expected
        with pytest.raises(AgentEnvError, match=r"environment sup-env: the resources server .*\(max_restarts\)"):
            procs.check()
    finally:
        started |= all_pids(procs)
        procs.stop()
        procs.stop()  # idempotent
    assert procs.procs == {} and procs.pids() == {}
    assert started and all(gone(pid) for pid in started), [p for p in started if not gone(p)]


def test_a_server_that_cannot_start_leaves_nothing_running(tmp_path):
    cfg = EnvConfig(name="bad-env", agent="rlix.agents.envs.repeat:RepeatResources", startup_timeout_s=20)
    procs = EnvironmentProcesses(cfg, tmp_path / "logs")
    with pytest.raises(AgentEnvError, match=r"environment bad-env: the agent server did not start: .*"
                                            r"is not a AgentServer subclass"):
        procs.start()
    assert procs.procs == {}


@pytest.mark.slow  # Ray's start alone takes 5-17 s on a 2-core machine (10-20 s for the test)
def test_supervisor_actor_restarts_a_killed_agent_and_stops_everything(tmp_path, policy):
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    actor = EnvironmentSupervisor.remote(EnvConfig(name="actor-env", max_turns=2), str(tmp_path / "logs"))
    try:
        urls = ray.get(actor.start.remote(), timeout=120)
        pids = ray.get(actor.pids.remote(), timeout=30)
        assert set(urls) == set(pids) == {"resources", "agent"}
        episode(urls["agent"], policy, "a1")
        os.kill(pids["agent"], signal.SIGKILL)
        wait_for(lambda: ray.get(actor.restarts.remote(), timeout=30) == ["agent restarted (exited with code -9)"])
        assert ray.get(actor.urls.remote()) == urls and ray.get(actor.error.remote()) is None
        new = ray.get(actor.pids.remote())
        assert new["agent"] != pids["agent"] and new["resources"] == pids["resources"]
        episode(urls["agent"], policy, "a2")
        ray.get(actor.stop.remote(), timeout=60)
        assert all(gone(pid) for pid in [*pids.values(), *new.values()])
    finally:
        ray.kill(actor)
        if own_ray:
            ray.shutdown()
