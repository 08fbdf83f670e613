"""/v1/responses over HTTP on every available backend (rlix's server, and vLLM 0.32's CPU server
with `-m vllm`): the response's keys, the streamed events' order and numbering, the streamed
text against the plain answer, and the 404 for a response the server does not hold.

One difference is stated rather than compared: vLLM stores responses only when started with
VLLM_ENABLE_RESPONSES_API_STORE=1 (then without a bound), so on a default vLLM server
`previous_response_id` always answers 404; rlix stores by default, bounded. The continuation
is tested on rlix's server (and through the openai client in test_responses_clients.py)."""

from __future__ import annotations

import json

import pytest

from kit import responses_events

RESPONSE_KEYS = ["id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
                 "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
                 "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning",
                 "service_tier", "status", "text", "top_logprobs", "truncation", "usage", "user",
                 "presence_penalty", "frequency_penalty", "kv_transfer_params", "ec_transfer_params",
                 "input_messages", "output_messages"]
USAGE_KEYS = ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"]
BODY = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 6, "temperature": 0,
        "ignore_eos": True}


def test_response_shape_and_streamed_events(served):
    plain = served.http.post("/v1/responses", json=BODY)
    assert plain.status_code == 200, plain.text
    r = plain.json()
    assert list(r) == RESPONSE_KEYS and r["object"] == "response" and list(r["usage"]) == USAGE_KEYS
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    (msg,) = r["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["status"] == "completed"
    assert {"id", "content", "role", "status", "type"} <= set(msg)
    text = msg["content"][0]["text"]
    events = responses_events(served.http.post("/v1/responses", json={**BODY, "stream": True}).text)
    types = [e["type"] for e in events]
    n = types.count("response.output_text.delta")
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    final = events[-1]["response"]
    assert list(final) == RESPONSE_KEYS and final["output"][0]["content"][0]["text"] == text
    assert final["id"] == events[0]["response"]["id"] and final["output"][0]["id"] == events[2]["item"]["id"]
    assert events[0]["response"]["status"] == "in_progress" and final["status"] == "incomplete"


def test_a_response_not_held_is_404(served):
    for answer in (served.http.post("/v1/responses", json={**BODY, "previous_response_id": "resp_never"}),
                   served.http.get("/v1/responses/resp_never")):
        assert answer.status_code == 404, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_previous_response_id_continues_a_stored_response(served):
    if served.backend == "vllm":
        pytest.skip("vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (see the module)")
    first = served.http.post("/v1/responses", json=BODY).json()
    second = served.http.post("/v1/responses", json={**BODY, "input": "and then",
                                                     "previous_response_id": first["id"]}).json()
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert served.http.get(f"/v1/responses/{second['id']}").json() == second


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.parametrize("extra, status", [
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, 200),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
                {"role": "user", "content": "Once upon a time"}]}, 200),
    ({"reasoning": {"effort": "low"}}, 200),
    ({"truncation": "auto"}, 200),
    ({"max_tool_calls": 2, "tools": [WEATHER], "parallel_tool_calls": False}, 200),
    ({"background": False}, 200),
    ({"background": True}, 400),
    ({"text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}, "max_output_tokens": 64,
      "ignore_eos": False}, 200),
    ({"store": False}, 200),
], ids=["include-logprobs", "reasoning-item", "reasoning-effort", "truncation", "max-tool-calls", "background-false",
        "background-true", "json-schema", "store-false"])
def test_each_responses_field_answers_as_vllm_does(served, extra, status):
    """The fields table of docs/INFERENCE_SERVING.md, one request each, on both servers: the same
    status and, when answered, the same response keys (values differ: rlix's engine is not
    vLLM's)."""
    answer = served.http.post("/v1/responses", json={**BODY, **extra})
    assert answer.status_code == status, answer.text
    if status != 200:
        return
    r = answer.json()
    assert list(r) == RESPONSE_KEYS and r["status"] in ("completed", "incomplete")
    text = [c for item in r["output"] if item["type"] == "message" for c in item["content"]]
    if "include" in extra:  # the text's logprobs, each with its 2 alternatives
        assert text and all(len(lp["top_logprobs"]) == 2 for c in text for lp in c["logprobs"])
    if "text" in extra and r["status"] == "completed":
        assert json.loads(text[0]["text"]) in ({"ok": True}, {"ok": False})
