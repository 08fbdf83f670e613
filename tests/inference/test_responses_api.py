"""The Responses API without a model: the request read into a chat completion, the answer turned
into output items, the streamed events re-told from a chat stream, the bounded store, and the
service's rules (previous_response_id, store: false, truncation: "auto") over a fake backend."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlix.errors import InvalidRequestError, ResponseNotFoundError, UpstreamAnswerError
from rlix.inference.server import responses_api as R
from rlix.inference.server.responses_service import ResponsesService
from rlix.inference.server.responses_store import ResponseStore, StoredResponse, StoreLimits
from rlix.inference.server.responses_stream import ResponseEvents

from kit import responses_events


def test_input_items_become_chat_messages():
    body = {"model": "tiny", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5,
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
            "input": [{"role": "developer", "content": "dev note"},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+"},
                                                                      {"type": "input_text", "text": "3?"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [],
                       "content": [{"type": "reasoning_text", "text": "add them"}]},
                      {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
                      {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "5"},
                      {"type": "function_call_output", "call_id": "c2", "output": "6"},
                      {"type": "reasoning", "summary": [{"type": "summary_text", "text": "summed"}]},
                      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                       "content": [{"type": "output_text", "text": "11", "annotations": []}]}]}
    turn = R.parse(body)
    chat = turn.chat
    assert chat["max_tokens"] == 9 and chat["temperature"] == 0.5 and chat["model"] == "tiny"
    assert chat["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool", "assistant"]
    assert chat["messages"][2]["content"] == "2+3?"
    turn1 = chat["messages"][3]  # reasoning, then two calls: one assistant turn, as vLLM joins them
    assert turn1["reasoning"] == turn1["reasoning_content"] == "add them"
    assert [c["id"] for c in turn1["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "c1", "content": "5"}
    last = chat["messages"][6]  # a summary stands for the reasoning's text; the message joins it
    assert last["reasoning"] == "summed" and last["content"] == "11"
    assert turn.conversation == chat["messages"][1:]  # the instructions are not the conversation's
    assert R.parse({"input": "hi"}).chat["messages"] == [{"role": "user", "content": "hi"}]


def test_chat_fields_pass_under_their_names_so_the_chat_rule_applies():
    """vLLM's extras and the fields chat completions share (sent through the openai client's
    extra_body) reach the chat completion; the chat endpoint accepts, honours or refuses each
    as it does on /v1/chat/completions (one rule on both endpoints)."""
    turn = R.parse({"input": "hi", "ignore_eos": True, "seed": 7, "top_k": 5, "stop": ["x"],
                    "repetition_penalty": 1.1, "store": False, "metadata": {"a": "b"},
                    "parallel_tool_calls": False, "prompt_cache_key": "k", "text": {"format": {"type": "text"}},
                    "top_p": None, "max_tool_calls": 3, "background": False, "truncation": "disabled",
                    "reasoning": {"effort": "low", "summary": "auto"}, "include_reasoning": True})
    chat = turn.chat
    assert {k: chat[k] for k in ("ignore_eos", "seed", "top_k", "stop", "repetition_penalty",
                                 "parallel_tool_calls", "prompt_cache_key", "metadata")} == \
        {"ignore_eos": True, "seed": 7, "top_k": 5, "stop": ["x"], "repetition_penalty": 1.1,
         "parallel_tool_calls": False, "prompt_cache_key": "k", "metadata": {"a": "b"}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert "top_p" not in chat and "logprobs" not in chat and turn.store is False
    # a named tool choice and a JSON format in chat's shapes
    named = R.parse({"input": "x", "tool_choice": {"type": "function", "name": "add"},
                     "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})
    assert named.chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert named.chat["response_format"] == {"type": "json_schema",
                                             "json_schema": {"name": "n", "schema": {"type": "object"}}}


def test_logprobs_are_asked_by_include_or_top_logprobs_and_streams_ask_for_usage():
    turn = R.parse({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 3, "stream": True})
    assert turn.logprobs and turn.chat["logprobs"] is True and turn.chat["top_logprobs"] == 3
    assert turn.chat["stream"] is True and turn.chat["stream_options"] == {"include_usage": True}
    assert R.parse({"input": "x", "top_logprobs": 2}).chat["logprobs"] is True
    assert "logprobs" not in R.parse({"input": "x", "include": ["reasoning.encrypted_content"]}).chat


def test_an_assistant_message_in_progress_is_continued():
    turn = R.parse({"input": [{"role": "user", "content": "count"},
                              {"type": "message", "role": "assistant", "status": "incomplete",
                               "content": [{"type": "output_text", "text": "1, 2,"}]}]})
    assert turn.chat["continue_final_message"] is True and turn.chat["add_generation_prompt"] is False


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAA"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.everything"]}, "include"),
    ({"input": "x", "include": ["message.output_text.logprobs"] * 17}, "include"),
    ({"input": "x", "top_logprobs": -1}, "top_logprobs"),
    ({"input": "x", "max_tool_calls": -1}, "max_tool_calls"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"budget": 5}}, "reasoning"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "previous_response_id": "r" * 5000}, "previous_response_id"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(65)}}, "metadata"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "messages": []}, "messages"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    with pytest.raises(InvalidRequestError) as err:
        R.parse(body)
    assert err.value.param == param


def test_a_chat_answer_becomes_output_items():
    chat = {"model": "tiny", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            "choices": [{"finish_reason": "tool_calls", "logprobs": {"content": [{"token": "a", "logprob": -1.0}]},
                         "message": {"role": "assistant", "content": "adding",
                                     "tool_calls": [{"id": "call_9", "type": "function",
                                                     "function": {"name": "add", "arguments": '{"a": 1}'}}]}}]}
    turn = R.parse({"input": "x", "instructions": "be brief"})
    r = R.from_chat(chat, turn)
    assert r["status"] == "completed" and r["incomplete_details"] is None and r["instructions"] == "be brief"
    assert r["id"] == turn.response_id and r["id"].startswith("resp_")
    msg, call = r["output"]
    assert msg["type"] == "message" and msg["content"][0] == {"type": "output_text", "text": "adding",
                                                              "annotations": [], "logprobs": None}
    assert call["type"] == "function_call" and call["call_id"] == "call_9" and call["arguments"] == '{"a": 1}'
    assert r["usage"]["input_tokens"] == 7 and r["usage"]["output_tokens"] == 3
    with_lp = R.from_chat(chat, R.parse({"input": "x", "include": ["message.output_text.logprobs"]}))
    assert with_lp["output"][0]["content"][0]["logprobs"] == [{"token": "a", "logprob": -1.0}]
    cut = R.from_chat({**chat, "choices": [{"finish_reason": "length", "message": {"content": ""}}]}, turn)
    assert cut["status"] == "incomplete" and cut["output"] == []
    assert R.output_messages(r["output"]) == [{"role": "assistant", "content": "adding",
                                               "tool_calls": [chat["choices"][0]["message"]["tool_calls"][0]]}]


# ---------------------------------------------------------------- streamed events
def _chat_sse(*chunks: dict) -> list[str]:
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def _delta(content=None, finish=None, calls=None, logprobs=None) -> dict:
    delta = {"content": content} if calls is None else {"content": content, "tool_calls": calls}
    return {"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": finish}]}


async def _events(turn: R.ResponsesTurn, pieces: list[str]) -> tuple[list[dict], list[dict]]:
    done: list[dict] = []

    async def chat_sse():
        for piece in pieces:
            yield piece

    text = "".join([e async for e in ResponseEvents(turn, done.append).events(chat_sse())])
    return responses_events(text), done


def test_a_streamed_answer_is_told_as_the_responses_events_in_order():
    turn = R.parse({"input": "x", "stream": True, "include": ["message.output_text.logprobs"]})
    lp = lambda t: {"content": [{"token": t, "logprob": -0.5, "bytes": [1], "top_logprobs": []}]}  # noqa: E731
    call = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    pieces = _chat_sse({"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                       _delta("Let ", logprobs=lp("Let ")), _delta("me.", logprobs=lp("me.")),
                       _delta("", finish="tool_calls", calls=[call]),
                       {"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}})
    events, done = asyncio.run(_events(turn, pieces))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["id"] == turn.response_id and events[0]["response"]["status"] == "in_progress"
    assert events[4]["delta"] == "Let " and events[4]["logprobs"] == [{"token": "Let ", "logprob": -0.5,
                                                                      "top_logprobs": []}]
    assert events[6]["text"] == "Let me." and [e["output_index"] for e in events[2:9]] == [0] * 7
    assert events[10]["delta"] == '{"a": 2}' and events[11]["name"] == "add" and events[10]["output_index"] == 1
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 4 and done == [final]
    msg, fc = final["output"]  # the streamed items, same ids (a client rebuilds them from the events)
    assert msg["id"] == events[2]["item"]["id"] and fc["id"] == events[9]["item"]["id"]
    assert msg["content"][0]["text"] == "Let me." and len(msg["content"][0]["logprobs"]) == 2
    assert fc["call_id"] == "call_7" and fc["arguments"] == '{"a": 2}' and fc["status"] == "completed"


def test_a_cut_answer_completes_as_incomplete_and_an_error_ends_the_stream():
    turn = R.parse({"input": "x", "stream": True})
    events, _ = asyncio.run(_events(turn, _chat_sse(_delta("ab"), _delta("c", finish="length"))))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    error = 'data: {"error": {"message": "engine died", "type": "EngineStateError", "code": 500}}\n\ndata: [DONE]\n\n'
    events, done = asyncio.run(_events(turn, [f"data: {json.dumps(_delta('ab'))}\n\n", error]))
    assert [e["type"] for e in events][-4:] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "error"]
    assert events[-1]["message"] == "engine died" and done == []  # not stored


# ---------------------------------------------------------------- the store
def _entry(rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse.of({"id": rid, "output": text}, [{"role": "user", "content": text}])


def test_the_store_evicts_the_least_recently_used_by_count_and_bytes():
    store = ResponseStore(StoreLimits(max_responses=2, max_bytes=10_000))
    store.put(_entry("a"))
    store.put(_entry("b"))
    assert store.get("a") is not None  # a used: b is now the oldest
    store.put(_entry("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2 and store.evicted == 1
    size = _entry("d", "y" * 100).size
    by_bytes = ResponseStore(StoreLimits(max_responses=100, max_bytes=2 * size + 10))
    for rid in "def":
        by_bytes.put(_entry(rid, "y" * 100))
    assert by_bytes.get("d") is None and by_bytes.get("f") is not None and by_bytes.bytes <= 2 * size + 10
    assert not by_bytes.put(_entry("huge", "z" * 10_000)) and by_bytes.get("e") is not None  # kept the rest
    with pytest.raises(ValueError):
        StoreLimits(max_responses=-1)


# ---------------------------------------------------------------- the service
class FakeChat:
    """A ChatBackend answering every chat with one word; a prompt counts one token per
    character of its messages, the context holds `limit`."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit, self.sent = limit, []

    def _tokens(self, chat: dict) -> int:
        return sum(len(str(m.get("content") or "")) for m in chat["messages"])

    async def complete(self, chat: dict) -> dict:
        self.sent.append(chat)
        n = self._tokens(chat)
        if n >= self.limit:
            raise InvalidRequestError("no room", param="input_tokens")
        return {"model": "tiny", "usage": {"prompt_tokens": n, "completion_tokens": 1},
                "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}

    async def stream(self, chat: dict):
        raise AssertionError("not streamed here")

    async def prompt_tokens(self, chat: dict) -> tuple[int, int]:
        return self._tokens(chat), self.limit


def test_previous_response_id_continues_the_conversation_and_store_false_keeps_nothing():
    service, chat = ResponsesService(ResponseStore()), FakeChat()
    first = asyncio.run(service.create({"input": "hello", "instructions": "sys"}, chat))
    second = asyncio.run(service.create({"input": "again", "previous_response_id": first["id"]}, chat))
    assert chat.sent[-1]["messages"] == [{"role": "user", "content": "hello"},  # no instructions carried
                                         {"role": "assistant", "content": "ok"},
                                         {"role": "user", "content": "again"}]
    assert second["previous_response_id"] == first["id"] and service.retrieve(first["id"]) == first
    unstored = asyncio.run(service.create({"input": "x", "store": False}, chat))
    with pytest.raises(ResponseNotFoundError) as err:
        asyncio.run(service.create({"input": "y", "previous_response_id": unstored["id"]}, chat))
    assert err.value.param == "previous_response_id"
    with pytest.raises(ResponseNotFoundError):
        service.retrieve("resp_unknown")


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits():
    service, chat = ResponsesService(ResponseStore()), FakeChat(limit=40)
    turns = [{"role": "user", "content": "a" * 15}, {"role": "assistant", "content": "b" * 5},
             {"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "d" * 5},
             {"role": "user", "content": "e" * 10}]
    with pytest.raises(InvalidRequestError):  # disabled (the default): refused, as vLLM refuses it
        asyncio.run(service.create({"input": turns, "instructions": "sys"}, chat))
    r = asyncio.run(service.create({"input": turns, "instructions": "sys", "truncation": "auto"}, chat))
    sent = chat.sent[-1]["messages"]
    assert sent[0] == {"role": "system", "content": "sys"} and sent[1:] == turns[2:]  # one turn dropped
    assert r["truncation"] == "auto" and r["status"] == "completed"
    with pytest.raises(InvalidRequestError):  # the last turn alone does not fit: refused
        asyncio.run(service.create({"input": [{"role": "user", "content": "z" * 50}], "truncation": "auto"}, chat))


def test_a_relayed_refusal_is_recognised_as_too_long():
    class Relayed(FakeChat):
        async def complete(self, chat):
            try:
                return await super().complete(chat)
            except InvalidRequestError as exc:
                raise UpstreamAnswerError(400, {"error": {"message": str(exc), "param": exc.param}}) from None

    service, chat = ResponsesService(ResponseStore()), Relayed(limit=30)
    turns = [{"role": "user", "content": "a" * 20}, {"role": "user", "content": "b" * 20}]
    r = asyncio.run(service.create({"input": turns, "truncation": "auto"}, chat))
    assert r["status"] == "completed" and chat.sent[-1]["messages"] == turns[1:]


def test_a_caller_that_leaves_closes_the_chat_stream():
    """Closing the events (the client went away) closes the chat stream at once: on a server
    that aborts the request (serving.py's stream ends it in its `finally`)."""
    closed: list[bool] = []

    async def chat_sse():
        try:
            for _ in range(100):
                yield f"data: {json.dumps(_delta('x'))}\n\n"
        finally:
            closed.append(True)

    async def main() -> None:
        events = ResponseEvents(R.parse({"input": "x", "stream": True}), lambda _: None).events(chat_sse())
        async for text in events:
            if text.startswith("event: response.output_text.delta"):
                break
        await events.aclose()
        assert closed == [True]  # now, not when the loop's shutdown finalizes leftover generators

    asyncio.run(main())
