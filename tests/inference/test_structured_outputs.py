"""Structured outputs and forced tool calls through `rlix serve`'s OpenAI surface, with the official
`openai` client against a real engine server process on the `tiny` model (random weights: only a
constraint makes its output JSON, a regex match or a tool call).

Each acceptance case sends its 50 requests concurrently at temperature 1 (the engine batches
them: a few seconds on 2 cores) and checks every answer: a JSON answer validates against its
schema with `jsonschema`, a forced call names a declared tool with arguments that validate
against that tool's parameters. The schemas keep their values short (enums, bounded integers,
patterns): the constraint decides what is valid, not when a random model stops writing a string.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from kit import ADD_TOOL, ANSWER_SCHEMA, KEY, TOOL_PARAMS, WEATHER_TOOL, shard_processes

N = 50
TOOLS = [WEATHER_TOOL, ADD_TOOL]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next days?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with shard_processes(tiny_model_dir, 1, max_model_len=2048) as procs:  # room for the tools
        yield procs[0].url


@pytest.fixture(scope="module")
def oai(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    yield client
    client.close()


def concurrently(server: str, n: int, call) -> list:  # type: ignore[no-untyped-def]
    """`call(client)` n times at once with the async client (one batch in the engine)."""
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(call(client) for _ in range(n)))

    return asyncio.run(run())


def assert_valid_calls(choice, names: set[str]) -> None:  # type: ignore[no-untyped-def]
    calls = choice.message.tool_calls
    assert calls, (choice.finish_reason, choice.message.content)
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMS[call.function.name])


def test_tool_choice_required_gives_a_valid_call_every_time(server):
    rs = concurrently(server, N, lambda c: c.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
        # parallel calls are allowed: after each block the random model may start another, so
        # room for tens of blocks (each ~30 tokens) makes a cut by max_tokens vanishingly rare
        max_tokens=1500))
    for r in rs:
        choice = r.choices[0]
        assert_valid_calls(choice, {"get_weather", "add"})
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM's shape
    # at temperature 1 the random model picks either tool: the constraint, not luck, makes them valid
    assert {c.function.name for r in rs for c in r.choices[0].message.tool_calls} == {"get_weather", "add"}


def test_named_tool_choice_calls_that_tool(oai):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, n=4, max_tokens=300,
                                    tool_choice={"type": "function", "function": {"name": "add"}})
    for choice in r.choices:
        assert_valid_calls(choice, {"add"})
        assert len(choice.message.tool_calls) == 1
        assert choice.finish_reason == "stop"  # vLLM's finish for a named choice


def test_required_without_parallel_calls_gives_one_call_and_streams(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                              tool_choice="required", parallel_tool_calls=False, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in TOOL_PARAMS
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOL_PARAMS[calls[0].function.name])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_schema_response_format_validates_every_time(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    rs = concurrently(server, N, lambda c: c.chat.completions.create(
        # (the random model may put up to 24 whitespace characters in each of ~15 gaps: room for all)
        model="tiny", messages=MESSAGES, response_format=fmt, temperature=1.0, max_tokens=1200))
    for r in rs:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER_SCHEMA)
    assert len({r.choices[0].message.content for r in rs}) > 1  # sampled, not one canned answer


def test_json_object_and_completions_json_schema(oai):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, seed=3,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an unbounded object may run past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    c = oai.completions.create(model="tiny", prompt="The answer:", max_tokens=300, n=3, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}})
    for choice in c.choices:
        jsonschema.validate(json.loads(choice.text), ANSWER_SCHEMA)


def test_regex_and_choice(oai):
    r = oai.completions.create(model="tiny", prompt="A date:", max_tokens=40, n=8, extra_body={
        "structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}})
    assert all(re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", c.text) for c in r.choices), r.choices
    assert all(c.finish_reason == "stop" for c in r.choices)
    choices = ["red", "green", "blue \"sky\""]
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=16,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1


def test_grammar_and_token_level_generate(server, oai):
    grammar = 'root ::= "ab" num\nnum ::= [0-9] | [0-9] num'
    r = oai.completions.create(model="tiny", prompt="x", max_tokens=30, seed=1,
                               extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"ab[0-9]+", r.choices[0].text) or (r.choices[0].finish_reason == "length"
                                                            and re.fullmatch(r"ab[0-9]*", r.choices[0].text))
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 20, "structured_outputs":
                                                        {"choice": ["yes", "no"]}}}
    got = httpx.post(server + "/inference/v1/generate", json=body, headers={"Authorization": f"Bearer {KEY}"},
                     timeout=60).json()
    text = oai.completions.create(model="tiny", prompt=got["choices"][0]["token_ids"], max_tokens=1,
                                  echo=True).choices[0].text
    assert text.startswith(("yes", "no"))


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["x"] * 300}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integerx"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


def test_already_generated_tokens_a_grammar_refuses_are_a_400_naming_the_field(server):
    """The router's continuation field (rlix's own): a constrained completion continued from its
    first tokens (prompt + those, already_generated = their count) completes the same match;
    the ids it counts must be ones the constraint allows (they came from a matcher: anything
    else is tampering or another tokenizer) and no more than the prompt holds."""
    regex = {"structured_outputs": {"regex": "[0-9]{6}"}}
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server + path, json=body, headers=headers, timeout=60)

    first = post("/v1/completions", {"model": "tiny", "prompt": "n:", "max_tokens": 2, "seed": 4,
                                     "return_token_ids": True, **regex}).json()
    prompt, head = first["choices"][0]["prompt_token_ids"], first["choices"][0]["token_ids"]
    assert first["choices"][0]["finish_reason"] == "length"  # 2 tokens cannot be 6 digits and an end
    rest = post("/v1/completions", {"model": "tiny", "prompt": prompt + head, "max_tokens": 12, "seed": 4,
                                    "already_generated": len(head), **regex}).json()["choices"][0]
    assert rest["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{6}", first["choices"][0]["text"] + rest["text"])
    for already in (len(prompt) + 1, 1, -1):  # 1: the prompt's last id is no digit
        r = post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                     "already_generated": already, **regex})
        assert r.status_code == 400 and r.json()["error"]["param"].endswith("already_generated"), r.text
    for already in (1, 10**9):
        r = post("/inference/v1/generate", {"token_ids": prompt, "already_generated": already,
                                            "sampling_params": {"max_tokens": 5, **regex}})
        assert r.status_code == 400 and r.json()["error"]["param"].endswith("already_generated"), r.text
