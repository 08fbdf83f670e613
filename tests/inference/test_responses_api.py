"""The Responses API subset as a translation to chat completions and back."""

from __future__ import annotations

import pytest

from rlix.errors import InvalidRequestError
from rlix.inference.server.responses_api import from_chat, to_chat


def test_input_items_become_chat_messages():
    body = {"model": "tiny", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "input": [{"role": "developer", "content": "dev note"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+"},
                                                                      {"type": "input_text", "text": "3?"}]},
                      {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                      {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "5"},
                      {"type": "function_call_output", "call_id": "c2", "output": "6"}]}
    chat = to_chat(body)
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5 and chat["model"] == "tiny"
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    assert chat["messages"][2]["content"] == "2+3?"
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "c1", "content": "5"}
    assert to_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_sampling_extras_reach_the_chat_completion_and_stateless_fields_change_nothing():
    """vLLM's extras (sent through the openai client's extra_body) must not be dropped: an
    `ignore_eos` lost here lets a random model stop early."""
    chat = to_chat({"input": "hi", "ignore_eos": True, "seed": 7, "top_k": 5, "stop": ["x"],
                    "repetition_penalty": 1.1, "store": False, "metadata": {"a": "b"},
                    "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_p": None})
    assert {k: chat[k] for k in ("ignore_eos", "seed", "top_k", "stop", "repetition_penalty")} == \
        {"ignore_eos": True, "seed": 7, "top_k": 5, "stop": ["x"], "repetition_penalty": 1.1}
    assert set(chat) == {"messages", "ignore_eos", "seed", "top_k", "stop", "repetition_penalty"}


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "stream": True}, "stream"),
    ({"input": "x", "previous_response_id": "r"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
])
def test_what_is_not_supported_is_refused_by_name(body, param):
    with pytest.raises(InvalidRequestError) as err:
        to_chat(body)
    assert err.value.param == param


def test_a_chat_answer_becomes_output_items():
    chat = {"model": "tiny", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            "choices": [{"finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "adding",
                "tool_calls": [{"id": "call_9", "type": "function",
                                "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    r = from_chat(chat, {"instructions": "be brief"})
    assert r["status"] == "completed" and r["incomplete_details"] is None and r["instructions"] == "be brief"
    msg, call = r["output"]
    assert msg["type"] == "message" and msg["content"][0] == {"type": "output_text", "text": "adding", "annotations": []}
    assert call["type"] == "function_call" and call["call_id"] == "call_9" and call["arguments"] == '{"a": 1}'
    assert r["usage"]["input_tokens"] == 7 and r["usage"]["output_tokens"] == 3
    cut = from_chat({**chat, "choices": [{"finish_reason": "length", "message": {"content": ""}}]}, {})
    assert cut["status"] == "incomplete" and cut["output"] == []
