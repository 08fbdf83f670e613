"""The engine server's GET /metrics: Prometheus exposition under vLLM's names, parsed by
prometheus_client's own parser; token counters, time to first token and latency move with
generations; the gauges the fleet's drain reads are still there."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rlix.inference.fleet.client import parse_load
from rlix.inference.server.app import create_app

KEY = "k"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without engine/model_name) -> value, for every sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))
            out[(s.name, labels)] = s.value
    return out


def test_metrics_move_with_generations(engine, prompt, h):
    app = create_app(engine, engine.tokenizer, "tiny", KEY)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            before = (await http.get("/metrics")).text
            # a rollout's request (the fast non-streamed path) and a streamed completion
            body = {"token_ids": prompt(5), "sampling_params": {"max_tokens": 7, "ignore_eos": True}}
            answer = (await http.post("/inference/v1/generate", json=body)).json()
            assert len(answer["choices"][0]["token_ids"]) == 7
            body = {"model": "tiny", "prompt": prompt(3), "max_tokens": 4, "ignore_eos": True, "stream": True}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            after = (await http.get("/metrics")).text

            # a request frozen mid-generation: running, and holding part of the KV cache
            body = {"token_ids": prompt(6), "sampling_params": {"max_tokens": 60, "ignore_eos": True}}
            held = asyncio.ensure_future(http.post("/inference/v1/generate", json=body))
            await h.wait_for(lambda: engine.num_running() == 1)
            await engine.pause("keep")
            busy = (await http.get("/metrics")).text
            await engine.resume()
            await held
            return before, after, busy

    before, after, busy = asyncio.run(main())
    b, a, m = samples(before), samples(after), samples(busy)
    assert b[("vllm:prompt_tokens_total", ())] == 0 and b[("vllm:generation_tokens_total", ())] == 0
    assert a[("vllm:prompt_tokens_total", ())] == 5 + 3
    assert a[("vllm:generation_tokens_total", ())] == 7 + 4
    assert a[("vllm:request_success_total", (("finished_reason", "length"),))] == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert b[(f"{name}_count", ())] == 0 and a[(f"{name}_count", ())] == 2, name
    assert 0 < a[("vllm:time_to_first_token_seconds_sum", ())] <= a[("vllm:e2e_request_latency_seconds_sum", ())]
    assert a[("vllm:request_generation_tokens_sum", ())] == 11
    assert a[("vllm:num_requests_running", ())] == 0 and a[("vllm:kv_cache_usage_perc", ())] == 0
    assert a[("rlix:weight_version", ())] == engine.weight_version
    assert a[("rlix:prefix_cache_hit_tokens", ())] == engine.prefix_hit_tokens == 0  # short prompts

    assert m[("vllm:num_requests_running", ())] == 1
    assert 0 < m[("vllm:kv_cache_usage_perc", ())] == m[("vllm:gpu_cache_usage_perc", ())] < 1
    # what the fleet's drain reads from a shard's page
    assert parse_load(busy) == {"running": 1.0, "waiting": 0.0}
    assert parse_load(after) == {"running": 0.0, "waiting": 0.0}
