"""The router against real shard processes: re-dispatch on preemption (abort from a preempted
shard, or a dead shard), pass-through of ordinary aborts, session stickiness."""

from __future__ import annotations

import asyncio
import time
import os
import signal

import httpx
import pytest

from kit import KEY, shard_processes, sse_events
from rlix.inference.server.openai_schema import GenerateSamplingParams as SP
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer

N = 120
GREEDY = {"max_tokens": N, "temperature": 0, "ignore_eos": True}
CASES = {
    "cmpl": ("/v1/completions", {"model": "tiny", "prompt": "once upon a time", **GREEDY}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **GREEDY}),
    "gen": ("/inference/v1/generate", {"token_ids": [9, 8, 7], "sampling_params": GREEDY}),
}


@pytest.fixture(scope="module")
def shards(tiny_model_dir):
    with shard_processes(tiny_model_dir, 2) as procs:
        yield [p.url for p in procs]


def _tokens(kind: str, stream: bool, payload) -> tuple[list[int], str, list[str]]:
    """(token ids, text, finish reasons) of one answer."""
    if not stream:
        c = payload["choices"][0]
        text = c.get("text") if kind != "chat" else c["message"]["content"]
        return c["token_ids"], text or "", [c["finish_reason"]]
    ids, text, finishes = [], "", []
    for chunk in payload:
        if not chunk["choices"]:
            continue
        c = chunk["choices"][0]
        ids += c.get("token_ids") or []
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
        if c["finish_reason"]:
            finishes.append(c["finish_reason"])
    return ids, text, finishes


async def _call(http, url, kind, stream, session=None):
    path, body = CASES[kind]
    body = {**body, "return_token_ids": True, "stream": stream}
    if stream:  # usage on every chunk, counted over every attempt
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    headers = {"X-Session-ID": session} if session else {}
    r = await http.post(url + path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    return sse_events(r.text)


async def _running(client: RemoteInferenceClient, rank: int) -> float:
    return (await client.load([rank]))[rank]["running"]


async def _wait_running(client: RemoteInferenceClient, rank: int, count: int, *tasks: asyncio.Task) -> None:
    """Until shard `rank` runs `count` requests; a call that ended first (or 30 s) fails the test."""
    deadline = time.monotonic() + 30
    while await _running(client, rank) < count:
        for task in tasks:
            if task.done():
                task.result()  # its error, if it failed
                pytest.fail(f"a call finished before shard {rank} was seen running {count}")
        assert time.monotonic() < deadline, f"shard {rank} never ran {count} requests"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["cmpl", "chat", "gen"])
def test_preempted_request_is_redispatched_with_its_tokens(shards, kind, stream):
    async def main():
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, dict(enumerate(shards)), KEY)
        try:
            await router.set_shard(0, shards[0], "active")
            await router.set_shard(1, shards[1], "inactive")
            async with httpx.AsyncClient(timeout=60) as http:
                t0 = time.perf_counter()
                reference = await _call(http, server.url, kind, stream)
                took = time.perf_counter() - t0
                task = asyncio.create_task(_call(http, server.url, kind, stream))
                await _wait_running(client, 0, 1, task)
                # let it generate about a third of its tokens on shard 0 (scaled to this
                # machine's speed: a fixed wait let a fast engine finish before the cut)
                await asyncio.sleep(took / 3)
                await router.set_shard(1, state="active")
                await router.set_shard(0, state="preempted")  # what the fleet does first
                await client.abort_requests([0])
                cut = await asyncio.wait_for(task, 60)
            return reference, cut, router.relay.redispatched
        finally:
            await client.aclose()
            await server.stop()

    reference, cut, redispatched = asyncio.run(main())
    ref_ids, ref_text, _ = _tokens(kind, stream, reference)
    ids, text, finishes = _tokens(kind, stream, cut)
    assert redispatched == 1
    assert finishes == ["length"] and len(ids) == N
    # greedy decoding continued from the accumulated tokens gives the uninterrupted answer
    assert ids == ref_ids
    assert text.replace("\ufffd", "") == ref_text.replace("\ufffd", "")
    if kind == "gen" and not stream:
        spans = cut["choices"][0]["weight_versions"]
        assert len(spans) == 2 and spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
        assert spans[1]["end"] == N
    if stream:  # continuous usage: the original prompt, and every token so far of both attempts
        prompt = reference[-1]["usage"]["prompt_tokens"]
        so_far = 0
        for chunk in cut[:-1]:
            so_far += len(chunk["choices"][0].get("token_ids") or [])
            assert chunk["usage"]["prompt_tokens"] == prompt
            assert chunk["usage"]["completion_tokens"] == so_far
        assert cut[-1]["usage"]["completion_tokens"] == N


