"""A list of prompts on /v1/completions, in-process (the real engine): each prompt runs as a
request of its own, seeded as it would be alone; the list is bounded and every prompt checked
before any runs; a stream closed early aborts every prompt's request. (Shapes against vLLM:
contract/test_vllm_fields.py.)"""

from __future__ import annotations

import asyncio
import json

import httpx

from rlix.inference.server import openai_schema as S
from rlix.inference.server.app import create_app
from rlix.inference.server.serving import OpenAIServing

KEY = "k"


def _run(engine, fn):
    app = create_app(engine, engine.tokenizer, "tiny", KEY)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await fn(http)
    return asyncio.run(main())


def test_each_prompt_samples_as_it_would_alone(engine):
    """Seeded: a prompt's n samples in the list are its samples alone (sample i draws from
    seed + i), whatever the other prompts in the batch."""
    body = {"model": "tiny", "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    prompts = ["hello there", [5, 6, 7, 8, 9], "abc"]

    async def fn(http):
        alone = [(await http.post("/v1/completions", json={**body, "prompt": p})).json() for p in prompts]
        return alone, (await http.post("/v1/completions", json={**body, "prompt": prompts[:1] + prompts[2:]})).json()

    async def with_ids(http):
        return (await http.post("/v1/completions", json={**body, "prompt": [[5, 6, 7, 8, 9], [40, 41]]})).json()

    alone, together = _run(engine, fn)
    texts = [c["text"] for c in together["choices"]]
    assert texts == [c["text"] for a in (alone[0], alone[2]) for c in a["choices"]]
    assert together["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"] + alone[2]["usage"]["prompt_tokens"]
    ids = _run(engine, with_ids)
    assert [c["text"] for c in ids["choices"][:2]] == [c["text"] for c in alone[1]["choices"]]
    assert ids["usage"] == S.usage(7, 32)


def test_the_list_is_bounded_and_every_prompt_checked_first(engine):
    async def fn(http):
        over = await http.post("/v1/completions", json={"model": "tiny", "prompt": ["a"] * 1025})
        long = await http.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6], [5] * 5000, [7]],
                                                         "max_tokens": 2})
        return over, long

    over, long = _run(engine, fn)
    assert over.status_code == 400 and over.json()["error"]["param"].startswith("body.prompt")
    assert "1024" in over.json()["error"]["message"]
    assert long.status_code == 400 and "maximum context length" in long.json()["error"]["message"]
    assert engine._core.prefill_tokens == 0  # refused before [5, 6] (the first prompt) ran


def test_a_stream_closed_early_aborts_every_prompts_request(engine):
    serving = OpenAIServing(engine, engine.tokenizer, "tiny")
    req = S.CompletionRequest(model="tiny", prompt=["one", "two", "three"], n=2, max_tokens=400,
                              ignore_eos=True, stream=True)

    async def main():
        jobs = serving.prepare_completion(req)
        assert [j.first_index for j in jobs] == [0, 2, 4] and len({j.engine_rid for j in jobs}) == 3
        stream = serving.completion_stream(jobs)
        seen = set()
        async for event in stream:
            seen.add(json.loads(event[6:])["choices"][0]["index"])
            if len(seen) == 6:
                break
        assert engine.num_running() == 6  # every prompt's samples are running
        await stream.aclose()
        for _ in range(500):  # aborted: long before 400 tokens each
            if engine.num_running() == 0 and engine.num_waiting() == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
