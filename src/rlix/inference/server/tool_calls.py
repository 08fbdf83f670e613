"""Tool calls in chat completions, hermes-style (the format Qwen2-family templates teach and
vLLM's `hermes` parser reads): the model writes each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the server answers them as OpenAI
`tool_calls` and the text around them as `content`.

A block that is not a JSON object with a string `name` makes the whole answer plain content, as
vLLM's parser does: a half-written call is never executed as if it were one.

A forced call (`tool_choice` "required" or a named function) constrains the output to this very
format (`forced_call_constraint`): one or more blocks `<tool_call>\n{"name": NAME, "arguments":
ARGS}\n</tool_call>` separated by newlines (exactly one for a named function, or with
`parallel_tool_calls: false`), NAME a declared tool's and ARGS matching its `parameters` schema,
so the parser above always finds valid calls of declared tools. That is what vLLM 0.32 does
with its hermes parser (an xgrammar structural tag); the answer's shape is vLLM's too
(serving.py).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from rlix.errors import InvalidRequestError
from rlix.httpkit import MAX_JSON_DEPTH, json_too_deep
from rlix.inference.engine.api import OutputConstraint
from rlix.inference.engine.constrained import MAX_JSON_WHITESPACE
from rlix.inference.server.limits import MAX_STRUCTURAL_TAG_CHARS

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's answer; content None when nothing but calls was written."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except (json.JSONDecodeError, RecursionError):  # a model can write 1000 brackets too
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                return text, []
        elif not isinstance(args, dict):
            return text, []
        calls.append(ToolCall(f"call_{secrets.token_hex(12)}", obj["name"],
                              args if isinstance(args, str) else json.dumps(args)))
    rest = _BLOCK.sub("", text).strip()
    return rest or None, calls


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's `tools` and `tool_choice` ask of its answer."""

    parse: bool  # the answer's <tool_call> blocks become `tool_calls`
    forced: Literal["required", "named"] | None = None  # the output is constrained to calls
    name: str | None = None  # the function a named choice forces


def answer_calls(text: str, finish: str, choice: ToolChoice, parallel: bool = True
                 ) -> tuple[str | None, list[ToolCall], str]:
    """A chat answer's content, its tool calls and its finish reason, as vLLM gives them: with
    calls parsed, "tool_calls" (for tool_choice "auto" if any call came, for "required"
    whenever the output stopped); a named choice keeps the output's finish; a forced call's
    content is "" rather than null; `parallel` False keeps the first call. The engine server
    and the router (on a re-dispatched answer's whole text) both answer through this.

    A cut answer (finish "abort") is not parsed: its last block may be half-written, and the
    router, which continues a preempted one on another shard, needs its text as written."""
    if not choice.parse or finish == "abort":
        return text, [], finish
    content, calls = parse_tool_calls(text)
    if not parallel:
        calls = calls[:1]
    if choice.forced is not None:
        content = content or ""
    if finish == "stop" and (choice.forced == "required" or (choice.forced is None and calls)):
        finish = "tool_calls"
    return content, calls, finish


def tool_choice_of(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolChoice:
    """Validate a request's `tools` and `tool_choice` (vLLM's checks and params)."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                      param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                      param="tools")
    if tool_choice in (None, "auto", "none"):
        return ToolChoice(bool(tools) and tool_choice != "none")
    if not tools:
        raise InvalidRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tool_choice == "required":
        return ToolChoice(True, "required")
    usage = 'use "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    if not isinstance(tool_choice, dict):
        raise InvalidRequestError(f"Invalid value for `tool_choice`: {str(tool_choice)[:100]!r}; {usage}",
                                  param="tool_choice")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequestError(f"Invalid `tool_choice`: {usage}", param="tool_choice.function.name")
    if not any(t["function"]["name"] == name for t in tools):
        raise InvalidRequestError(f"tool_choice names {name[:100]!r}, which is not in `tools`",
                                  param="tool_choice.function.name")
    return ToolChoice(True, "named", name)


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Validate `tools` and `tool_choice` where the output is not constrained (the agents'
    gateway, /tokenize); True when the answer should be parsed for calls. Forcing a call needs
    the engine's constrained decoding: refused with 400 here rather than ignored."""
    choice = tool_choice_of(tools, tool_choice)
    if choice.forced is not None:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} is not supported here (only 'auto' and "
                                  "'none': forcing a call needs the engine's constrained decoding)",
                                  param="tool_choice")
    return choice.parse


def forced_call_constraint(tools: list[dict[str, Any]], choice: ToolChoice,
                           parallel: bool = True) -> OutputConstraint:
    """The output constraint of a forced call: the blocks this module parses (module docstring),
    of the named tool or any declared one, their arguments matching the tool's `parameters`
    (any JSON object when it declares none)."""
    tags = []
    for tool in tools:
        fn = tool["function"]
        if choice.forced == "named" and fn["name"] != choice.name:
            continue
        schema = fn.get("parameters") or {"type": "object"}
        tags.append({"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
                     "content": {"type": "json_schema", "json_schema": schema,
                                 "max_whitespace_cnt": MAX_JSON_WHITESPACE},
                     "end": "}\n</tool_call>"})
    single = choice.forced == "named" or not parallel
    spec = json.dumps({"type": "structural_tag",
                       "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                  "at_least_one": True, "stop_after_first": single}})
    if len(spec) > MAX_STRUCTURAL_TAG_CHARS:
        raise InvalidRequestError(f"the tools' parameter schemas take {len(spec)} characters; at most "
                                  f"{MAX_STRUCTURAL_TAG_CHARS} can constrain a forced call", param="tools")
    return OutputConstraint("structural_tag", spec, param="tools")


def text_content(content: Any, where: str) -> Any:
    """A message's content as the template reads it: a list of text parts (OpenAI's standard
    form) joined by newlines, as vLLM joins them; a part of another type (image, audio, file) is
    refused, naming it. Anything else is left for the template to judge."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{where}.content[{j}]: content parts of type {kind!r} are not "
                                      "supported (text parts only: {'type': 'text', 'text': ...})",
                                      param=f"{where}.content[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them: content parts joined (text_content), an
    assistant's tool-call arguments as objects (OpenAI sends them as JSON text), missing content
    as ''."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": text_content(m["content"], f"messages[{i}]")}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict((c or {}).get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    if json_too_deep(fn["arguments"].encode()):  # JSON text inside JSON: bounded too
                        raise InvalidRequestError(f"an assistant tool call's arguments nest JSON deeper "
                                                  f"than {MAX_JSON_DEPTH} levels", param="messages")
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise InvalidRequestError("an assistant tool call's arguments are not JSON",
                                                  param="messages") from None
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls, "content": m.get("content") or ""}
        elif m.get("content") is None:
            m = {**m, "content": ""}
        out.append(m)
    return out
