"""Acceptance: the official `openai` client, pointed at the router, gets completions and chat
completions, plain and streamed, from the tiny model served by two shard processes; and the
OpenAI surface (issue 20: n, top_logprobs, content parts, penalties, logit_bias, echo, refusal of
what is not supported) works the same against one engine server directly and through the router."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
import openai
import pytest

from kit import KEY, router_process, shard_processes


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    """{"router": a client of the router over two shards, "shard": a client of shard 0 itself}."""
    with shard_processes(tiny_model_dir, 2) as procs:
        with router_process({i: p.url for i, p in enumerate(procs)}) as url:
            clients = {"router": openai.OpenAI(base_url=url + "/v1", api_key="unused-by-the-router",
                                               max_retries=0),
                       "shard": openai.OpenAI(base_url=procs[0].url + "/v1", api_key=KEY, max_retries=0)}
            yield clients
            for client in clients.values():
                client.close()


@pytest.fixture(scope="module")
def oai(stack):
    return stack["router"]


@pytest.fixture(params=["shard", "router"])
def via(request, stack):
    """The same test against the engine server and through the router."""
    return stack[request.param]


def test_completion(oai):
    r = oai.completions.create(model="tiny", prompt="Once upon", max_tokens=7,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0


def test_completion_stream(oai):
    chunks = list(oai.completions.create(model="tiny", prompt="Once upon", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_chat(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.usage.completion_tokens == 5


def test_chat_stream(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    greedy = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    assert greedy == plain.choices[0].message.content and isinstance(text, str)


def test_models_and_errors_pass_through(oai):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oai.completions.create(model="tiny", prompt="x", max_tokens=0)


ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                        "parameters": {"type": "object",
                                                       "properties": {"a": {"type": "number"},
                                                                      "b": {"type": "number"}}}}}
TOOL_TURNS = [{"role": "user", "content": "2+3?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


def test_chat_with_tools_through_the_router(oai):
    """Tools are rendered into the prompt, a multi-turn tool conversation is accepted, and the
    answer is an OpenAI message (the random model writes no call: plain content)."""
    plain = oai.chat.completions.create(model="tiny", messages=TOOL_TURNS[:1], max_tokens=4,
                                        extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=[ADD], max_tokens=4,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls in (None, [])
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool list and the turns
    chunks = list(oai.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=[ADD], max_tokens=4,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # a tool that was not declared
        oai.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=[ADD],
                                    tool_choice={"type": "function", "function": {"name": "mul"}})
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        oai.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=[{"type": "function"}])


def test_responses_create_through_the_router(oai):
    """The Responses API subset: a string input; then a conversation with instructions, a
    function call and its output, and a function tool."""
    r = oai.responses.create(model="tiny", input="Once upon", max_output_tokens=5,
                             extra_body={"ignore_eos": True})
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert isinstance(r.output_text, str) and r.usage.output_tokens == 5 and r.usage.input_tokens > 0
    tool = {"type": "function", "name": "add", "description": "add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}
    turns = [{"role": "user", "content": "2+3?"},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    r2 = oai.responses.create(model="tiny", instructions="be brief", input=turns, tools=[tool],
                              max_output_tokens=4, extra_body={"ignore_eos": True})
    assert r2.usage.input_tokens > r.usage.input_tokens + 20 and r2.usage.output_tokens == 4
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="input\\[0\\]"):
        oai.responses.create(model="tiny", input=[{"type": "reasoning", "encrypted_content": "gAAA"}])


def test_responses_streamed_and_continued(via):
    """Streaming and previous_response_id on the engine server and through the router (whose
    own store continues a conversation on whichever shard it picks)."""
    kw = dict(model="tiny", input="Once upon", max_output_tokens=6, temperature=1.0,
              extra_body={"seed": 3, "ignore_eos": True})
    plain = via.responses.create(**kw)
    events = list(via.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == plain.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    nxt = via.responses.create(model="tiny", input="next", previous_response_id=events[-1].response.id,
                               max_output_tokens=2, extra_body={"ignore_eos": True})
    assert nxt.usage.input_tokens > plain.usage.input_tokens + plain.usage.output_tokens
    assert via.responses.retrieve(nxt.id).id == nxt.id


# ------------------------------------------------------------------ the OpenAI surface (issue 20)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "user", "content": "Tell me a story"}]


def _by_index(chunks) -> dict[int, dict]:
    """Streamed chunks -> {index: {"text", "finish", "logprobs" (items), "ids"}}."""
    out: dict[int, dict] = defaultdict(lambda: {"text": "", "finish": None, "logprobs": [], "ids": []})
    for c in chunks:
        for ch in c.choices:
            o = out[ch.index]
            delta = getattr(ch, "delta", None)
            o["text"] += (delta.content or "") if delta is not None else ch.text
            o["finish"] = ch.finish_reason or o["finish"]
            lp = ch.logprobs
            if lp is not None:
                o["logprobs"] += lp.content if delta is not None else list(zip(lp.tokens, lp.token_logprobs,
                                                                                lp.top_logprobs))
            o["ids"] += (ch.model_extra or {}).get("token_ids") or []
    return dict(out)


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_of_one_prompt(via, stream):
    """A GRPO group: n=8 samples of one prompt at temperature 1 come back as 8 distinct choices."""
    kw = dict(model="tiny", max_tokens=8, n=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    if not stream:
        r = via.completions.create(prompt="Once upon", **kw)
        assert sorted(c.index for c in r.choices) == list(range(8))
        assert len({c.text for c in r.choices}) == 8 and r.usage.completion_tokens == 64
        chat = via.chat.completions.create(messages=CHAT, **kw)
        assert len({c.message.content for c in chat.choices}) == 8 and chat.usage.completion_tokens == 64
        assert [c.index for c in chat.choices] == list(range(8))
        # seeded: sample i is the request with seed + i, the same again
        again = via.completions.create(prompt="Once upon", **kw)
        assert [c.text for c in again.choices] == [c.text for c in r.choices]
        return
    chunks = list(via.completions.create(prompt="Once upon", stream=True, stream_options={"include_usage": True},
                                         **kw))
    got = _by_index(chunks)
    assert sorted(got) == list(range(8)) and all(o["finish"] == "length" for o in got.values())
    assert len({o["text"] for o in got.values()}) == 8 and chunks[-1].usage.completion_tokens == 64
    plain = via.completions.create(prompt="Once upon", **kw)
    assert [got[i]["text"] for i in range(8)] == [c.text for c in plain.choices]  # same seeds, same samples
    chat = _by_index(via.chat.completions.create(messages=CHAT, stream=True, **kw))
    assert sorted(chat) == list(range(8)) and len({o["text"] for o in chat.values()}) == 8


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_are_the_real_alternatives(via, stream):
    kw = dict(model="tiny", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=5, **GREEDY)
    if stream:
        items = _by_index(via.chat.completions.create(stream=True, **kw))[0]["logprobs"]
    else:
        items = via.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(items) == 6
    for item in items:
        alts = item.top_logprobs
        values = [a.logprob for a in alts]
        assert len(alts) == 5 and values == sorted(values, reverse=True) and len(set(values)) == 5
        # greedy: the sampled token is the most likely one
        assert alts[0].token == item.token and alts[0].logprob == pytest.approx(item.logprob)
    ids = via.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                              "return_tokens_as_token_ids": True}})
    for item in ids.choices[0].logprobs.content:
        assert len({a.token for a in item.top_logprobs}) == 5 and item.token.startswith("token_id:")
    # completions: `logprobs` alternatives and the sampled token
    ckw = dict(model="tiny", prompt="Once upon", max_tokens=4, logprobs=3, temperature=1.0, seed=2,
               extra_body={"ignore_eos": True})
    if stream:
        rows = _by_index(via.completions.create(stream=True, **ckw))[0]["logprobs"]
    else:
        lp = via.completions.create(**ckw).choices[0].logprobs
        rows = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert len(rows) == 4
    for token, value, top in rows:
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(value)
    for bad in (dict(top_logprobs=21), dict(top_logprobs=2, logprobs=False)):
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            via.chat.completions.create(**{**kw, **bad}, stream=stream)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        via.completions.create(**{**ckw, "logprobs": 21}, stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_content_as_a_list_of_text_parts(via, stream):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]}]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me\na story"}]

    def text(messages):
        r = via.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=stream, **GREEDY)
        return _by_index(r)[0]["text"] if stream else r.choices[0].message.content

    assert text(parts) == text(joined)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.content\[1\]") as err:
        text([parts[0], {"role": "user", "content": [parts[1]["content"][0], image]}])
    assert err.value.body["param"] == "messages[1].content[1]"


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_and_penalties(via, stream):
    def ids(**kw):
        body = dict(model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=stream,
                    extra_body={"ignore_eos": True, "return_token_ids": True, **kw.pop("extra", {})}, **kw)
        r = via.completions.create(**body)
        return _by_index(r)[0]["ids"] if stream else r.choices[0].model_extra["token_ids"]

    assert ids(logit_bias={"42": 100}) == [42] * 8  # +100 forces it (greedy)
    plain, biased = ids(), ids(logit_bias={"42": 4})
    assert biased.count(42) > plain.count(42)
    # each repeat costs 2: the bias of +4 no longer holds the token in place
    assert ids(logit_bias={"42": 4}, frequency_penalty=2.0).count(42) < biased.count(42)
    assert ids(logit_bias={"42": 4}, presence_penalty=2.0).count(42) < biased.count(42)
    assert ids(logit_bias={"42": 4}, extra={"repetition_penalty": 100.0}).count(42) < biased.count(42)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        ids(presence_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        ids(logit_bias={"42": 101})


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo(via, stream):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=5, echo=True, logprobs=2, stream=stream,
              **GREEDY)
    plain = via.completions.create(**{**kw, "echo": False, "stream": False}).choices[0]
    if stream:
        got = _by_index(via.completions.create(**kw))[0]
        text, rows = got["text"], got["logprobs"]
    else:
        choice = via.completions.create(**kw).choices[0]
        text = choice.text
        rows = list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs))
    assert text == "Once upon a time" + plain.text
    n_prompt = via.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1).usage.prompt_tokens
    assert len(rows) == n_prompt + 5
    assert rows[0][1] is None and rows[0][2] is None  # nothing precedes the first prompt token
    assert all(v is not None and v <= 0 and 2 <= len(top) <= 3 for _, v, top in rows[1:])
    assert [v for _, v, _ in rows[n_prompt:]] == pytest.approx(plain.logprobs.token_logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_unsupported_fields_are_refused_naming_them(via, stream):
    chat = dict(model="tiny", messages=CHAT, max_tokens=2, stream=stream)
    for kw, param in ((dict(response_format={"type": "xml"}), "response_format.type"),
                      (dict(extra_body={"frobnicate": True}), "frobnicate"),
                      (dict(extra_body={"min_tokens": 3}), "min_tokens"),  # above max_tokens
                      (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs.regex")):
        with pytest.raises(openai.BadRequestError) as err:
            via.chat.completions.create(**chat, **kw)
        assert err.value.body["param"] == param and param in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        via.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=2, stream=stream)
    assert err.value.body["param"] == "suffix"
    # what clients send that changes nothing here passes (parallel_tool_calls: false is honoured:
    # test_responses_clients.py)
    r = via.chat.completions.create(**chat, user="me", store=False, response_format={"type": "text"},
                                    metadata={"run": "1"}, parallel_tool_calls=False)
    assert (_by_index(r)[0]["finish"] if stream else r.choices[0].finish_reason) in ("length", "stop")


def test_a_group_of_eight_shares_one_prefill(engine):
    """The GRPO group through the official client against an in-process engine server: the
    prompt's tokens go through the model once for all eight samples."""
    from rlix.inference.server.app import create_app

    async def main():
        app = create_app(engine, engine.tokenizer, "tiny", KEY)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
        client = openai.AsyncOpenAI(base_url="http://engine/v1", api_key=KEY, http_client=http, max_retries=0)
        before, hits = engine.prefill_tokens, engine.prefix_hit_tokens
        r = await client.chat.completions.create(model="tiny", messages=CHAT, n=8, max_tokens=6,
                                                 temperature=1.0, extra_body={"ignore_eos": True})
        shared = engine.prefill_tokens - before
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=CHAT, n=8, max_tokens=6, temperature=1.0, stream=True,
            extra_body={"ignore_eos": True})]
        await client.close()
        return r, shared, engine.prefill_tokens - before - shared, engine.prefix_hit_tokens - hits, chunks

    r, first, second, cached, chunks = asyncio.run(main())
    assert len(r.choices) == 8 and len({c.message.content for c in r.choices}) == 8
    assert first == r.usage.prompt_tokens  # one prefill per request of 8 samples
    # the same prompt again: all but its last token from the prefix cache, then one prefill
    assert (second, cached) == (1, r.usage.prompt_tokens - 1)
    assert sorted(_by_index(chunks)) == list(range(8))
