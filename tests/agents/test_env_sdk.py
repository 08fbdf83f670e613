"""The environment SDK, in one process: tool schemas from signatures, argument validation,
unknown tools, tool latency, verification and per-episode state; the typed resources client's
errors; the generic ToolAgent against a scripted OpenAI policy (tool calls, feedback turns,
a 400 that ends the episode, a failure that is a 502); the shipped `repeat` environment; and
`python -m rlix.agents.serve` refusing a bad target."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlix.agents.envs.repeat import RepeatResources
from rlix.agents.protocol import (Example, PolicyEndpoint, RunRequest, RunResult, ToolRequest, VerifyRequest,
                                  VerifyResult)
from rlix.agents.sdk import AgentServer, EpisodeContext, ResourcesClient, ResourcesError, ResourcesServer, tool
from rlix.agents.tool_agent import ToolAgent
from rlix.envs.agent_config import EnvConfig
from rlix.envs.tasks import PatternTask, Prompt
from rlix.httpkit import HttpPool, free_port

from served_app import ServedApp


class Calculator(ResourcesServer):
    """A few lines of environment: typed tools, a verifier reading the episode's state."""

    @tool("Add two integers.")
    async def add(self, episode: EpisodeContext, a: int, b: int = 0) -> str:
        episode.state["calls"] = episode.state.get("calls", 0) + 1
        return str(a + b)

    @tool(description="Scale a number.")
    async def scale(self, episode: EpisodeContext, x: float, by: float = 2.0, label: str = "",
                    exact: bool = False) -> str:
        return f"{label}{x * by:.3f}" if exact else f"{label}{x * by:g}"

    @tool
    async def crash(self, episode: EpisodeContext) -> str:
        """A tool with a bug."""
        raise RuntimeError("divide by zero\nin line 3")

    async def not_a_tool(self, episode: EpisodeContext) -> str:
        return "hidden"

    async def verify(self, req: VerifyRequest, episode: EpisodeContext) -> VerifyResult:
        last = next((m.get("content") or "" for m in reversed(req.messages) if m["role"] == "assistant"), "")
        return VerifyResult(reward=float(last == str(req.example.answer)), info={"calls": episode.state.get("calls", 0)})


def asgi(app: FastAPI, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def test_tool_schema_comes_from_the_signature():
    specs = {t.function["name"]: t.function for t in Calculator().tools().tools}
    assert sorted(specs) == ["add", "crash", "scale"]  # not_a_tool is not marked
    assert specs["add"] == {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "default": 0}},
        "required": ["a"]}}
    scale = specs["scale"]["parameters"]
    assert {k: v["type"] for k, v in scale["properties"].items()} == {"x": "number", "by": "number",
                                                                      "label": "string", "exact": "boolean"}
    assert scale["required"] == ["x"]
    assert specs["crash"]["description"] == "A tool with a bug."  # bare @tool: the docstring
    assert specs["crash"]["parameters"] == {"type": "object", "properties": {}, "required": []}
    with pytest.raises(TypeError, match="must be an async method"):
        tool("sync")(lambda self, episode: "x")
    with pytest.raises(TypeError, match="takes no options"):
        Calculator(colour="red")


