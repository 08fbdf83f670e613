"""Acceptance: the official `openai` client, pointed at the router, gets completions and chat
completions, plain and streamed, from the tiny model served by two shard processes."""

from __future__ import annotations

import openai
import pytest

from kit import router_process, shard_processes


@pytest.fixture(scope="module")
def oai(tiny_model_dir):
    with shard_processes(tiny_model_dir, 2) as procs:
        with router_process({i: p.url for i, p in enumerate(procs)}) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused-by-the-router", max_retries=0)
            yield client
            client.close()


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
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=[ADD], tool_choice="required")
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
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="input\\[0\\]"):
        oai.responses.create(model="tiny", input=[{"type": "reasoning", "summary": []}])
