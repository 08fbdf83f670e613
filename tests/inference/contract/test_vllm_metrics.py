"""rlix's engine server beside vLLM 0.32's CPU server, both serving the `tiny` model and given
the same requests: every vLLM family on /metrics is on rlix's with vLLM's type, label names,
enumerated label values and histogram buckets, and the families that count the same things
(requests, samples, tokens, phases) moved by the same amounts; logprob token strings of byte
tokens and the chat message's keys are vLLM's.

Both servers run at once (one module fixture), so this file costs one vLLM start-up."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kit import need_vllm, sse_events
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess

pytestmark = pytest.mark.vllm

KEY = "contract-token"
#: labels whose values are a fixed set in vLLM (compared as sets); the others name the server
#: (engine, model_name), a bucket (le, compared on its own) or a configuration (cache_config_info:
#: rlix's KV cache is not vLLM's, so its values differ by design; the label names must not)
ENUMERATED = ("finished_reason", "reason", "source", "sleep_state")
#: label values that differ by design: none. (Left here, empty, so a future exception is named.)
EXCEPTIONS: dict[str, str] = {}


@dataclass
class Pair:
    rlix: httpx.Client
    vllm: httpx.Client

    def both(self, method: str, path: str, **kw) -> tuple[httpx.Response, httpx.Response]:
        return self.rlix.request(method, path, **kw), self.vllm.request(method, path, **kw)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    need_vllm()
    procs = []
    clients = []
    try:
        for backend in ("embedded", "vllm"):
            cfg = EngineBackendConfig(backend=backend, model=str(tiny_model_dir), served_model_name="tiny",
                                      max_model_len=2048, max_num_seqs=16, startup_timeout_s=600)
            proc = ShardProcess(make_backend(cfg), KEY)
            procs.append(proc)
            proc.start()
            proc.wait_ready()
            clients.append(httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {KEY}"},
                                        timeout=120))
        yield Pair(*clients)
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            proc.stop()


def _families(text: str) -> dict:
    """vLLM's families by name; prometheus_client's `_created` timestamps left out (they are
    the client library's, written beside its own counters and histograms, not vLLM's families)."""
    return {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("vllm:") and not f.name.endswith("_created")}


def _values(fams: dict) -> dict[tuple, float]:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))):
            s.value for f in fams.values() for s in f.samples}


def _label_names(family) -> set[str]:
    return {k for s in family.samples for k in s.labels}


def _label_values(family, label: str) -> set[str]:
    return {s.labels[label] for s in family.samples if label in s.labels}


def _buckets(family) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]


def test_every_vllm_family_is_on_rlixs_page_and_counts_the_same(pair):
    before = [_values(_families(c.get("/metrics").text)) for c in (pair.rlix, pair.vllm)]
    sample = {"temperature": 1.0, "seed": 1, "ignore_eos": True}  # vLLM refuses n > 1 greedy
    for n in (1, 2):
        for r in pair.both("POST", "/v1/completions",
                           json={"model": "tiny", "prompt": "hello there", "max_tokens": 5, "n": n, **sample}):
            assert r.status_code == 200, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **sample}
    for body in (chat, {**chat, "stream": True}):
        for r in pair.both("POST", "/v1/chat/completions", json=body):
            assert r.status_code == 200, r.text
    rlix_page, vllm_page = (_families(c.get("/metrics").text) for c in (pair.rlix, pair.vllm))

    assert len(vllm_page) >= 39  # vLLM 0.32's engine families on a default CPU server
    missing = sorted(set(vllm_page) - set(rlix_page) - set(EXCEPTIONS))
    assert not missing, f"vLLM families not on rlix's /metrics: {missing}"
    for name, theirs in vllm_page.items():
        ours = rlix_page[name]
        assert ours.type == theirs.type, (name, ours.type, theirs.type)
        assert _label_names(ours) == _label_names(theirs), name
        for label in ENUMERATED:
            assert _label_values(ours, label) == _label_values(theirs, label), (name, label)
        assert _label_values(ours, "model_name") == _label_values(theirs, "model_name") <= {"tiny"}
        if theirs.type == "histogram":
            assert _buckets(ours) == _buckets(theirs), name

    # what both counted: requests and samples, tokens, one phase observation per sample, a
    # latency per token after each sample's first; no preemption
    moved = []
    for page, start in zip((rlix_page, vllm_page), before):
        now = _values(page)
        moved.append({k: now[k] - start.get(k, 0.0) for k in now})
    ours, theirs = moved
    same = [("vllm:request_success_total", (("finished_reason", "length"),)),
            ("vllm:generation_tokens_total", ()), ("vllm:prompt_tokens_total", ()),
            ("vllm:request_params_n_count", ()), ("vllm:request_params_n_sum", ()),
            ("vllm:request_params_max_tokens_count", ()), ("vllm:request_params_max_tokens_sum", ()),
            ("vllm:request_max_num_generation_tokens_sum", ()),
            ("vllm:request_prompt_tokens_sum", ()), ("vllm:request_generation_tokens_sum", ()),
            ("vllm:inter_token_latency_seconds_count", ()), ("vllm:time_to_first_token_seconds_count", ()),
            ("vllm:request_num_preemptions_count", ()), ("vllm:request_num_preemptions_sum", ()),
            ("vllm:num_preemptions_total", ())]
    same += [(f"vllm:request_{phase}_time_seconds_count", ()) for phase in ("queue", "prefill", "decode", "inference")]
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert ours[("vllm:request_params_n_sum", ())] == 5  # the requests were counted at all


# a prompt whose characters take two to four byte tokens each in the tiny tokenizer
BYTES_PROMPT = "日b héllo €🙂x"


def test_echoed_prompt_tokens_of_multi_byte_characters_read_as_vllms(pair):
    """Each prompt token's string (a byte token's: "" until the token completing its character,
    which carries the whole of it) is vLLM's; rlix's token_text.py."""
    body = {"model": "tiny", "prompt": BYTES_PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0}
    answers = [r.json() for r in pair.both("POST", "/v1/completions", json=body)]
    n_prompt = answers[0]["usage"]["prompt_tokens"]
    ours, theirs = (a["choices"][0]["logprobs"]["tokens"][:n_prompt] for a in answers)
    assert ours == theirs
    # byte tokens were there. The first token has no logprob: decoded alone (U+FFFD); the
    # others read against the prompt tokens with logprobs before them, which leaves the first
    # out, so "日" is never completed, "€" is
    assert ours[:3] == ["\ufffd", "", ""] and "€" in ours


def test_sampled_byte_tokens_read_as_vllms_whole_and_streamed(pair):
    """Output held to byte tokens (a large bias on three of them): each token's string and
    bytes, the sampled tokens before it read as its context, whole and chunk by chunk."""
    bias = {"161": 100, "227": 100, "108": 100}  # the three bytes of "€"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "logit_bias": bias}
    whole = [[(c["token"], c["bytes"]) for c in r.json()["choices"][0]["logprobs"]["content"]]
             for r in pair.both("POST", "/v1/chat/completions", json=body)]
    assert whole[0] == whole[1] and len(whole[0]) == 9
    streamed = []
    for r in pair.both("POST", "/v1/chat/completions", json={**body, "stream": True}):
        streamed.append([(c["token"], c["bytes"]) for e in sse_events(r.text) for ch in e["choices"]
                         if ch.get("logprobs") for c in ch["logprobs"]["content"]])
    assert streamed[0] == streamed[1] == whole[0]


def test_chat_message_keys_are_vllms_without_a_tool_call(pair):
    """No `tool_calls` key where no tool was called (vLLM drops an empty list), tools or not."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for body in (chat, {**chat, "tools": tools, "tool_choice": "none"}):
        ours, theirs = (r.json()["choices"][0]["message"] for r in pair.both("POST", "/v1/chat/completions",
                                                                             json=body))
        assert list(ours) == list(theirs) and "tool_calls" not in ours
