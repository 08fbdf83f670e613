"""The engine server in-process (ASGI, real engine): stop strings, stream == non-stream text,
unsupported options, TextStream deltas."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlix.inference.server.serving import TextStream
from rlix.inference.server.app import create_app

KEY = "k"


def _run(engine, fn):
    app = create_app(engine, engine.tokenizer, "tiny", KEY)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await fn(http)
    return asyncio.run(main())


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_stop_string_cuts_the_text(engine):
    async def fn(http):
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        full = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = full[10:13]
        assert stop and full.find(stop) >= 1
        cut = (await http.post("/v1/completions", json={**body, "stop": [stop]})).json()["choices"][0]
        streamed = _sse((await http.post("/v1/completions", json={**body, "stop": stop, "stream": True})).text)
        return full, stop, cut, streamed

    full, stop, cut, streamed = _run(engine, fn)
    assert cut["text"] == full[:full.find(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert "".join(c["choices"][0]["text"] for c in streamed) == cut["text"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_text_equals_plain_text(engine):
    async def fn(http):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 30,
                "temperature": 0, "ignore_eos": True}
        plain = (await http.post("/v1/chat/completions", json=body)).json()
        chunks = _sse((await http.post("/v1/chat/completions", json={**body, "stream": True})).text)
        return plain, chunks

    plain, chunks = _run(engine, fn)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extra,param", [({"n": 2}, "n"), ({"echo": True}, "echo"),
                                         ({"prompt": ["a", "b"]}, "prompt")])
def test_unsupported_options_are_refused_clearly(engine, extra, param):
    async def fn(http):
        return await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", **extra})
    r = _run(engine, fn)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_text_stream_deltas_join_to_the_decode(engine):
    tok = engine.tokenizer
    ids = tok("héllo wörld ünïcode ✓ done", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok)
    parts = [ts.update(ids[:i], final=False) for i in range(1, len(ids))]
    parts.append(ts.update(ids, final=True))
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in parts)
