"""A constrained request cut by a preemption and continued on another shard keeps its constraint
exactly: the router sends the continuation with the constraint and `already_generated` (the
prompt's tail it generated so far), the new shard's matcher starts after those tokens, and the
joined answer is what one uninterrupted constrained generation gives. Greedy, so the continued
answer must equal the uninterrupted one token for token; a matcher restarted at the grammar's
start (or no constraint) would write something else: a second object, or free text.

Shards are real engine processes on the `tiny` model (random weights: only the constraint
makes its output JSON or a tool call), preempted the way the fleet does it (marked preempted,
then its requests aborted)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest

from kit import ADD_TOOL, ANSWER_SCHEMA, KEY, TOOL_PARAMS, WEATHER_TOOL, shard_processes, sse_events
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.router.attempts import Attempts
from rlix.inference.router.app import RouterServer
from rlix.inference.router.router import Router

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 600}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
CASES = {
    "chat_json": ("/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "response_format": FORMAT}),
    "chat_tools": ("/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "tools": [WEATHER_TOOL, ADD_TOOL],
                                            "tool_choice": "required"}),
    "cmpl_json": ("/v1/completions", {**GREEDY, "prompt": "The answer:", "response_format": FORMAT}),
    "gen_json": ("/inference/v1/generate", {"token_ids": [9, 8, 7], "sampling_params": {
        "temperature": 0, "max_tokens": 600, "structured_outputs": {"json": ANSWER_SCHEMA}}}),
}


@pytest.fixture(scope="module")
def shards(tiny_model_dir):
    with shard_processes(tiny_model_dir, 2, max_model_len=2048) as procs:  # room for the tools
        yield [p.url for p in procs]


class Answer:
    """One choice of an answer (unary or streamed), as the caller sees it."""

    def __init__(self, kind: str, payload, stream: bool) -> None:  # type: ignore[no-untyped-def]
        self.ids: list[int] = []
        self.text = ""
        self.calls: list[dict] = []
        self.finishes: list[str] = []
        choices = [payload["choices"][0]] if not stream else [c for chunk in payload for c in chunk["choices"]]
        for c in choices:
            self.ids += c.get("token_ids") or []
            part = c.get("message") or c.get("delta") or {}
            self.text += c.get("text") or part.get("content") or ""
            self.calls += part.get("tool_calls") or []
            if c.get("finish_reason"):
                self.finishes.append(c["finish_reason"])
        if kind == "gen_json":
            self.text = ""  # token ids only: decoded by the test


async def _call(http: httpx.AsyncClient, url: str, kind: str, stream: bool) -> Answer:
    path, body = CASES[kind]
    r = await http.post(url + path, json={**body, "return_token_ids": True, "stream": stream})
    assert r.status_code == 200, r.text
    return Answer(kind, sse_events(r.text) if stream else r.json(), stream)


async def _running(client: RemoteInferenceClient, rank: int) -> float:
    return (await client.load([rank]))[rank]["running"]


def _cut_and_continue(shards: list[str], kind: str, stream: bool) -> tuple[Answer, Answer, int]:
    """(uninterrupted answer, answer cut a third of the way on shard 0 and continued on shard 1,
    the router's re-dispatch count)."""
    async def main() -> tuple[Answer, Answer, int]:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, dict(enumerate(shards)), KEY)
        try:
            await router.set_shard(0, shards[0], "active")
            await router.set_shard(1, shards[1], "inactive")
            async with httpx.AsyncClient(timeout=120) as http:
                t0 = time.perf_counter()
                reference = await _call(http, server.url, kind, stream)
                took = time.perf_counter() - t0
                task = asyncio.create_task(_call(http, server.url, kind, stream))
                deadline = time.monotonic() + 30
                while await _running(client, 0) < 1:
                    assert not task.done() and time.monotonic() < deadline, "shard 0 never ran the request"
                    await asyncio.sleep(0.005)
                await asyncio.sleep(took / 3)  # about a third of its tokens (scaled to this machine)
                await router.set_shard(1, state="active")
                await router.set_shard(0, state="preempted")  # what the fleet does first
                await client.abort_requests([0])
                cut = await asyncio.wait_for(task, 120)
            return reference, cut, router.relay.redispatched
        finally:
            await client.aclose()
            await server.stop()

    return asyncio.run(main())


def _assert_continued_exactly(reference: Answer, cut: Answer, redispatched: int) -> None:
    assert redispatched == 1  # it really was cut and continued elsewhere
    assert cut.finishes == reference.finishes and len(cut.finishes) == 1
    assert cut.ids == reference.ids and len(cut.ids) > 20  # greedy: the uninterrupted answer, token for token
    assert cut.text == reference.text


def _decode(shard: str, ids: list[int]) -> str:
    r = httpx.post(shard + "/detokenize", json={"model": "tiny", "tokens": ids},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("kind, stream", [("chat_json", False), ("chat_json", True), ("cmpl_json", False),
                                          ("gen_json", False)])
def test_a_json_schema_request_continued_on_another_shard_still_validates(shards, kind, stream):
    reference, cut, redispatched = _cut_and_continue(shards, kind, stream)
    _assert_continued_exactly(reference, cut, redispatched)
    assert cut.finishes == ["stop"]
    text = _decode(shards[1], cut.ids[:-1]) if kind == "gen_json" else cut.text  # ids end with the eos
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_continued_on_another_shard_is_a_valid_call(shards, stream):
    reference, cut, redispatched = _cut_and_continue(shards, "chat_tools", stream)
    _assert_continued_exactly(reference, cut, redispatched)
    assert cut.finishes == ["tool_calls"] and cut.text == ""  # vLLM's shape of a forced call
    assert cut.calls and [c["function"] for c in cut.calls] == [c["function"] for c in reference.calls]
    for call in cut.calls:  # parsed from both attempts' text together
        assert call["type"] == "function" and call["function"]["name"] in TOOL_PARAMS
        jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_PARAMS[call["function"]["name"]])


