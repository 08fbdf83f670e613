"""The engine server in-process (ASGI, real engine): stop strings, stream == non-stream text,
unsupported options, TextStream deltas."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlix.inference.server.text_stream import TextStream
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


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"prompt": [[5], []]}, "prompt"),  # each prompt is checked
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 100}, "n"),  # more than the engine's batch
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"min_tokens": 17}, "min_tokens"),  # above max_tokens (16, the default)
    ("/v1/chat/completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("/inference/v1/generate", {"sampling_params": {"min_tokens": 17}}, "sampling_params.min_tokens"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"stream": True, "stream_options": {"usage_every": 2}},
     "stream_options.usage_every"),
    ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
    ("/inference/v1/generate", {"sampling_params": {"structured_outputs": {"regexp": "a"}}},
     "sampling_params.structured_outputs.regexp"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),
    ("/inference/v1/generate", {"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ("/inference/v1/generate", {"sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
    ("/inference/v1/generate", {"lora_request": {"name": "a"}}, "lora_request"),
])
def test_unsupported_options_are_refused_naming_the_field(engine, path, extra, param):
    base = {"/v1/completions": {"model": "tiny", "prompt": "x"},
            "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
            "/inference/v1/generate": {"token_ids": [5, 6], "sampling_params": {}}}[path]

    async def fn(http):
        body = {**base, **extra}
        if "sampling_params" in extra:
            body["sampling_params"] = {**base["sampling_params"], **extra["sampling_params"]}
        return await http.post(path, json=body)
    r = _run(engine, fn)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param.split(".")[-1].split("[")[0] in r.json()["error"]["message"]


def test_inert_fields_pass_and_vllm_extensions_keep_working(engine):
    """What OpenAI clients and rlix's callers send that changes nothing here is accepted."""
    async def fn(http):
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                "user": "u1", "store": False, "metadata": {"a": "b"}, "response_format": {"type": "text"},
                "parallel_tool_calls": True, "n": 1, "seed": 3, "ignore_eos": True,
                "skip_special_tokens": False, "return_token_ids": True, "min_tokens": 0,
                "repetition_penalty": 1.1, "stream_options": {"include_usage": True}}
        cmpl = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "best_of": 1, "echo": False,
                "add_special_tokens": True, "return_tokens_as_token_ids": True, "logprobs": 2}
        gen = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2, "logprobs": 1, "seed": 1,
                                                        "skip_special_tokens": True, "detokenize": False},
               "request_id": "abc", "return_token_ids": True, "priority": 0}
        return [await http.post(p, json=b) for p, b in (("/v1/chat/completions", chat),
                                                         ("/v1/completions", cmpl),
                                                         ("/inference/v1/generate", gen))]
    answers = _run(engine, fn)
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    lp = answers[1].json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])


def test_text_stream_deltas_join_to_the_decode(engine):
    tok = engine.tokenizer
    ids = tok("héllo wörld ünïcode ✓ done", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok)
    parts = [ts.update(ids[:i], final=False) for i in range(1, len(ids))]
    parts.append(ts.update(ids, final=True))
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in parts)


def test_token_level_generate_takes_n_and_logprob_alternatives(engine):
    """vLLM's generate shapes: n choices by index (each with its weight-version spans); logprobs
    k >= 2: the sampled token first, then the best others, k entries with their ranks."""
    async def fn(http):
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "n": 3, "temperature": 1.0,
                                                            "seed": 4, "logprobs": 3, "ignore_eos": True}}
        plain = (await http.post("/inference/v1/generate", json=body)).json()
        streamed = _sse((await http.post("/inference/v1/generate", json={**body, "stream": True})).text)
        return plain, streamed

    plain, streamed = _run(engine, fn)
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2] and plain["usage"]["completion_tokens"] == 12
    for c in plain["choices"]:
        assert c["weight_versions"] == [{"version": "0", "start": 0, "end": 4}]
        for item in c["logprobs"]["content"]:
            top = item["top_logprobs"]
            assert len(top) == 3 and top[0]["token_id"] == item["token_id"] and top[0]["rank"] == item["rank"]
            others = [t["logprob"] for t in top[1:]]
            assert others == sorted(others, reverse=True) and all(t["rank"] for t in top[1:])
    ids = {}
    for chunk in streamed:
        for c in chunk["choices"]:
            ids.setdefault(c["index"], []).extend(c["token_ids"])
    assert ids == {c["index"]: c["token_ids"] for c in plain["choices"]}  # seeded: the same samples


def test_completion_echo_with_n_and_a_token_prompt(engine):
    async def fn(http):
        body = {"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 3, "n": 2, "echo": True,
                "temperature": 0, "ignore_eos": True}
        return (await http.post("/v1/completions", json=body)).json()

    r = _run(engine, fn)
    prompt_text = engine.tokenizer.decode([40, 41, 42])
    assert len(r["choices"]) == 2 and all(c["text"].startswith(prompt_text) for c in r["choices"])
    assert r["choices"][0]["text"] == r["choices"][1]["text"]  # greedy


def test_a_stop_string_ends_each_of_n_choices_on_its_own(engine):
    async def fn(http):
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        full = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        stop = full[10:13]
        cut = (await http.post("/v1/completions", json={**body, "n": 3, "stop": [stop]})).json()
        streamed = _sse((await http.post("/v1/completions", json={**body, "n": 3, "stop": stop,
                                                                  "stream": True})).text)
        return full, stop, cut, streamed

    full, stop, cut, streamed = _run(engine, fn)
    expected = full[:full.find(stop)]
    assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in cut["choices"]] == [(expected, "stop", stop)] * 3
    texts, finishes = {}, {}
    for chunk in streamed:
        c = chunk["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        finishes.setdefault(c["index"], []).extend([c["finish_reason"]] if c["finish_reason"] else [])
    assert texts == {0: expected, 1: expected, 2: expected} and finishes == {i: ["stop"] for i in range(3)}


def test_metrics_count_each_sample_as_a_request_and_its_shared_prefill_as_cached(engine):
    """n = 3 samples: 3 finished requests, each with its prompt (vLLM's child requests), 3 x
    output; the prompt was computed once, the other two samples' prompts were copied (cached)."""
    from prometheus_client.parser import text_string_to_metric_families

    def values(text):
        return {(s.name, s.labels.get("finished_reason") or s.labels.get("source")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    async def fn(http):
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 3, "ignore_eos": True}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        return (await http.get("/metrics")).text

    v = values(_run(engine, fn))
    assert v[("vllm:prompt_tokens_total", None)] == 3 * 4 and v[("vllm:generation_tokens_total", None)] == 15
    assert v[("vllm:request_success_total", "length")] == 3
    assert v[("vllm:prompt_tokens_by_source_total", "local_compute")] == 4
    assert v[("vllm:prompt_tokens_by_source_total", "local_cache_hit")] == 2 * 4
    assert v[("vllm:request_params_n_count", None)] == 1 and v[("vllm:request_params_n_sum", None)] == 3


def test_a_final_text_cut_inside_a_character_holds_the_partial_character_back(engine):
    """vLLM's rule: output that ends inside a multi-byte character (max_tokens reached between its
    bytes) ends before that character, not with U+FFFD."""
    tok = engine.tokenizer
    ids = tok("ab ✓ ü", add_special_tokens=False)["input_ids"]
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k], skip_special_tokens=True).endswith("\ufffd")]
    assert cuts, "the tokenizer splits no character here: the test needs one that it splits"
    for k in cuts:
        text = TextStream(tok).update(ids[:k], final=True)
        assert text == tok.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd") and not text.endswith("\ufffd")
