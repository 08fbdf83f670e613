"""/v1/responses as vLLM's clients use it, on an engine server in this process: the official
`openai` client's streaming (`responses.create(stream=True)`, `responses.stream`), a stored
conversation continued by `previous_response_id`, logprobs, the store's bound; tool calls
streamed and the OpenAI Agents SDK's `Runner.run_streamed` over a scripted engine (one that
writes a tool call, then an answer once the tool's output is in its prompt)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kit import KEY, responses_events
from rlix.inference.engine.api import GenerationOutput
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.server.app import create_app
from rlix.inference.server.responses_store import StoreLimits

EVENTS_OF_TEXT = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta"]
END_OF_TEXT = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
               "response.completed"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=8, max_model_len=1024)
    yield eng
    eng.close()


def _client(app) -> tuple[TestClient, openai.OpenAI]:
    http = TestClient(app, headers={"Authorization": f"Bearer {KEY}"})
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def served(engine):
    http, client = _client(create_app(engine, engine.tokenizer, "tiny", KEY))
    with http:
        yield http, client


SEEDED = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 12, "temperature": 1.0,
          "extra_body": {"seed": 5, "ignore_eos": True}}


def test_streamed_text_is_the_plain_answer_and_the_events_come_in_order(served):
    http, client = served
    plain = client.responses.create(**SEEDED)
    events = list(client.responses.create(stream=True, **SEEDED))
    types = [e.type for e in events]
    n_deltas = types.count("response.output_text.delta")
    assert types == EVENTS_OF_TEXT[:-1] + ["response.output_text.delta"] * n_deltas + END_OF_TEXT
    assert n_deltas >= 2 and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.status == plain.status == "incomplete"
    assert final.usage.output_tokens == plain.usage.output_tokens == 12
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id
    with client.responses.stream(**SEEDED) as stream:  # the client's own accumulation checks ids
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == plain.output_text
    raw = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert responses_events(raw.text)[-1]["type"] == "response.completed"


def test_previous_response_id_continues_the_conversation(served):
    http, client = served
    first = client.responses.create(model="tiny", instructions="be brief", input="Once upon a time",
                                    max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert first.output_text  # (greedy: a fixed answer with text, so an assistant turn to carry)
    second = client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                     max_output_tokens=4, extra_body={"ignore_eos": True})
    # the second prompt is the first turn (its input and its answer, not its instructions) + the new input
    expected = http.post("/tokenize", json={"messages": [
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"}]}).json()["count"]
    assert second.usage.input_tokens == expected and second.previous_response_id == first.id
    streamed = list(client.responses.create(model="tiny", input="more", previous_response_id=second.id,
                                            max_output_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert streamed[-1].response.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    third = client.responses.retrieve(streamed[-1].response.id)  # a streamed response is stored too
    assert third.output_text == streamed[-1].response.output_text


def test_unstored_and_unknown_responses_are_404(served):
    _, client = served
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for rid in (unstored.id, "resp_never"):
        with pytest.raises(openai.NotFoundError, match="not found") as err:
            client.responses.create(model="tiny", input="y", previous_response_id=rid)
        assert err.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="tiny", input="x", background=True)


def test_logprobs_come_with_include_plain_and_streamed(served):
    _, client = served
    kw = dict(model="tiny", input="Once upon a time", max_output_tokens=5, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 5 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert lps[0].top_logprobs[0].logprob >= lps[0].top_logprobs[1].logprob
    events = list(client.responses.create(stream=True, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in lps]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in lps], abs=1e-5)
    unasked = client.responses.create(**{k: v for k, v in kw.items() if k not in ("include", "top_logprobs")})
    assert unasked.output_text == r.output_text and unasked.output[0].content[0].logprobs is None


def test_the_store_keeps_a_bounded_number_of_responses(engine):
    http, client = _client(create_app(engine, engine.tokenizer, "tiny", KEY,
                                      responses_store=StoreLimits(max_responses=2)))
    with http:
        ids = [client.responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the oldest went
        assert [client.responses.retrieve(rid).id for rid in ids[1:]] == ids[1:]


# ---------------------------------------------------------------- tool calls (scripted engine)
CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>')
ONE_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The sum is 5."


class ScriptedEngine:
    """An EngineAPI that writes `script(prompt text)` token by token, then end-of-sequence: a
    model that calls tools on cue, for the tool paths a random model never takes."""

    def __init__(self, tokenizer, script) -> None:
        self.tok, self.script = tokenizer, script
        self.max_model_len, self.num_running, self.num_waiting, self.weight_version = 4096, 0, 0, 0

    async def generate(self, request_id: str, prompt_ids: list[int], params, final_only: bool = False
                       ) -> AsyncIterator[GenerationOutput]:
        text = self.script(self.tok.decode(prompt_ids))
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        for k in range(1, len(ids) + 1):
            await asyncio.sleep(0)
            yield GenerationOutput(request_id, prompt_ids, ids[:k], [-0.1] * k,
                                   "stop" if k == len(ids) else None, first_token_at=0.0)

    async def abort(self, request_ids: list[str]) -> None:
        return None


def _tool_script(calls: str):
    return lambda prompt: ANSWER if "<tool_response>" in prompt else calls


ADD = {"type": "function", "name": "add", "description": "add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


def test_tool_calls_stream_as_function_call_items(engine):
    http, client = _client(create_app(ScriptedEngine(engine.tokenizer, _tool_script(CALLS)),
                                      engine.tokenizer, "tiny", KEY))
    with http:
        events = list(client.responses.create(model="tiny", input="2+3 and 4+5?", tools=[ADD], stream=True))
        types = [e.type for e in events]
        call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done"]
        assert types == ["response.created", "response.in_progress"] + call_events * 2 + ["response.completed"]
        final = events[-1].response
        assert [(o.type, json.loads(o.arguments)) for o in final.output] == [
            ("function_call", {"a": 2, "b": 3}), ("function_call", {"a": 4, "b": 5})]
        assert final.output[0].call_id != final.output[1].call_id
        plain = client.responses.create(model="tiny", input="2+3 and 4+5?", tools=[ADD])
        assert [json.loads(o.arguments) for o in plain.output] == [{"a": 2, "b": 3}, {"a": 4, "b": 5}]
        # parallel_tool_calls: false answers the first call only (vLLM's rule), as chat does
        one = client.responses.create(model="tiny", input="2+3 and 4+5?", tools=[ADD], parallel_tool_calls=False)
        assert [json.loads(o.arguments) for o in one.output] == [{"a": 2, "b": 3}]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+3?"}],
                                              tools=[{"type": "function", "function": {"name": "add"}}],
                                              parallel_tool_calls=False)
        assert len(chat.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("chained", [False, True], ids=["whole-history", "previous_response_id"])
def test_agents_sdk_runs_its_tool_loop_streamed(engine, chained):
    """Runner.run_streamed on the Responses model: the model calls `add`, the SDK runs it and
    sends its output back (the whole history, or only the new items after previous_response_id),
    the model answers."""
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, the dev extra)")
    if not hasattr(agents, "Runner"):
        pytest.skip("`agents` here is not the OpenAI Agents SDK")
    agents.set_tracing_disabled(True)
    seen: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        seen.append((a, b))
        return a + b

    app = create_app(ScriptedEngine(engine.tokenizer, _tool_script(ONE_CALL)), engine.tokenizer, "tiny", KEY)

    async def run() -> tuple[str, list[str]]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver",
                                 headers={"Authorization": f"Bearer {KEY}"})
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        agent = agents.Agent(name="calc", instructions="Use the add tool.", tools=[add],
                             model=agents.OpenAIResponsesModel(model="tiny", openai_client=client))
        result = agents.Runner.run_streamed(agent, "What is 2+3?", auto_previous_response_id=chained)
        kinds = [event.data.type async for event in result.stream_events() if event.type == "raw_response_event"]
        await http.aclose()
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert seen == [(2, 3)] and final == ANSWER
    assert kinds.count("response.completed") == 2 and "response.function_call_arguments.done" in kinds


def test_a_json_schema_format_and_a_forced_call_constrain_the_answer(served):
    """text.format json_schema and tool_choice required go to chat's constrained decoding: the
    random `tiny` model's answer is JSON of the schema, and a call of the declared tool."""
    import jsonschema  # deferred: only this test validates a schema

    _, client = served
    # (bounded values: a random model's integer or free string could outrun max_output_tokens)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "ok": {"type": "boolean"}},
              "required": ["k", "ok"], "additionalProperties": False}
    answer = client.responses.create(model="tiny", input="Give JSON", max_output_tokens=200, temperature=1.0,
                                     text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert answer.status == "completed", answer
    jsonschema.validate(json.loads(answer.output_text), schema)
    tool = {"type": "function", "name": "lookup", "description": "look a word up", "strict": True,
            "parameters": {"type": "object", "properties": {"word": {"type": "string", "enum": ["a", "b"]}},
                           "required": ["word"], "additionalProperties": False}}
    called = client.responses.create(model="tiny", input="Look up a word", tools=[tool], tool_choice="required",
                                     max_output_tokens=200, temperature=1.0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(c.name == "lookup" and json.loads(c.arguments)["word"] in ("a", "b") for c in calls), called
