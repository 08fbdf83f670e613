"""Environment servers as real processes: the SDK's tools and verifier, the generic ToolAgent
against a scripted OpenAI policy, the shipped `repeat` environment, and the supervisor
restarting a server SIGKILLed by its PID (on the same port) until its restart limit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlix.agents.protocol import Example, PolicyEndpoint, RunRequest, RunResult, VerifyRequest
from rlix.agents.rollout import AgentClient
from rlix.agents.sdk import EpisodeContext, ResourcesServer, tool
from rlix.agents.supervisor import EnvironmentProcesses
from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError, EpisodeError
from rlix.httpkit import free_port


class Calculator(ResourcesServer):
    """A few lines of environment: one tool, one verifier."""

    @tool("Add two integers.")
    async def add(self, episode: EpisodeContext, a: int, b: int = 0) -> str:
        episode.state["calls"] = episode.state.get("calls", 0) + 1
        return str(a + b)

    async def verify(self, req, episode):  # type: ignore[no-untyped-def]
        from rlix.agents.protocol import VerifyResult  # noqa: PLC0415 - local to the example class
        last = req.messages[-1].get("content") if req.messages else ""
        return VerifyResult(reward=float(last == str(req.example.answer)), info={"calls": episode.state.get("calls", 0)})


def call(app: FastAPI, method: str, path: str, **kw):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def test_sdk_tools_schema_validation_latency_and_verify():
    server = Calculator(tool_latency_s=0.2)
    app = server.create_app()
    spec = call(app, "GET", "/tools").json()["tools"][0]["function"]
    assert spec["name"] == "add" and spec["description"] == "Add two integers."
    assert spec["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"},
                                                                   "b": {"default": 0, "type": "integer"}},
                                  "required": ["a"]}
    t0 = time.perf_counter()
    r = call(app, "POST", "/tools/add", json={"episode_id": "e", "arguments": {"a": 2, "b": 3}})
    assert r.status_code == 200 and r.json() == {"output": "5"} and time.perf_counter() - t0 >= 0.2
    bad = call(app, "POST", "/tools/add", json={"episode_id": "e", "arguments": {"a": "two"}})
    assert bad.status_code == 422 and "tool add: a:" in bad.json()["error"]["message"]
    missing = call(app, "POST", "/tools/sub", json={"episode_id": "e"})
    assert missing.status_code == 404 and "'sub'" in missing.json()["error"]["message"]
    v = call(app, "POST", "/verify", json={"episode_id": "e", "example": {"prompt": "2+3", "answer": 5},
                                           "messages": [{"role": "assistant", "content": "5"}]})
    assert v.json() == {"reward": 1.0, "info": {"calls": 1}}  # the episode's state reached verify
    assert call(app, "POST", "/verify", json={"episode_id": "e"}).status_code == 422


class ScriptedPolicy:
    """An OpenAI chat-completions server answering from a script; records every request."""

    def __init__(self, answers: list) -> None:  # type: ignore[type-arg]
        self.answers, self.seen = list(answers), []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            body = await request.json()
            self.seen.append((dict(request.headers), body))
            answer = self.answers.pop(0) if self.answers else "done"
            if isinstance(answer, int):
                return JSONResponse({"error": {"message": "too long"}}, status_code=answer)
            message = answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}
            return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ScriptedPolicy":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        self.server.should_exit = True
        self.thread.join(5)

    @property
    def endpoint(self) -> PolicyEndpoint:
        return PolicyEndpoint(base_url=f"http://127.0.0.1:{self.port}", model="p", api_key="k")


@pytest.fixture()
def env_procs(tmp_path):
    started: list[EnvironmentProcesses] = []

    def make(**kw) -> EnvironmentProcesses:  # type: ignore[no-untyped-def]
        procs = EnvironmentProcesses(EnvConfig(**{"tool_latency_s": 0.0, "max_turns": 3, **kw}), tmp_path / "logs")
        started.append(procs)
        procs.start()
        return procs

    yield make
    for procs in started:
        pids = list(procs.pids().values())
        procs.stop()
        for pid in pids:  # every server we started is gone, by its PID
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def run_episode(procs: EnvironmentProcesses, policy: ScriptedPolicy, episode: str = "e1",
                answer: str = "z") -> RunResult:
    client = AgentClient("repeat", procs.agent_url, timeout_s=30)

    async def go() -> RunResult:
        try:
            return await client.run(RunRequest(episode_id=episode, session_id=f"s-{episode}",
                                               example=Example(prompt="Repeat: z", answer=answer),
                                               policy=policy.endpoint))
        finally:
            await client.close()
    return asyncio.run(go())


def test_tool_agent_runs_feedback_turns_tool_calls_and_stops_on_a_400(env_procs):
    procs = env_procs()
    # plain replies: each but the last is checked and fed back; the reward is the mean score
    with ScriptedPolicy(["zzzzzzzzzzzz", "zzzzzz", "abc"]) as policy:
        result = run_episode(procs, policy)
    assert result.turns == 3 and result.tool_calls == 2
    assert [m["role"] for m in result.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert result.messages[2]["content"] == "score 1.00" and result.messages[4]["content"] == "score 0.50"
    assert result.reward == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert all(h["x-session-id"] == "s-e1" and h["authorization"] == "Bearer k" for h, _ in policy.seen)
    assert policy.seen[0][1]["tools"][0]["function"]["name"] == "check"
    # a tool call from the model: executed, its output goes back as a tool message; a bad one
    # (unknown tool, arguments not JSON) gets the error as its output, not an episode failure
    calls = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "check", "arguments": json.dumps({"answer": "zzz"})}},
        {"id": "c2", "type": "function", "function": {"name": "nope", "arguments": "{}"}},
        {"id": "c3", "type": "function", "function": {"name": "check", "arguments": "{not json"}}]}
    with ScriptedPolicy([calls, 400]) as policy:
        result = run_episode(procs, policy, "e2")
    tool_msgs = [m for m in result.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2", "c3"]
    assert tool_msgs[0]["content"] == "score 0.25" and "error" in tool_msgs[1]["content"] \
        and "not JSON" in tool_msgs[2]["content"]
    assert result.turns == 1  # the 400 ended the episode; what was done was verified
    # a policy that answers 500: the episode fails, named, as a 502 the pipeline counts
    with ScriptedPolicy([500]) as policy, pytest.raises(EpisodeError, match="environment repeat, episode e3: agent /run answered 502"):
        run_episode(procs, policy, "e3")


def test_malformed_agent_answers_are_episode_errors_naming_env_and_episode():
    """Not JSON, a field missing, a field of the wrong type, another episode's id, too slow."""
    answers = iter(["{not json", json.dumps({"episode_id": "x1", "turns": 1}),
                    json.dumps({"episode_id": "x1", "reward": "high", "turns": 1}),
                    json.dumps({"episode_id": "other", "reward": 1.0, "turns": 1}), None])
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> Response:
        body = next(answers)
        if body is None:
            await asyncio.sleep(3)
            body = "{}"
        return Response(body, media_type="application/json")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        client = AgentClient("calc", f"http://127.0.0.1:{port}", timeout_s=1.0)
        req = RunRequest(episode_id="x1", session_id="s", example=Example(prompt="p"),
                         policy=PolicyEndpoint(base_url="http://unused", model="m"))

        async def go() -> list[str]:
            reasons = []
            for _ in range(5):
                with pytest.raises(EpisodeError) as err:
                    await client.run(req)
                assert err.value.env == "calc" and err.value.episode == "x1"
                reasons.append(err.value.reason)
            await client.close()
            return reasons
        reasons = asyncio.run(go())
    finally:
        server.should_exit = True
        thread.join(5)
    assert "agent /run answer is malformed" in reasons[0]
    assert "reward: Field required" in reasons[1]
    assert "reward" in reasons[2] and "number" in reasons[2]
    assert "episode 'other'" in reasons[3]
    assert "timed out after 1 s" in reasons[4]


