"""vLLM's request fields that rlix's server once refused, over HTTP on every available backend:
`min_tokens`, `include_stop_str_in_output`, `stream_options.continuous_usage_stats`, a list of
prompts on /v1/completions. Each test derives what it expects from the same server's plain
greedy answer (and the tokenizer), so the one test states vLLM's meaning and runs against vLLM
0.32's CPU server (`-m vllm`) and rlix's `rlix serve` alike."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kit import sse_events

CHAT = [{"role": "user", "content": "hi"}]
CHAT_USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "completion_tokens_details"]
COMPLETION_USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens"]
GENERATE_USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                       "completion_tokens_details"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def eos_ids(tiny_model_dir, tok) -> set[int]:
    """Every end-of-sequence id vLLM masks for min_tokens: the tokenizer's and the generation
    config's (rlix's engine takes the same two sources)."""
    import json
    config = json.loads((tiny_model_dir / "generation_config.json").read_text())
    ids = config["eos_token_id"]
    return {tok.eos_token_id, *(ids if isinstance(ids, list) else [ids])}


def _tokens(path: str, answer: dict) -> list[list[int]]:
    return [c["token_ids"] for c in answer["choices"]]


def _request(path: str, **sampling) -> dict:
    if path == "/inference/v1/generate":
        return {"token_ids": [262, 78, 78, 81], "sampling_params": sampling}
    body = {"model": "tiny", **sampling, "return_token_ids": True}
    if path == "/v1/completions":
        return {**body, "prompt": "hello"}
    return {**body, "messages": CHAT}


# ---------------------------------------------------------------- min_tokens
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_min_tokens_masks_end_of_sequence(served, path, eos_ids):
    """With a +100 bias on EOS every sample ends at its first token; with min_tokens=6 none can
    end (EOS masked) before its 6th, and each ends at the 7th, on EOS (ignore_eos false)."""
    eos = min(eos_ids)
    sampling = {"max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 3, "logit_bias": {str(eos): 100}}
    free = served.http.post(path, json=_request(path, **sampling)).json()
    assert [len(t) for t in _tokens(path, free)] == [1, 1, 1]
    held = served.http.post(path, json=_request(path, **sampling, min_tokens=6)).json()
    for ids, choice in zip(_tokens(path, held), held["choices"]):
        assert len(ids) == 7 and ids[-1] == eos and choice["finish_reason"] == "stop", ids
        assert not eos_ids & set(ids[:6])


@pytest.mark.parametrize("path", ["/v1/completions", "/inference/v1/generate"])
def test_min_tokens_masks_stop_token_ids(served, path, eos_ids):
    stop = 50
    sampling = {"max_tokens": 20, "temperature": 0, "stop_token_ids": [stop], "logit_bias": {str(stop): 100}}
    assert [len(t) for t in _tokens(path, served.http.post(path, json=_request(path, **sampling)).json())] == [1]
    held = served.http.post(path, json=_request(path, **sampling, min_tokens=4)).json()
    ids, choice = _tokens(path, held)[0], held["choices"][0]
    assert len(ids) == 5 and ids[-1] == stop and choice["stop_reason"] == stop
    assert stop not in ids[:4] and not eos_ids & set(ids[:4])


def test_min_tokens_defers_stop_strings(served, tok):
    """A stop string counts only once the output is longer than min_tokens, and only where it
    ends past the text of those first tokens (vLLM's rule): an occurrence inside them is text."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = served.http.post("/v1/completions", json=body).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    stop, k = _repeated_word(tok, ids, text)
    floor = len(tok.decode(ids[:k + 2]))
    later = text.find(stop, floor - len(stop) + 1)
    assert 0 <= text.find(stop) < later  # it occurs in the first k + 2 tokens' text, and after
    cut = served.http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[:text.find(stop)]
    held = served.http.post("/v1/completions", json={**body, "stop": [stop], "min_tokens": k + 2}).json()
    choice = held["choices"][0]
    assert choice["text"] == text[:later] and choice["stop_reason"] == stop, (stop, k)


def _repeated_word(tok, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string to test with: a word-like token's text that occurs again in `text` after the
    next two tokens, and the index of the token that first produces it."""
    for k, t in enumerate(ids):
        piece = tok.decode([t])
        if len(piece.strip()) >= 2 and piece.strip().isalpha() and text.find(piece) >= 0:
            if text.find(piece, len(tok.decode(ids[:k + 2]))) > 0 and piece in tok.decode(ids[:k + 1]):
                return piece, k
    raise AssertionError(f"no repeated word in {text!r}")


# ---------------------------------------------------------------- include_stop_str_in_output
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_stop_str_in_output_keeps_the_stop_string(served, path, tok):
    body = {**_request(path, max_tokens=40, temperature=0, ignore_eos=True)}
    if path == "/v1/completions":
        body["prompt"] = "abc"
    full = served.http.post(path, json=body).json()["choices"][0]
    text = full.get("text", (full.get("message") or {}).get("content"))
    stop, _ = _repeated_word(tok, full["token_ids"], text)
    pos = text.find(stop)
    for include, want in ((False, text[:pos]), (True, text[:pos + len(stop)])):
        sent = {**body, "stop": [stop], "include_stop_str_in_output": include}
        answer = served.http.post(path, json=sent).json()["choices"][0]
        got = answer.get("text", (answer.get("message") or {}).get("content"))
        assert got == want and answer["finish_reason"] == "stop" and answer["stop_reason"] == stop
        chunks = sse_events(served.http.post(path, json={**sent, "stream": True}).text)
        streamed = "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", ""))
                           for c in chunks if c["choices"])
        assert streamed == want, include


def test_a_stop_token_ids_text_is_left_out_unless_included(served, tok):
    """A stop token id ends the output; its text is not part of it, unless
    include_stop_str_in_output (its id stays in token_ids either way)."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    ids = served.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    # (a token after whole characters: text cut inside one is a difference of its own, issue 41)
    k = next(k for k, t in enumerate(ids) if k >= 3 and tok.decode([t]).strip().isalpha()
             and t not in ids[:k] and not tok.decode(ids[:k]).endswith("\ufffd"))
    for include in (False, True):
        answer = served.http.post("/v1/completions", json={**body, "stop_token_ids": [ids[k]],
                                                           "include_stop_str_in_output": include}).json()
        choice = answer["choices"][0]
        assert choice["token_ids"] == ids[:k + 1] and choice["stop_reason"] == ids[k]
        assert choice["text"] == tok.decode(ids[:k + 1] if include else ids[:k])


# ---------------------------------------------------------------- continuous_usage_stats
@pytest.mark.parametrize("path,keys", [("/v1/completions", COMPLETION_USAGE_KEYS),
                                       ("/v1/chat/completions", CHAT_USAGE_KEYS),
                                       ("/inference/v1/generate", GENERATE_USAGE_KEYS)])
def test_continuous_usage_stats_on_every_chunk(served, path, keys):
    """Every chunk carries usage in vLLM's shape for its endpoint: the prompt's tokens and that
    choice's tokens so far; the final usage chunk still sums every choice."""
    body = {**_request(path, max_tokens=5, temperature=1.0, seed=2, n=2, ignore_eos=True),
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_events(served.http.post(path, json=body).text)
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 10
    so_far = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        usage, choice = chunk["usage"], chunk["choices"][0]
        so_far[choice["index"]] += len(choice.get("token_ids") or [])
        assert list(usage) == keys, usage
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        assert usage["completion_tokens"] == so_far[choice["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    quiet = {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert all(c.get("usage") is None for c in sse_events(served.http.post(path, json=quiet).text))


# ---------------------------------------------------------------- a list of prompts
def test_a_list_of_prompts_answers_n_choices_each(served, tok):
    """Choices numbered prompt by prompt (n each), each with its own prompt's ids; usage sums
    every prompt once and every choice's tokens; streamed the same way."""
    prompts = ["hello", "Once upon a time"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "return_token_ids": True}
    answer = served.http.post("/v1/completions", json=body).json()
    wanted = [tok(p)["input_ids"] for p in prompts]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in answer["choices"]] == [wanted[0]] * 2 + [wanted[1]] * 2
    assert answer["usage"]["prompt_tokens"] == len(wanted[0]) + len(wanted[1])
    assert answer["usage"]["completion_tokens"] == 16
    chunks = sse_events(served.http.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text)
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]
    firsts = {}
    for c in chunks:
        if c["choices"] and c["choices"][0]["prompt_token_ids"] is not None:
            firsts.setdefault(c["choices"][0]["index"], c["choices"][0]["prompt_token_ids"])
    assert firsts == {0: wanted[0], 1: wanted[0], 2: wanted[1], 3: wanted[1]}
    assert chunks[-1]["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert len({c["id"] for c in chunks}) == 1


def test_a_list_of_token_prompts_answers_each_as_alone(served):
    """Greedy, so each choice is what its prompt alone answers."""
    prompts = [[262, 78, 78, 81], [319, 69], [5, 6, 7]]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [served.http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
             for p in prompts]
    together = served.http.post("/v1/completions", json={**body, "prompt": prompts}).json()
    assert [c["text"] for c in together["choices"]] == alone
    assert together["usage"]["prompt_tokens"] == 9 and together["usage"]["completion_tokens"] == 18


# ---------------------------------------------------------------- structured outputs (issue 41)
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                  "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["answer", "n"], "additionalProperties": False}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_json_schema_is_honoured(served, path):
    """Both servers answer 200, and JSON valid against the schema wherever the output stopped.
    rlix caps runs of whitespace between JSON tokens (docs/INFERENCE_SERVING.md), so the random
    model's output always ends within max_tokens there; vLLM lets it write whitespace until cut."""
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    r = served.http.post(path, json=_request(path, max_tokens=200, temperature=1.0, seed=3, n=4,
                                             response_format=fmt))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" or (served.backend == "vllm" and choice["finish_reason"] == "length")
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


def test_structured_outputs_choice_and_regex(served):
    choices = ["alpha", "beta"]
    r = served.http.post("/v1/completions", json=_request("/v1/completions", max_tokens=20, n=6, seed=1,
                                                          structured_outputs={"choice": choices}))
    assert r.status_code == 200 and all(c["text"] in choices for c in r.json()["choices"]), r.text
    r = served.http.post("/v1/chat/completions", json=_request(
        "/v1/chat/completions", max_tokens=20, seed=1, structured_outputs={"regex": "[0-9]{4}"}))
    content = r.json()["choices"][0]["message"]["content"]
    assert r.status_code == 200 and len(content) == 4 and content.isdigit(), r.text


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": "(ab"}},
    {"structured_outputs": {"json": "{not json"}},
    {"response_format": {"type": "json_schema"}},
])
def test_a_bad_constraint_is_a_400_on_both(served, extra):
    r = served.http.post("/v1/chat/completions", json=_request("/v1/chat/completions", max_tokens=5, **extra))
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


# ---------------------------------------------------------------- prompt_logprobs
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_prompt_logprobs_are_the_models_own(served, path, tiny_model_dir):
    """Each prompt token's logprob (the first: null) and the 2 best alternatives, in vLLM's
    shape, where vLLM puts them (a completion choice's, the chat or generate response's), equal
    to the checkpoint's own log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    answer = served.http.post(path, json=_request(path, max_tokens=1, prompt_logprobs=2)).json()
    entries = answer["choices"][0]["prompt_logprobs"] if path == "/v1/completions" else answer["prompt_logprobs"]
    ids = [262, 78, 78, 81] if path == "/inference/v1/generate" else (
        answer["choices"][0]["prompt_token_ids"] if path == "/v1/completions" else answer["prompt_token_ids"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    # vLLM computes the tiny model in bfloat16 on its CPU (up to ~1% off float32); rlix runs float32
    rel, tol = (1e-2, 5e-2) if served.backend == "vllm" else (0.0, 2e-3)
    assert len(entries) == len(ids) and entries[0] is None
    for j, entry in enumerate(entries[1:], 1):
        row, token = raw[j - 1], ids[j]
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        # the 2 alternatives: ranked 1 and 2 in their own logprobs' order, and the model's 2 best
        # (to the precision below: bfloat16 may swap near ties)
        alts = sorted((v["rank"], int(t), v["logprob"]) for t, v in entry.items() if v["rank"] in (1, 2))
        assert [a[0] for a in alts] == [1, 2] and alts[0][2] >= alts[1][2], (j, entry)
        assert set(entry) == {str(token), *(str(a[1]) for a in alts)}, (j, entry)
        second = float(row.topk(2).values[1])
        for _, tid, _ in alts:
            assert float(row[tid]) >= second - max(tol, rel * abs(second)), (j, entry)
        value = float(row[token])
        within = max(tol, rel * abs(value))
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=within)
        mine = entry[str(token)]["rank"]
        # vLLM ranks the prompt's token over the vocabulary; rlix where it is among the 2 computed
        if served.backend == "vllm" or mine is not None:  # its vocabulary rank, to that precision
            lowest, highest = (1 + int((row > value + d).sum()) for d in (within, -within))
            assert lowest <= mine <= highest, (j, entry, lowest, highest)
        else:
            assert str(token) not in {str(a[1]) for a in alts}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_in_a_stream_is_a_400_on_both(served, path):
    answer = served.http.post(path, json=_request(path, max_tokens=1, prompt_logprobs=1, stream=True))
    assert answer.status_code == 400, answer.text


# ---------------------------------------------------------------- required_prefix_token_ids
def test_required_prefix_token_ids_on_chat(served, tok):
    """NeMo Gym's field: rlix starts the prompt with exactly these ids; stock vLLM ignores the
    field (NeMo RL's server patches it in), so there both answers are 200 with the same keys and
    only rlix's prompt is the spliced one (a difference listed in docs/INFERENCE_SERVING.md)."""
    first = served.http.post("/v1/chat/completions", json=_request("/v1/chat/completions", max_tokens=3,
                                                                   temperature=0)).json()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # the turn as sampled character by character: not how the template re-tokenizes its text
    text = "hello there"
    turn = [tok.convert_tokens_to_ids(tok.tokenize(ch)[0]) for ch in text] + [end]
    prefix = first["prompt_token_ids"] + turn
    messages = [*CHAT, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "return_token_ids": True,
            "required_prefix_token_ids": prefix}
    answer = served.http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    plain = served.http.post("/v1/chat/completions", json={k: v for k, v in body.items()
                                                           if k != "required_prefix_token_ids"}).json()
    assert list(answer.json()) == list(plain)
    got = answer.json()["prompt_token_ids"]
    if served.backend == "vllm":
        assert got == plain["prompt_token_ids"]  # ignored
    else:
        assert got[: len(prefix)] == prefix and got != plain["prompt_token_ids"]