def _by_index(payload, stream: bool) -> dict[int, Answer]:  # type: ignore[no-untyped-def]
    """{index: Answer} of an answer of several choices."""
    if not stream:
        return {c["index"]: Answer("", {"choices": [c]}, False) for c in payload["choices"]}
    chunks: dict[int, list] = {}
    for chunk in payload:
        for c in chunk["choices"]:
            chunks.setdefault(c["index"], []).append({"choices": [c]})
    return {i: Answer("", got, True) for i, got in chunks.items()}


@pytest.mark.parametrize("kind, stream", [("chat_json", False), ("chat_tools", True)])
def test_samples_of_a_constrained_request_each_continue_with_their_own_tokens(shards, kind, stream):
    """n = 2 goes whole to one shard; cut, each sample continues on its own with its own
    already generated tokens (one re-dispatch per sample), and both answers are the
    uninterrupted ones (greedy: the samples are alike, so both are cut mid-way)."""
    path, body = CASES[kind]
    body = {**body, "n": 2, "return_token_ids": True, "stream": stream}

    async def call(http: httpx.AsyncClient, url: str) -> dict[int, Answer]:
        r = await http.post(url + path, json=body)
        assert r.status_code == 200, r.text
        return _by_index(sse_events(r.text) if stream else r.json(), stream)

    async def main() -> tuple[dict[int, Answer], dict[int, Answer], int]:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, dict(enumerate(shards)), KEY)
        try:
            await router.set_shard(0, shards[0], "active")
            await router.set_shard(1, shards[1], "inactive")
            async with httpx.AsyncClient(timeout=120) as http:
                t0 = time.perf_counter()
                reference = await call(http, server.url)
                took = time.perf_counter() - t0
                task = asyncio.create_task(call(http, server.url))
                deadline = time.monotonic() + 30
                while await _running(client, 0) < 2:
                    assert not task.done() and time.monotonic() < deadline, "shard 0 never ran the samples"
                    await asyncio.sleep(0.005)
                await asyncio.sleep(took / 4)
                await router.set_shard(1, state="active")
                await router.set_shard(0, state="preempted")
                await client.abort_requests([0])
                cut = await asyncio.wait_for(task, 120)
            return reference, cut, router.relay.redispatched
        finally:
            await client.aclose()
            await server.stop()

    reference, cut, redispatched = asyncio.run(main())
    assert redispatched == 2 and sorted(cut) == [0, 1]
    for i, got in cut.items():
        assert got.ids == reference[i].ids and got.finishes == reference[i].finishes and len(got.finishes) == 1
        if kind == "chat_json":
            assert got.finishes == ["stop"]
            jsonschema.validate(json.loads(got.text), ANSWER_SCHEMA)
        else:
            assert got.finishes == ["tool_calls"] and got.text == "" and got.calls
            assert [c["function"] for c in got.calls] == [c["function"] for c in reference[i].calls]
            for tool_call in got.calls:
                fn = tool_call["function"]
                jsonschema.validate(json.loads(fn["arguments"]), TOOL_PARAMS[fn["name"]])


def test_a_continuation_carries_the_constraint_and_its_already_generated_count():
    """What the router sends a shard for the rest of a cut constrained request (no shard)."""
    tools = {"messages": MESSAGES, "tools": [WEATHER_TOOL, ADD_TOOL], "tool_choice": "required",
             "parallel_tool_calls": False, "response_format": FORMAT, "max_tokens": 50}
    prog = Attempts("/v1/chat/completions", tools, False, prompt_ids=[1, 2], ids=[7, 8, 9])
    path, sent = prog.upstream()
    assert path == "/v1/completions" and sent["prompt"] == [1, 2, 7, 8, 9] and sent["already_generated"] == 3
    assert "response_format" not in sent and "tools" not in sent  # the forced call overrides, as on chat
    tag = json.loads(sent["structured_outputs"]["structural_tag"])
    assert tag["format"]["stop_after_first"] is True  # parallel_tool_calls false: one call
    assert {t["begin"].split('"name": ')[1].split('"')[1] for t in tag["format"]["tags"]} == set(TOOL_PARAMS)
    prog = Attempts("/v1/completions", {"prompt": "x", "response_format": FORMAT,
                                        "structured_outputs": {"regex": "a"}}, False, prompt_ids=[1], ids=[4])
    sent = prog.upstream()[1]
    assert sent["response_format"] == FORMAT and sent["structured_outputs"] == {"regex": "a"}
    assert sent["already_generated"] == 1
    gen = {"token_ids": [1], "already_generated": 1, "sampling_params": {"structured_outputs": {"regex": "a"}}}
    prog = Attempts("/inference/v1/generate", gen, False, prompt_ids=[1], ids=[4, 5])
    assert prog.upstream()[1]["already_generated"] == 3  # the caller's own count, and ours