def test_ordinary_abort_reaches_the_caller(shards):
    async def main():
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, {0: shards[0]}, KEY)
        try:
            await router.set_shard(0, shards[0], "active")
            async with httpx.AsyncClient(timeout=60) as http:
                task = asyncio.create_task(_call(http, server.url, "gen", False))
                await _wait_running(client, 0, 1, task)
                await client.abort_requests([0])  # not preempted: e.g. a pause(abort) for a sync
                return await task, router.relay.redispatched
        finally:
            await client.aclose()
            await server.stop()

    answer, redispatched = asyncio.run(main())
    assert answer["choices"][0]["finish_reason"] == "abort" and redispatched == 0


def test_dead_shard_is_redispatched(tiny_model_dir, shards):
    async def main():
        with shard_processes(tiny_model_dir, 1) as (doomed,):
            router = Router(KEY)
            server = RouterServer(router)
            await server.start()
            client = RemoteInferenceClient(server.url, {9: doomed.url}, KEY)
            try:
                await router.set_shard(9, doomed.url, "active")
                async with httpx.AsyncClient(timeout=60) as http:
                    tasks = [asyncio.create_task(_call(http, server.url, k, s))
                             for k, s in (("gen", False), ("cmpl", True))]
                    await _wait_running(client, 9, 2, *tasks)
                    await router.set_shard(0, shards[0], "active")
                    os.kill(doomed.server_pid(), signal.SIGKILL)  # the process dies mid-request
                    results = await asyncio.gather(*tasks)
                return results, router.relay.redispatched
            finally:
                await client.aclose()
                await server.stop()

    (gen, cmpl), redispatched = asyncio.run(main())
    assert redispatched >= 2
    for kind, stream, payload in (("gen", False, gen), ("cmpl", True, cmpl)):
        ids, _, finishes = _tokens(kind, stream, payload)
        assert len(ids) == N and finishes == ["length"]


def test_session_stickiness(shards):
    async def main():
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        try:
            for i, url in enumerate(shards):
                await router.set_shard(i, url, "active")
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
                for _ in range(6):
                    r = await http.post(server.url + "/v1/completions", json=body, headers={"X-Session-ID": "abc"})
                    assert r.status_code == 200
            return [s["served"] for s in await router.shards()]
        finally:
            await server.stop()

    served = asyncio.run(main())
    assert sorted(served) == [0, 6]


def test_in_process_generate_survives_a_shard_killed_by_pid(tiny_model_dir, shards):
    """The pipeline's path (Router.generate, no router server): a shard SIGKILLed mid-request is
    re-dispatched to the live one, the typed answer has every token with its versions, and the
    live shard keeps serving."""
    from kit import pid_alive

    async def main():
        with shard_processes(tiny_model_dir, 1) as (doomed,):
            router = Router(KEY)
            client = RemoteInferenceClient(None, {9: doomed.url, 0: shards[0]}, KEY)
            try:
                await router.set_shard(9, doomed.url, "active")
                task = asyncio.create_task(router.generate([9, 8, 7], SP(**GREEDY, logprobs=1), "s"))
                await _wait_running(client, 9, 1, task)
                await router.set_shard(0, shards[0], "active")
                os.kill(doomed.server_pid(), signal.SIGKILL)
                out = await task
                dead = not pid_alive(doomed.pid)
                after = await router.generate([1, 2], SP(max_tokens=4, temperature=0), "t")
                return out, router.relay.redispatched, dead, after
            finally:
                await client.aclose()
                await router.close()

    out, redispatched, dead, after = asyncio.run(main())
    assert dead and redispatched >= 1
    assert len(out.token_ids) == N and len(out.logprobs) == N and out.finish_reason == "length"
    assert out.weight_versions[0].start == 0 and out.weight_versions[-1].end == N
    assert len(after.token_ids) == 4


def _with_n(kind: str, n: int) -> tuple[str, dict]:
    path, body = CASES[kind]
    if kind == "gen":
        return path, {**body, "sampling_params": {**body["sampling_params"], "n": n}}
    return path, {**body, "n": n}


def _choices(kind: str, stream: bool, payload) -> dict[int, tuple[list[int], str, list[str]]]:
    """{index: (token ids, text, finish reasons)} of an answer with several choices."""
    if not stream:
        return {c["index"]: _tokens(kind, False, {"choices": [c]}) for c in payload["choices"]}
    by_index: dict[int, list] = {}
    for chunk in payload:
        for c in chunk["choices"]:
            by_index.setdefault(c["index"], []).append({"choices": [c]})
    return {i: _tokens(kind, True, chunks) for i, chunks in by_index.items()}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["cmpl", "chat", "gen"])
