"""Tool calls in chat completions, hermes-style (the format Qwen2-family templates teach and
vLLM's `hermes` parser reads): the model writes each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the server answers them as OpenAI
`tool_calls` and the text around them as `content`.

A block that is not a JSON object with a string `name` makes the whole answer plain content, as
vLLM's parser does: a half-written call is never executed as if it were one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.httpkit import MAX_JSON_DEPTH, json_too_deep

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


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> bool:
    """Validate a request's `tools` and `tool_choice`; True when the answer should be parsed for
    calls. Forcing a call ("required", a named function) needs guided decoding, which this engine
    does not have: refused with 400 rather than ignored."""
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                      param="tools")
    if tool_choice in (None, "auto", "none"):
        return bool(tools) and tool_choice != "none"
    raise InvalidRequestError(f"tool_choice {tool_choice!r} is not supported (only 'auto' and 'none': forcing "
                              "a call needs guided decoding)", param="tool_choice")


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