def test_tool_calls_are_validated_latency_applied_and_state_kept_until_verify():
    server = Calculator(tool_latency_s=0.3)
    app = server.create_app()

    t0 = time.perf_counter()
    ok = asgi(app, "POST", "/tools/add", json={"episode_id": "e", "arguments": {"a": 2, "b": 3}})
    took = time.perf_counter() - t0
    assert ok.status_code == 200 and ok.json() == {"output": "5"}
    assert 0.3 <= took < 2.0, took  # the latency, once per call
    assert asgi(app, "POST", "/tools/scale", json={"episode_id": "e", "arguments": {"x": 1.5, "label": "="}}
                ).json() == {"output": "=3"}

    bad = asgi(app, "POST", "/tools/add", json={"episode_id": "e", "arguments": {"a": "two"}})
    assert bad.status_code == 422
    message = bad.json()["error"]["message"]
    assert message.startswith("tool add: a: ") and "integer" in message and "\n" not in message
    missing = asgi(app, "POST", "/tools/add", json={"episode_id": "e", "arguments": {"b": 1}})
    assert missing.status_code == 422 and missing.json()["error"]["message"] == "tool add: a: Field required"
    no_episode = asgi(app, "POST", "/tools/add", json={"arguments": {"a": 1}})
    assert no_episode.status_code == 422 and "episode_id" in no_episode.json()["error"]["message"]

    unknown = asgi(app, "POST", "/tools/sub", json={"episode_id": "e"})
    assert unknown.status_code == 404 and "no tool 'sub'" in unknown.json()["error"]["message"]
    crash = asgi(app, "POST", "/tools/crash", json={"episode_id": "e"})
    assert crash.status_code == 500 and crash.json()["error"] == {
        "message": "tool crash: RuntimeError: in line 3", "type": "RuntimeError"}

    assert asgi(app, "GET", "/health").json() == {"status": "ok", "episodes": 1}
    v = asgi(app, "POST", "/verify", json={"episode_id": "e", "example": {"prompt": "2+3", "answer": 5},
                                           "messages": [{"role": "assistant", "content": "5"}]})
    assert v.status_code == 200 and v.json() == {"reward": 1.0, "info": {"calls": 1}}  # the state reached verify
    assert asgi(app, "GET", "/health").json()["episodes"] == 0  # and was dropped after it
    assert asgi(app, "POST", "/verify", json={"episode_id": "e"}).status_code == 422


def test_agent_server_maps_failures_to_502_and_bad_requests_to_422():
    class Broken(AgentServer):
        async def run(self, req: RunRequest) -> RunResult:
            raise ValueError("first line\nthe reason")

    app = Broken("http://127.0.0.1:9", EnvConfig()).create_app()
    req = RunRequest(episode_id="e7", session_id="s", example=Example(prompt="p"),
                     policy=PolicyEndpoint(base_url="http://x", model="m"))
    r = asgi(app, "POST", "/run", content=req.model_dump_json())
    assert r.status_code == 502
    assert r.json() == {"error": {"message": "episode e7: ValueError: the reason", "type": "ValueError"}}
    bad = asgi(app, "POST", "/run", json={"episode_id": "e7"})
    assert bad.status_code == 422 and bad.json()["error"]["message"].startswith("run: session_id: ")
    assert asgi(app, "GET", "/health").status_code == 200


def test_resources_client_turns_every_bad_answer_into_one_line_naming_the_endpoint():
    """A raw HTTP server answering each path badly; then a port where nothing listens, and one
    that never answers."""
    answers = {"/tools": (200, json.dumps({"tools": "none"})),
               "/tools/add": (422, json.dumps({"error": {"message": "tool add: a: Field required"}})),
               "/tools/sub": (200, "<html>\n</html>"),
               "/verify": (200, json.dumps({"reward": "high"}))}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                           if x.lower().startswith(b"content-length")), 0)
            await reader.readexactly(length)
            path = head.split(b" ")[1].decode()
            if path == "/slow":
                await asyncio.sleep(5)
            status, body = answers.get(path, (404, "{}"))
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body.encode()))
            await writer.drain()

    async def go() -> list[ResourcesError]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        errors = []
        pool = HttpPool()
        client = ResourcesClient(url, pool, timeout_s=0.5)
        for call in (client.tools(), client.call("add", "e", {}), client.call("sub", "e", {}),
                     client.verify("e", Example(prompt="p"), [])):
            with pytest.raises(ResourcesError) as err:
                await call
            errors.append(err.value)
        with pytest.raises(ResourcesError) as err:  # nothing listens there
            await ResourcesClient(f"http://127.0.0.1:{free_port()}", pool).tools()
        errors.append(err.value)
        with pytest.raises(ResourcesError) as err:  # never answers in time
            await client._request("GET", "/slow")
        errors.append(err.value)
        await pool.aclose()
        server.close()
        return errors

    errors = asyncio.run(go())
    messages = [str(e) for e in errors]
    assert all("\n" not in m for m in messages), messages
    assert messages[0].startswith("resources /tools answer: tools: ")
    assert messages[1] == "resources /tools/add answered 422: tool add: a: Field required"
    assert errors[1].status == 422 and errors[1].detail == "tool add: a: Field required"
    assert messages[2] == "resources /tools/sub answered something that is not JSON"
    assert messages[3].startswith("resources /verify answer: reward: ")
    assert messages[4].startswith("resources /tools: UpstreamError: cannot connect to") and errors[4].status is None
    assert messages[5] == "resources /slow: timed out after 0.5 s"


