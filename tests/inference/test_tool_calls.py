"""Hermes-style tool calls: parsed from the model's text into OpenAI `tool_calls`, rendered back
into the prompt by the chat template; malformed calls stay plain content."""

from __future__ import annotations

import json

import pytest

from rlix.errors import InvalidRequestError
from rlix.inference.server import openai_schema as S
from rlix.inference.server.requests import Job
from rlix.inference.server.serving import OpenAIServing
from rlix.inference.server.tool_calls import (ToolChoice, check_tools, forced_call_constraint, parse_tool_calls,
                                              template_messages, tool_choice_of)


def test_parses_calls_and_keeps_the_text_around_them():
    content, calls = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                                      '</tool_call><tool_call>{"name": "mul", "arguments": "{\\"a\\": 4}"}</tool_call>')
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3}), ("mul", {"a": 4})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].as_openai(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                     "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[0] is None  # nothing but a call


@pytest.mark.parametrize("text", [
    "no call at all",
    '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>',  # cut short
    '<tool_call>["add"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": 3}</tool_call>',
    '<tool_call>{"name": "add", "arguments": "{not json"}</tool_call>',
    '<tool_call>{"name": "add"}',  # never closed
])
def test_anything_malformed_is_plain_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_tools_and_tool_choice_are_checked():
    assert check_tools([{"type": "function", "function": {"name": "f"}}], None) is True
    assert check_tools([{"type": "function", "function": {"name": "f"}}], "none") is False
    assert check_tools(None, "auto") is False
    for bad in ([{"type": "function"}], [{"type": "retrieval", "function": {"name": "f"}}], ["f"]):
        with pytest.raises(InvalidRequestError, match=r"tools\[0\]"):
            check_tools(bad, None)
    with pytest.raises(InvalidRequestError, match="constrained decoding"):  # where the output is free
        check_tools([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "f"}})
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tool_choice_of(tools, "required") == ToolChoice(True, "required")
    assert tool_choice_of(tools, {"type": "function", "function": {"name": "f"}}) == ToolChoice(True, "named", "f")
    for bad, param in (({"type": "function", "function": {"name": "g"}}, "tool_choice.function.name"),
                       ("always", "tool_choice")):
        with pytest.raises(InvalidRequestError) as err:
            tool_choice_of(tools, bad)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError, match="`tools` must be set"):
        tool_choice_of(None, "required")


def test_a_forced_call_constraint_is_the_format_the_parser_reads():
    """The structural tag of a forced call accepts exactly the blocks parse_tool_calls reads."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "ping"}}]
    spec = json.loads(forced_call_constraint(tools, ToolChoice(True, "named", "add")).spec)["format"]
    assert [t["begin"] for t in spec["tags"]] == ['<tool_call>\n{"name": "add", "arguments": ']
    assert spec["stop_after_first"] and spec["at_least_one"]
    spec = json.loads(forced_call_constraint(tools, ToolChoice(True, "required")).spec)["format"]
    assert len(spec["tags"]) == 2 and not spec["stop_after_first"]
    assert spec["tags"][1]["content"]["json_schema"] == {"type": "object"}  # no parameters: any object
    one = json.loads(forced_call_constraint(tools, ToolChoice(True, "required"), parallel=False).spec)
    assert one["format"]["stop_after_first"]
    text = spec["tags"][0]["begin"] + '{"a": 3}' + spec["tags"][0]["end"]
    content, calls = parse_tool_calls(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 3})]


def test_template_messages_take_json_text_arguments():
    msgs = [{"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    out = template_messages(msgs)
    assert out[0]["content"] == "" and out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the caller's, untouched
    with pytest.raises(InvalidRequestError, match="not JSON"):
        template_messages([{**msgs[0], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_content_as_a_list_of_text_parts_is_joined_and_other_parts_are_refused():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = template_messages([{"role": "system", "content": [parts[0]]}, {"role": "user", "content": parts}])
    assert [m["content"] for m in out] == ["first", "first\nsecond"]  # joined as vLLM joins them
    with pytest.raises(InvalidRequestError, match="image_url") as err:
        template_messages([{"role": "user", "content": [parts[0], {"type": "image_url", "image_url": {}}]}])
    assert err.value.param == "messages[0].content[1]"


def test_an_answer_with_a_call_is_a_tool_calls_message():
    job = Job(rid="r", prompt_ids=[1], params=None, tools=ToolChoice(True))  # type: ignore[arg-type]
    content, calls, finish = OpenAIServing._tool_calls(job, '<tool_call>{"name": "add", "arguments": {}}</tool_call>',
                                                 "stop")
    assert content is None and finish == "tool_calls" and calls[0].name == "add"
    r = S.chat_response("r", "tiny", [S.chat_choice(0, content, finish, None, None, None,
                                                   tool_calls=[c.as_openai() for c in calls])],
                        None, 3, 9)
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    # forced calls (vLLM's shape): "required" finishes "tool_calls", a named choice keeps "stop";
    # content is "" rather than null; parallel_tool_calls false keeps the first call
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    required = Job(rid="r", prompt_ids=[1], params=None, tools=ToolChoice(True, "required"))  # type: ignore[arg-type]
    assert OpenAIServing._tool_calls(required, two, "stop")[::2] == ("", "tool_calls")
    assert OpenAIServing._tool_calls(required, two, "length")[2] == "length"
    named = Job(rid="r", prompt_ids=[1], params=None, tools=ToolChoice(True, "named", "a"),  # type: ignore[arg-type]
                parallel_tool_calls=False)
    content, calls, finish = OpenAIServing._tool_calls(named, two, "stop")
    assert (content, [c.name for c in calls], finish) == ("", ["a"], "stop")
    assert r["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"}
    # cut short by max_tokens: the reason stays "length"; without tools nothing is parsed
    assert OpenAIServing._tool_calls(job, '<tool_call>{"name": "add"}</tool_call>', "length")[2] == "length"
    plain = Job(rid="r", prompt_ids=[1], params=None)  # type: ignore[arg-type]
    assert OpenAIServing._tool_calls(plain, '<tool_call>{"name": "add"}</tool_call>', "stop")[1] == []
