"""The policy gateway: chat completions token in, token out; turns stitched exactly; an edited
history or a template that does not extend breaks the episode (served, then dropped)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlix.agents.episodes import Unstitchable, stitch
from rlix.agents.gateway import PolicyGateway
from rlix.errors import InvalidRequestError
from rlix.inference.router.router import Generation, VersionSpan
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.models.tokenizer import build_tokenizer

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
TOOLS = [{"type": "function", "function": {"name": "check", "description": "score an answer",
                                            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}}}}]


class ScriptedEngine:
    """Answers each generate with the next scripted text (sampled ids as a BPE would split them
    one character at a time: never what re-tokenising the text gives back)."""

    def __init__(self, texts: list[str], end: bool = True) -> None:
        self.texts, self.end = list(texts), end
        self.calls: list[tuple[list[int], dict, str | None]] = []

    async def __call__(self, ids: list[int], params: GenerateSamplingParams, session: str | None) -> Generation:
        self.calls.append((list(ids), params.model_dump(), session))
        text = self.texts.pop(0)
        out = [t for ch in text for t in TOK.encode(ch, add_special_tokens=False)] + ([END] if self.end else [])
        return Generation(out, [-0.25 - 0.01 * k for k in range(len(out))], [VersionSpan(3, 0, len(out))],
                          "stop" if self.end else "length", len(ids))


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def gateway(engine: ScriptedEngine) -> PolicyGateway:
    return PolicyGateway(engine, TOK, "policy", temperature=1.0, max_tokens=16)


def test_three_turns_stitch_to_the_engines_exact_tokens_with_context_masked():
    engine = ScriptedEngine(["hello there", 'ok <tool_call>{"name": "check", "arguments": {"answer": "zz"}}</tool_call>',
                             "zzzz"])
    gw = gateway(engine)
    gw.open("ep1", seed=7)
    msgs = [{"role": "user", "content": "Repeat: z"}]
    a1 = run(gw.chat({"messages": msgs, "tools": TOOLS, "temperature": 0.1, "max_tokens": 99}, "ep1"))
    msgs = msgs + [a1["choices"][0]["message"], {"role": "user", "content": "score 0.10"}]
    a2 = run(gw.chat({"messages": msgs, "tools": TOOLS}, "ep1"))
    m2 = a2["choices"][0]["message"]
    assert a2["choices"][0]["finish_reason"] == "tool_calls" and m2["content"] == "ok"
    call = m2["tool_calls"][0]
    assert call["function"]["name"] == "check" and json.loads(call["function"]["arguments"]) == {"answer": "zz"}
    # the agent echoes the call back with other spacing in its arguments: still the same turn
    echoed = {**m2, "tool_calls": [{**call, "function": {"name": "check", "arguments": '{"answer":"zz"}'}}]}
    msgs = msgs + [echoed, {"role": "tool", "tool_call_id": call["id"], "content": "score 0.50"}]
    run(gw.chat({"messages": msgs, "tools": TOOLS}, "ep1"))
    # the pipeline's sampling settings, not the agent's; a seed per turn
    assert [c[1]["temperature"] for c in engine.calls] == [1.0] * 3
    assert [c[1]["max_tokens"] for c in engine.calls] == [16] * 3
    assert [c[1]["seed"] for c in engine.calls] == [7, 8, 9] and {c[2] for c in engine.calls} == {"ep1"}
    trace = gw.take("ep1")
    assert trace.broken is None and len(trace.turns) == 3
    sample = stitch(trace)
    sampled = [t for turn in trace.turns for t in turn.token_ids]
    assert [t for t, m in zip(sample.response_ids, sample.loss_mask) if m] == sampled
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [lp for t in trace.turns for lp in t.logprobs]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    # each turn's prompt is exactly what came before it
    for k, turn in enumerate(trace.turns[1:], start=1):
        prev = trace.turns[k - 1]
        assert turn.prompt_ids[:len(prev.prompt_ids) + len(prev.token_ids)] == prev.prompt_ids + prev.token_ids
    # the context between turns is the template's text: the tool output is in it, unsampled
    context = TOK.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "score 0.10" in context and "<tool_response>\nscore 0.50\n</tool_response>" in context
    assert context.startswith("\n<|im_start|>user\n")  # the model wrote <|im_end|>; "\n" is context
    # and the sampled ids are not what re-tokenising the text would give: stitching mattered
    assert TOK.encode("hello there", add_special_tokens=False) != sampled[:len(TOK.encode("hello there"))]
    with pytest.raises(InvalidRequestError, match="not an open episode"):
        run(gw.chat({"messages": msgs}, "ep1"))


def test_a_turn_cut_by_length_gets_the_templates_end_as_context():
    engine = ScriptedEngine(["abc", "def"], end=False)
    gw = gateway(engine)
    gw.open("e")
    msgs = [{"role": "user", "content": "go"}]
    a1 = run(gw.chat({"messages": msgs}, "e"))
    assert a1["choices"][0]["finish_reason"] == "length"
    run(gw.chat({"messages": msgs + [a1["choices"][0]["message"], {"role": "user", "content": "more"}]}, "e"))
    sample = stitch(gw.take("e"))
    context = TOK.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert context.startswith("<|im_end|>\n<|im_start|>user\nmore")


def test_an_edited_history_is_served_but_marked_and_not_trainable():
    engine = ScriptedEngine(["one", "two"])
    gw = gateway(engine)
    gw.open("e")
    msgs = [{"role": "user", "content": "go"}]
    a1 = run(gw.chat({"messages": msgs}, "e"))
    edited = {**a1["choices"][0]["message"], "content": "something else"}
    a2 = run(gw.chat({"messages": msgs + [edited, {"role": "user", "content": "again"}]}, "e"))
    assert a2["choices"][0]["message"]["content"] == "two"  # the agent is still answered
    trace = gw.take("e")
    assert "turn 2: message 1 differs" in trace.broken
    with pytest.raises(Unstitchable, match="turn 2"):
        stitch(trace)


@pytest.mark.parametrize("body, match", [
    ({"messages": []}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": TOOLS}, "tool_choice"),
])
def test_malformed_requests_are_refused_before_any_generation(body, match):
    engine = ScriptedEngine(["x"])
    gw = gateway(engine)
    gw.open("e")
    with pytest.raises(InvalidRequestError, match=match):
        run(gw.chat(body, "e"))
    with pytest.raises(InvalidRequestError, match="X-Session-ID"):
        run(gw.chat({"messages": [{"role": "user", "content": "x"}]}, None))
    assert engine.calls == []


def test_responses_api_runs_on_the_same_recorded_path():
    engine = ScriptedEngine(['<tool_call>{"name": "check", "arguments": {"answer": "z"}}</tool_call>'])
    gw = gateway(engine)
    gw.open("e")
    out = run(gw.responses({"input": "Repeat: z", "tools": [{"type": "function", "name": "check",
                                                             "parameters": {"type": "object"}}]}, "e"))
    assert [o["type"] for o in out["output"]] == ["function_call"] and out["output"][0]["name"] == "check"
    assert len(gw.take("e").turns) == 1