def test_supervisor_restarts_a_killed_server_on_its_port_until_its_limit(env_procs):
    procs = env_procs(max_restarts=1)
    urls = procs.urls()
    killed = procs.pids()["resources"]
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while procs.procs["resources"].alive() and time.monotonic() < deadline:  # the guard follows
        time.sleep(0.05)
    notes = procs.check()
    assert len(notes) == 1 and notes[0].startswith("resources restarted (exited"), notes
    assert procs.urls() == urls and procs.pids()["resources"] != killed
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    with ScriptedPolicy(["zzzzzzzzzzzz", "z", "z"]) as policy:  # the agent reaches the new one
        assert run_episode(procs, policy).turns == 3
    assert procs.check() == []  # healthy: nothing to do
    os.kill(procs.pids()["resources"], signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(AgentEnvError, match=r"environment repeat: the resources server exited .*\(max_restarts\)"):
        procs.check()


def test_serve_refuses_a_bad_target_with_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "rlix.agents.serve", "resources", "--target", "nowhere.mod:Cls",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "cannot import nowhere.mod" in out.stderr
    out = subprocess.run([sys.executable, "-m", "rlix.agents.serve", "agent", "--target",
                          "rlix.agents.envs.repeat:RepeatResources", "--port", str(free_port()),
                          "--resources-url", "http://x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a AgentServer subclass" in out.stderr


def test_repeat_environment_scores_like_the_pattern_task():
    from rlix.agents.envs.repeat import RepeatResources  # noqa: PLC0415 - the class under test
    env = RepeatResources(length=4)

    async def go() -> tuple:
        ctx = env.episode("e", Example(prompt="Repeat: z", answer="z"))
        out = await env.check(ctx, "zzab")
        verdict = await env.verify_episode(VerifyRequest(episode_id="e", example=Example(prompt="", answer="z"),
                                                         messages=[{"role": "assistant", "content": "zzzz"},
                                                                   {"role": "user", "content": out},
                                                                   {"role": "assistant", "content": "z"}]))
        return out, verdict
    out, verdict = asyncio.run(go())
    assert out == "score 0.50" and verdict.reward == pytest.approx((1.0 + 0.25) / 2)
    assert verdict.info["checks"] == 1