class ScriptedPolicy:
    """An OpenAI chat-completions server answering from a script, in a thread; records every
    request's headers and body. A script entry: text, an assistant message dict, or a status."""

    def __init__(self, answers: list[Any], finish_reason: str = "stop") -> None:
        self.answers, self.seen = list(answers), []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            self.seen.append((dict(request.headers), await request.json()))
            answer = self.answers.pop(0) if self.answers else "done"
            if isinstance(answer, int):
                return JSONResponse({"error": {"message": "scripted failure"}}, status_code=answer)
            message = answer if isinstance(answer, dict) else {"role": "assistant", "content": answer}
            return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]})

        self.server = ServedApp(app)

    def __enter__(self) -> ScriptedPolicy:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__()

    @property
    def endpoint(self) -> PolicyEndpoint:
        return PolicyEndpoint(base_url=self.server.url, model="policy-m", api_key="key-1")


def run_agent(resources: ResourcesServer, policy: ScriptedPolicy, cfg: EnvConfig, episode: str = "e1",
              answer: str = "z") -> RunResult:
    """One episode of a ToolAgent (in this process) against `resources` served in a thread."""
    req = RunRequest(episode_id=episode, session_id=f"sess-{episode}", example=Example(prompt="Repeat: z", answer=answer),
                     policy=policy.endpoint)
    with ServedApp(resources.create_app()) as served:
        agent = ToolAgent(served.url, cfg)

        async def go() -> RunResult:
            try:
                return await agent.run(req)
            finally:
                await agent.close()
        return asyncio.run(go())


def test_tool_agent_executes_tool_calls_and_tells_the_model_its_mistakes():
    calls = {"role": "assistant", "content": None, "reasoning_content": "kept as is", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "check", "arguments": json.dumps({"answer": "zzz"})}},
        {"id": "c2", "type": "function", "function": {"name": "nope", "arguments": "{}"}},
        {"id": "c3", "type": "function", "function": {"name": "check", "arguments": "{not json"}},
        {"id": "c4", "type": "function", "function": {"name": "check", "arguments": json.dumps({"answer": 3})}}]}
    cfg = EnvConfig(max_turns=3, feedback_tool=None)
    with ScriptedPolicy([calls, "zzzzzzzzzzzz"]) as policy:
        result = run_agent(RepeatResources(), policy, cfg)
    assert result.turns == 2 and result.tool_calls == 4
    assert result.messages[1] == calls  # the assistant message exactly as it came
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "tool", "tool", "tool", "assistant"]
    tool_msgs = result.messages[2:6]
    assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2", "c3", "c4"]
    assert tool_msgs[0]["content"] == "score 0.25"
    assert tool_msgs[1]["content"].startswith("error: no tool 'nope'")
    assert tool_msgs[2]["content"] == "error: the arguments of check are not JSON"
    assert tool_msgs[3]["content"].startswith("error: tool check: answer: ")  # a 422, shown to the model
    # the second policy call saw the tool results; no sampling parameters are ever sent
    assert policy.seen[1][1]["messages"] == result.messages[:6]
    assert all(set(body) == {"model", "messages", "tools"} for _, body in policy.seen)
    assert policy.seen[0][1]["tools"][0]["function"]["name"] == "check"
    # the reward: mean score of the assistant replies (the tool-calling one has no text)
    assert result.reward == pytest.approx((0.0 + 1.0) / 2)


def test_tool_agent_feeds_back_plain_replies_for_max_turns_with_the_session_header():
    cfg = EnvConfig(max_turns=3, system_prompt="Be brief.", feedback_tool="check")
    # finish_reason "length" (cut at max tokens): still a turn
    with ScriptedPolicy(["zzzzzzzzzzzz", "zzzzzz", "abc", "never asked"], finish_reason="length") as policy:
        result = run_agent(RepeatResources(), policy, cfg)
    assert result.turns == 3 and len(policy.seen) == 3
    assert result.tool_calls == 2  # every reply but the last is checked and fed back
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                    "assistant"]
    assert result.messages[3]["content"] == "score 1.00" and result.messages[5]["content"] == "score 0.50"
    assert result.reward == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    for headers, body in policy.seen:
        assert headers["x-session-id"] == "sess-e1" and headers["authorization"] == "Bearer key-1"
        assert body["model"] == "policy-m"
    assert [len(body["messages"]) for _, body in policy.seen] == [2, 4, 6]