def test_a_preempted_request_of_n_samples_continues_each_sample(shards, kind, stream):
    """n = 3 goes whole to one shard; preempted mid-way, each sample continues on its own on
    the other shard from its own tokens, and the caller gets 3 whole choices by index."""
    path, body = _with_n(kind, 3)
    body = {**body, "return_token_ids": True, "stream": stream}

    async def call(http, url):
        r = await http.post(url + path, json=body)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()
        return sse_events(r.text)

    async def main():
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, dict(enumerate(shards)), KEY)
        try:
            await router.set_shard(0, shards[0], "active")
            await router.set_shard(1, shards[1], "inactive")
            async with httpx.AsyncClient(timeout=60) as http:
                t0 = time.perf_counter()
                reference = await call(http, server.url)
                took = time.perf_counter() - t0
                task = asyncio.create_task(call(http, server.url))
                await _wait_running(client, 0, 3, task)
                await asyncio.sleep(took / 3)
                await router.set_shard(1, state="active")
                await router.set_shard(0, state="preempted")
                await client.abort_requests([0])
                cut = await asyncio.wait_for(task, 60)
            return reference, cut, router.relay.redispatched
        finally:
            await client.aclose()
            await server.stop()

    reference, cut, redispatched = asyncio.run(main())
    ref, got = _choices(kind, stream, reference), _choices(kind, stream, cut)
    assert sorted(got) == [0, 1, 2] and redispatched == 3
    for i in range(3):
        ids, text, finishes = got[i]
        assert finishes == ["length"] and ids == ref[i][0] and len(ids) == N  # greedy: continued exactly
        assert text.replace("\ufffd", "") == ref[i][1].replace("\ufffd", "")
    if not stream:
        assert cut["usage"]["completion_tokens"] == 3 * N
        if kind == "gen":
            for c in cut["choices"]:
                spans = c["weight_versions"]
                assert len(spans) == 2 and spans[0]["start"] == 0 and spans[-1]["end"] == N


def test_in_process_generate_sends_every_sampling_field_its_caller_set_even_a_default():
    """The router's backend fills in its own defaults for what is not sent, and they are not
    rlix's (vLLM's max_tokens is not 16): a caller's max_tokens of 16 must reach the shard, or a
    re-dispatched continuation computes what is left from the wrong limit."""
    async def main() -> dict:
        router = Router(KEY)
        sent: dict = {}

        async def unary(path, body, session):  # noqa: ANN001, ANN202
            sent.update(body)
            return 200, {"choices": [{"token_ids": [4], "finish_reason": "length",
                                      "logprobs": {"content": [{"token_id": 4, "logprob": -1.0}]},
                                      "weight_versions": [{"version": "0", "start": 0, "end": 1}]}]}
        router.relay.unary = unary  # type: ignore[method-assign]
        try:
            await router.generate([1, 2], SP(max_tokens=16, temperature=1.0, seed=3))
        finally:
            await router.close()
        return sent
    sent = asyncio.run(main())
    assert sent["sampling_params"] == {"max_tokens": 16, "temperature": 1.0, "seed": 3}


def test_a_continuation_keeps_include_stop_and_the_min_tokens_left():
    """min_tokens counts the output of every attempt: a continuation asks only for the rest
    (asking for all of it again could exceed the max_tokens left: a 400 mid-request)."""
    from rlix.inference.router.attempts import Attempts

    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 20, "min_tokens": 10,
                                            "include_stop_str_in_output": True, "stop": ["."]}),
                       ("/v1/chat/completions", {"messages": [], "max_tokens": 20, "min_tokens": 10,
                                                 "include_stop_str_in_output": True}),
                       ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {
                           "max_tokens": 20, "min_tokens": 10}})):
        prog = Attempts(path, body, False, prompt_ids=[1, 2], ids=[5] * 7)
        up_path, sent = prog.upstream()
        params = sent["sampling_params"] if up_path == "/inference/v1/generate" else sent
        assert params["min_tokens"] == 3 and params["max_tokens"] == 13, path
        if up_path != "/inference/v1/generate":
            assert sent["include_stop_str_in_output"] is True and sent["prompt"] == [1, 2] + [5] * 7
        prog.ids = [5] * 12  # past it: nothing more to hold back
        params = prog.upstream()[1]
        assert (params.get("sampling_params") or params)["min_tokens"] == 0


def test_the_router_refuses_a_list_of_several_prompts():
    async def main():
        server = RouterServer(Router(KEY, hold_timeout_s=0.2))
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
                many = await http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["a", "b"]})
                one = await http.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ["a"]})
            return many, one
        finally:
            await server.stop()

    many, one = asyncio.run(main())
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
    assert one.status_code == 503  # one prompt is relayed (no shard here to take it)
