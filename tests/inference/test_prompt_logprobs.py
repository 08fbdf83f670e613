"""vLLM's `prompt_logprobs` on the three endpoints: each prompt token's logprob (the first has
none) from the prefill, with k alternatives, in vLLM's shape ({token id: {logprob, rank,
decoded_token}}), equal to the model's own log-softmax; refused where vLLM refuses it (a stream,
more than 20) and by the router, which relays streams."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from kit import KEY
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.router.app import RouterServer
from rlix.inference.router.router import Router
from rlix.inference.server.app import create_app

PROMPT = [5, 17, 99, 3, 250, 42, 8]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=8, max_model_len=512)
    with TestClient(create_app(engine, engine.tokenizer, "tiny", KEY), headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http, engine
    engine.close()


def reference(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    """log p(token j | tokens before it) for j >= 1, by the served model itself: [len - 1, V]."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def check(entries: list, ids: list[int], raw: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for j, entry in enumerate(entries[1:], 1):
        token = str(ids[j])
        assert token in entry and set(entry[token]) == {"logprob", "rank", "decoded_token"}
        assert entry[token]["logprob"] == pytest.approx(float(raw[j - 1, ids[j]]), abs=1e-4)
        best = raw[j - 1].topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *map(str, best)}  # the token and the k best
        for r, tid in enumerate(best, 1):
            assert entry[str(tid)]["rank"] == r
        if ids[j] not in best:
            assert entry[token]["rank"] is None  # ranked only among the alternatives computed


def test_prompt_logprobs_on_completions_chat_and_generate(served):
    http, engine = served
    got = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                                             "prompt_logprobs": 3, "n": 2}).json()
    raw = reference(engine, PROMPT)
    for choice in got["choices"]:
        check(choice["prompt_logprobs"], PROMPT, raw, 3)
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, "prompt_logprobs": 0,
                                                   "return_token_ids": True}).json()
    ids = chat["prompt_token_ids"]
    check(chat["prompt_logprobs"], ids, reference(engine, ids), 0)
    gen = http.post("/inference/v1/generate", json={"model": "tiny", "token_ids": PROMPT,
                                                    "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}).json()
    check(gen["prompt_logprobs"], PROMPT, raw, 1)
    # without the field: null, as vLLM answers
    plain = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"prompt_logprobs": 1}, "stream": True},
     "sampling_params.prompt_logprobs"),
])
def test_refused_where_vllm_refuses(served, path, body, param):
    http, _ = served
    top = {} if "sampling_params" in body else {"max_tokens": 2}
    answer = http.post(path, json={"model": "tiny", **top, **body})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    if body.get("stream") and "sampling_params" not in body:  # 0 asks for nothing in a stream: allowed
        ok = http.post(path, json={"model": "tiny", **top, **body, "prompt_logprobs": 0})
        assert ok.status_code == 200


def test_the_router_refuses_prompt_logprobs_naming_the_field():
    async def main():
        server = RouterServer(Router(KEY, hold_timeout_s=0.2))
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
                return [await http.post(server.url + path, json={"model": "tiny", **body}) for path, body in (
                    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1}),
                    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"prompt_logprobs": 0}}),
                    ("/v1/completions", {"prompt": "a"}))]
        finally:
            await server.stop()

    cmpl, gen, plain = asyncio.run(main())
    assert cmpl.status_code == 400 and cmpl.json()["error"]["param"] == "prompt_logprobs"
    assert gen.status_code == 400 and gen.json()["error"]["param"] == "sampling_params.prompt_logprobs"
    assert plain.status_code == 503  # relayed (no shard here to take it)