def test_tool_agent_ends_on_a_policy_400_and_still_verifies_and_fails_on_other_errors():
    cfg = EnvConfig(max_turns=5)
    with ScriptedPolicy(["zzzzzzzzzzzz", 400]) as policy:
        result = run_agent(RepeatResources(), policy, cfg)
    assert result.turns == 1 and result.tool_calls == 1 and len(policy.seen) == 2
    assert result.reward == pytest.approx(1.0)  # what was done before the 400 is verified
    assert result.messages[-1] == {"role": "user", "content": "score 1.00"}
    # a 400 on the first call: nothing done, reward 0, no error
    with ScriptedPolicy([400]) as policy:
        assert run_agent(RepeatResources(), policy, cfg).model_dump(include={"turns", "reward"}) == {
            "turns": 0, "reward": 0.0}

    # a 500 from the policy fails the episode: the agent server answers 502 naming it
    with ScriptedPolicy([500]) as policy, ServedApp(RepeatResources().create_app()) as resources:
        app = ToolAgent(resources.url, cfg).create_app()
        req = RunRequest(episode_id="e9", session_id="s9", example=Example(prompt="p", answer="z"),
                         policy=policy.endpoint)

        async def go() -> httpx.Response:
            async with app.router.lifespan_context(app):  # closes the agent's client at the end
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                    return await c.post("/run", content=req.model_dump_json())
        r = asyncio.run(go())
    assert r.status_code == 502
    assert r.json()["error"] == {"message": "episode e9: AgentEnvError: policy answered 500: "
                                            '{"error":{"message":"scripted failure"}}', "type": "AgentEnvError"}


def test_repeat_environment_scores_like_the_pattern_task():
    env = RepeatResources(length=4)
    rule = PatternTask(length=4)

    async def go() -> tuple[str, str, VerifyResult]:
        out1 = await env.call("check", _tool_req("e", "zzab"))
        out2 = await env.call("check", _tool_req("e", "zzzzzz"))
        verdict = await env.verify_episode(VerifyRequest(
            episode_id="e", example=Example(prompt="Repeat: z", answer="z"),
            messages=[{"role": "assistant", "content": "zzab"}, {"role": "user", "content": out1.output},
                      {"role": "assistant", "content": "z"}, {"role": "tool", "content": "zzzz"}]))
        return out1.output, out2.output, verdict

    out1, out2, verdict = asyncio.run(go())
    assert out1 == f"score {rule.reward(Prompt('', 'z'), 'zzab'):.2f}" == "score 0.50"
    assert out2 == "score 1.00"  # only the first `length` characters count
    assert verdict.reward == pytest.approx((0.5 + 0.25) / 2)  # assistant messages only
    assert verdict.info["checks"] == 2 and env.open_episodes() == 0

    async def empty() -> VerifyResult:
        return await env.verify_episode(VerifyRequest(episode_id="x", example=Example(prompt="p", answer="z"),
                                                      messages=[{"role": "user", "content": "zzzz"}]))
    assert asyncio.run(empty()).model_dump() == {"reward": 0.0, "info": {"scores": [], "checks": 0}}


def _tool_req(episode: str, answer: str) -> ToolRequest:
    return ToolRequest(episode_id=episode, arguments={"answer": answer}, example=Example(prompt="p", answer="z"))


@pytest.mark.parametrize("args, expected", [
    (["resources", "--target", "nowhere.mod:Cls"], "cannot import nowhere.mod: ModuleNotFoundError"),
    (["agent", "--target", "rlix.agents.envs.repeat:RepeatResources", "--resources-url", "http://x"],
     "is not a AgentServer subclass"),
    (["resources", "--target", "rlix.agents.envs.repeat:RepeatResources", "--options", '{"colour": 1}'],
     "unexpected keyword argument 'colour'"),
])
def test_serve_refuses_a_bad_target_with_one_line_and_exit_2(args, expected):
    out = subprocess.run([sys.executable, "-m", "rlix.agents.serve", *args, "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("rlix.agents.serve: ") and expected in out.stderr, out.stderr
