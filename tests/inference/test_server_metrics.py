"""The engine server's GET /metrics: Prometheus exposition under vLLM's names, parsed by
prometheus_client's own parser; token counters, time to first token and latency move with
generations; the gauges the fleet's drain reads are still there."""

from __future__ import annotations

import asyncio

import httpx
import pytest
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


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_families_take_the_engines_real_values(make_engine, prompt, h):
    """After two requests with n=2 and a streamed one, each family holds what happened: n and
    max_tokens per request and sample, one phase observation per sample, a latency per token
    after each sample's first, tokens per step summing to what was prefilled and sampled; then
    the prefix cache's queries and hits on a next turn, a pause's deferred request, a sleep."""
    engine = make_engine()
    app = create_app(engine, engine.tokenizer, "tiny", KEY)
    first = prompt(40)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            for length in (5, 7):
                body = {"model": "tiny", "prompt": prompt(length), "max_tokens": 6, "n": 2, "ignore_eos": True}
                assert len((await http.post("/v1/completions", json=body)).json()["choices"]) == 2
            body = {"model": "tiny", "prompt": first, "max_tokens": 4, "ignore_eos": True, "stream": True}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            after = (await http.get("/metrics")).text
            # the next turn starts with the last one's prompt and answer: the prefix cache's hit
            body = {"model": "tiny", "prompt": first + [9] * 30, "max_tokens": 2, "ignore_eos": True}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            cached = (await http.get("/metrics")).text
            await engine.pause("keep")
            body = {"token_ids": prompt(4), "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
            held = asyncio.ensure_future(http.post("/inference/v1/generate", json=body))
            await h.wait_for(lambda: engine.num_waiting() == 1 and engine._core.waiting)
            paused = (await http.get("/metrics")).text
            await engine.resume()
            await held
            await engine.sleep(1)
            asleep = (await http.get("/metrics")).text
            await engine.wake_up()
            return after, cached, paused, asleep

    after, cached, paused, asleep = asyncio.run(main())
    a = samples(after)
    requests, samples_ = 3, 5
    generated = 2 * 2 * 6 + 4
    assert a[("vllm:request_params_n_count", ())] == requests and a[("vllm:request_params_n_sum", ())] == 5
    assert a[("vllm:request_params_max_tokens_count", ())] == samples_
    assert a[("vllm:request_params_max_tokens_sum", ())] == 4 * 6 + 4
    assert a[("vllm:request_max_num_generation_tokens_sum", ())] == 6 + 6 + 4
    assert a[("vllm:generation_tokens_total", ())] == generated
    assert a[("vllm:prompt_tokens_total", ())] == 2 * 5 + 2 * 7 + 40  # each sample's prompt
    # the engine's phases: one observation per sample; decode is the sum of its token latencies
    for name in ("queue", "prefill", "decode", "inference"):
        assert a[(f"vllm:request_{name}_time_seconds_count", ())] == samples_, name
    assert a[("vllm:request_queue_time_seconds_sum", ())] > 0
    assert a[("vllm:inter_token_latency_seconds_count", ())] == generated - samples_
    itl = a[("vllm:inter_token_latency_seconds_sum", ())]
    assert itl > 0 and a[("vllm:request_decode_time_seconds_sum", ())] == pytest.approx(itl, rel=1e-6)
    assert a[("vllm:request_inference_time_seconds_sum", ())] == pytest.approx(
        a[("vllm:request_prefill_time_seconds_sum", ())] + a[("vllm:request_decode_time_seconds_sum", ())], rel=1e-6)
    assert a[("vllm:request_time_per_output_token_seconds_count", ())] == samples_
    # every token the engine computed, by step: prompts prefilled once per request, samples' tokens
    assert a[("vllm:iteration_tokens_total_sum", ())] == 5 + 7 + 40 + generated
    assert a[("vllm:iteration_tokens_total_count", ())] >= 6 + 4  # at least a step per token
    # a request's second sample copies the first's prefill: computed 0, counted as cached
    assert a[("vllm:request_prefill_kv_computed_tokens_sum", ())] == 5 + 7 + 40
    by_source = {dict(k[1])["source"]: v for k, v in a.items() if k[0] == "vllm:prompt_tokens_by_source_total"}
    assert by_source == {"local_compute": 52, "local_cache_hit": 5 + 7, "external_kv_transfer": 0}
    assert a[("vllm:prompt_tokens_cached_total", ())] == 12
    # the engine never preempts (engine/stats.py): each finished sample records 0
    assert a[("vllm:request_num_preemptions_count", ())] == samples_
    assert a[("vllm:request_num_preemptions_sum", ())] == 0 and a[("vllm:num_preemptions_total", ())] == 0
    assert a[("vllm:request_success_total", (("finished_reason", "length"),))] == samples_
    assert a[("vllm:request_success_total", (("finished_reason", "abort"),))] == 0

    c = samples(cached)
    hit = engine.prefix_hit_tokens
    assert 40 <= hit <= 40 + 4 - 1  # the streamed turn's prompt (and answer tokens that match)
    assert c[("vllm:prefix_cache_hits_total", ())] == hit
    assert c[("vllm:prefix_cache_queries_total", ())] == 5 + 7 + 40 + 70  # each request's prompt
    assert c[("vllm:request_prefill_kv_computed_tokens_sum", ())] == 5 + 7 + 40 + 70 - hit

    p = samples(paused)
    assert p[("vllm:num_requests_waiting_by_reason", (("reason", "deferred"),))] == 1
    assert p[("vllm:num_requests_waiting_by_reason", (("reason", "capacity"),))] == 0
    assert samples(after)[("vllm:engine_sleep_state", (("sleep_state", "awake"),))] == 1
    s = samples(asleep)
    assert [s[("vllm:engine_sleep_state", (("sleep_state", k),))] for k in
            ("awake", "weights_offloaded", "discard_all")] == [0, 1, 0]

    # typed as vLLM's, histogram buckets as vLLM's defaults (engine/stats.py)
    fams = families(after)
    assert fams["vllm:inter_token_latency_seconds"].type == "histogram"
    assert fams["vllm:num_preemptions"].type == "counter"
    les = [s.labels["le"] for s in fams["vllm:request_params_n"].samples if s.name.endswith("_bucket")]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
