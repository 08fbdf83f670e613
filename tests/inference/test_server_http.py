"""Acceptance over real HTTP against one `rlix serve` process: bad input gets a clear 4xx and the
server keeps serving; pause(keep) resumes to the same seeded output; sleep level 2 -> wake ->
weights reloaded through the update protocol -> the same output as before the sleep."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file, save

from kit import AUTH, shard_processes

OK_BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with shard_processes(tiny_model_dir, 1) as procs:
        with httpx.Client(base_url=procs[0].url, headers=AUTH, timeout=60) as http:
            yield http


def _assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=OK_BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path,kwargs,status,words", [
    ("/v1/completions", {"content": b'{"prompt": "x", '}, 400, "JSON"),
    ("/v1/chat/completions", {"content": b"[1,"}, 400, "JSON"),
    ("/inference/v1/generate", {"content": b"not json"}, 400, "JSON"),
    ("/v1/completions", {"json": {**OK_BODY, "model": "gpt-9"}}, 404, "does not exist"),
    ("/v1/chat/completions", {"json": {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}},
     404, "does not exist"),
    ("/v1/completions", {"json": {**OK_BODY, "max_tokens": 0}}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"json": {**OK_BODY, "max_tokens": -5}}, 400, "max_tokens must be at least 1"),
    ("/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}},
     400, "max_tokens must be at least 1"),
    ("/inference/v1/generate", {"json": {"token_ids": [5], "sampling_params": {"max_tokens": 0}}},
     400, "max_tokens must be at least 1"),
    ("/v1/completions", {"json": {**OK_BODY, "prompt": [5] * 600}}, 400, "maximum context length is 512"),
    ("/v1/completions", {"json": {**OK_BODY, "prompt": "word " * 600}}, 400, "maximum context length"),
    ("/inference/v1/generate", {"json": {"token_ids": [5] * 513, "sampling_params": {}}}, 400,
     "maximum model length of 512"),
    ("/inference/v1/generate", {"json": {"token_ids": [], "sampling_params": {}}}, 400, "at least 1 item"),
    ("/v1/completions", {"json": {**OK_BODY, "prompt": [10**9]}}, 400, "outside the vocabulary"),
])
def test_bad_input_gets_4xx_and_server_keeps_serving(server, path, kwargs, status, words):
    headers = {"content-type": "application/json"} if "content" in kwargs else {}
    r = server.post(path, headers=headers, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status
    _assert_still_serving(server)


@pytest.mark.parametrize("method,path", [
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/abort_requests"),
    ("POST", "/start_weight_update"), ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"), ("POST", "/v1/completions"),
])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_control_needs_the_token(server, method, path, token):
    headers = {"Authorization": f"Bearer {token}"} if token else {"Authorization": ""}
    r = server.request(method, path, headers=headers)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert server.get("/is_paused").json() == {"is_paused": False}  # nothing happened
    _assert_still_serving(server)


def _stream_tokens(http: httpx.Client, body: dict, on_token=None) -> list[int]:
    ids: list[int] = []
    with http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    ids += chunk["choices"][0]["token_ids"]
                    if on_token:
                        on_token(len(ids))
    return ids


def test_pause_keep_freezes_and_resumes_to_the_same_output(server):
    body = {"token_ids": [7, 8, 9], "sampling_params": {"max_tokens": 120, "temperature": 1.0,
                                                         "seed": 1234, "ignore_eos": True}}
    reference = server.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"]
    assert len(reference) == 120

    paused_at: dict[str, int] = {}
    progress = {"n": 0}

    def on_token(n: int) -> None:
        progress["n"] = n

    def control() -> None:
        while progress["n"] < 20:
            time.sleep(0.001)
        assert server.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        paused_at["n"] = progress["n"]
        time.sleep(0.5)  # frozen: no token may arrive meanwhile (a step in flight may land)
        paused_at["after"] = progress["n"]
        assert server.get("/is_paused").json() == {"is_paused": True}
        assert server.post("/resume").json() == {"status": "resumed"}

    t = threading.Thread(target=control)
    t.start()
    got = _stream_tokens(server, body, on_token)
    t.join()
    assert paused_at["after"] - paused_at["n"] <= 1, paused_at
    assert 20 <= paused_at["after"] < 120
    assert got == reference


def test_sleep2_wake_reload_weights_gives_the_same_output(server, tiny_model_dir):
    body = {"token_ids": [11, 12, 13], "sampling_params": {"max_tokens": 24, "temperature": 0,
                                                            "ignore_eos": True}}
    before = server.post("/inference/v1/generate", json=body).json()["choices"][0]
    assert before["weight_versions"] == [{"version": "0", "start": 0, "end": 24}]

    slept = server.post("/sleep", params={"level": 2}).json()
    assert slept["status"] == "sleeping" and slept["level"] == 2
    assert slept["memory"]["reserved"] == 0  # on CPU nothing is held on a device
    assert slept["memory"]["freed_bytes"] >= 0  # the room it needs again: the hand-off check's need
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = server.post("/inference/v1/generate", json=body)
    assert refused.status_code == 503, refused.text

    woke = server.post("/wake_up", params=[("tags", "weights")]).json()
    assert woke == {"status": "sleeping", "tags": ["weights"]}  # KV cache still asleep
    weights = save(load_file(tiny_model_dir / "model.safetensors"))
    assert server.post("/start_weight_update", json={"weight_version": 5}).status_code == 200
    r = server.post("/update_weights", content=weights, headers={"content-type": "application/octet-stream"})
    assert r.json() == {"message": "Weights updated"}, r.text
    assert server.post("/finish_weight_update", json={"weight_version": 5}).json() == {
        "message": "Weight update finished"}
    assert server.post("/wake_up", params=[("tags", "kv_cache")]).json() == {
        "status": "awake", "tags": ["kv_cache"]}

    after = server.post("/inference/v1/generate", json=body).json()["choices"][0]
    assert after["token_ids"] == before["token_ids"]
    assert after["weight_versions"] == [{"version": "5", "start": 0, "end": 24}]
    assert server.get("/weight_info").json() == {"weight_version": "5"}


def test_failed_weight_update_keeps_old_weights(server):
    body = {"token_ids": [21, 22], "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    before = server.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"]
    version = server.get("/weight_info").json()["weight_version"]
    assert server.post("/start_weight_update").status_code == 200
    bad = server.post("/update_weights", content=b"garbage", headers={"content-type": "application/octet-stream"})
    assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
    r = server.post("/finish_weight_update")
    assert r.status_code == 400 and "no weight update in progress" in r.json()["error"]["message"]
    assert server.get("/weight_info").json()["weight_version"] == version
    assert server.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"] == before


def test_fast_generate_serves_valid_bodies_and_hands_the_rest_to_the_app():
    import asyncio as aio
    import json as js

    from rlix.errors import EngineStateError
    from rlix.inference.server.app import FastGenerate

    seen: list[bytes] = []

    async def app(scope, receive, send):  # the FastAPI app's stand-in: records what reached it
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    class Serving:
        def prepare_generate(self, req):
            if req.token_ids == [13]:
                raise EngineStateError("asleep")
            return req

        async def generate(self, req):
            return {"ids": req.token_ids}

    async def call(body: bytes, path: str = "/inference/v1/generate") -> tuple[int, bytes]:
        sent: list[dict] = []
        queue = [{"type": "http.request", "body": body[:3], "more_body": True},
                 {"type": "http.request", "body": body[3:], "more_body": False}]

        async def receive():
            return queue.pop(0) if queue else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await FastGenerate(app, Serving())({"type": "http", "method": "POST", "path": path}, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def main():
        ok = await call(js.dumps({"token_ids": [5, 6], "sampling_params": {}}).encode())
        assert ok[0] == 200 and js.loads(ok[1]) == {"ids": [5, 6]} and seen == []
        asleep = await call(js.dumps({"token_ids": [13], "sampling_params": {}}).encode())
        assert asleep[0] == 503 and "asleep" in js.loads(asleep[1])["error"]["message"] and seen == []
        for body in (b"not json", js.dumps({"token_ids": [5], "sampling_params": {}, "stream": True}).encode()):
            assert await call(body) == (299, b"app") and seen[-1] == body  # the whole body, replayed
        assert await call(b"{}", path="/v1/completions") == (299, b"app")

    aio.run(main())
