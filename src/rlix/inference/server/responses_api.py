"""The subset of OpenAI's Responses API that agents use, as a translation to chat completions.

`/v1/responses` takes input messages (or one string), `instructions`, function tools and the
function calls and outputs of earlier turns; it is answered by running the same chat completion
(so the router's stickiness and re-dispatch apply unchanged) and turning its message into
Responses output items: an `output_text` message and one `function_call` item per tool call.
Stateless: `previous_response_id` and streaming are refused with 400 rather than half-served.
vLLM's sampling extras (`ignore_eos`, `seed`, `top_k`, penalties, ...) are passed on to the chat
completion; a field that is neither passed on nor known to change nothing here is refused by name.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.server.limits import check_bounds
from rlix.inference.server.paths import RESPONSES

_ROLES = {"user", "system", "developer", "assistant"}
#: Responses fields with a chat completion field of another name
_RENAMED = {"max_output_tokens": "max_tokens"}
#: fields passed to the chat completion as they are (OpenAI's and vLLM's sampling extras)
_PASSED = ("model", "temperature", "top_p", "tool_choice", "top_k", "seed", "stop", "stop_token_ids",
           "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "skip_special_tokens")
#: fields read here, or that change nothing in a stateless answer (nothing is stored)
_READ = {"input", "instructions", "tools", "stream", "previous_response_id", "metadata", "store", "user",
         "parallel_tool_calls", "truncation", "include", "service_tier"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
                    and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"{where}: only text content parts are supported", param="input")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{where}: content must be a string or a list of text parts", param="input")


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)):
            raise InvalidRequestError(f"tools[{i}]: only function tools ({{'type': 'function', 'name': ...}}) "
                                      "are supported", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat completion request that answers it (its fields bounded
    first: limits.py)."""
    check_bounds(RESPONSES, body)
    if body.get("stream"):
        raise InvalidRequestError("stream is not supported on /v1/responses", param="stream")
    if body.get("previous_response_id"):
        raise InvalidRequestError("previous_response_id is not supported: responses are not stored; "
                                  "send the whole conversation as input", param="previous_response_id")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise InvalidRequestError(f"{where}: role must be one of {sorted(_ROLES)}", param="input")
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not (isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str)):
                raise InvalidRequestError(f"{where}: a function_call needs name and call_id", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # calls of one turn travel as one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{where}: a function_call_output needs call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), where)})
        else:
            raise InvalidRequestError(f"{where}: item type {kind!r} is not supported", param="input")
    chat: dict[str, Any] = {"messages": messages}
    for name, value in body.items():
        if name in _RENAMED or name in _PASSED:
            if value is not None:
                chat[_RENAMED.get(name, name)] = value
        elif name == "text":
            fmt = value.get("format") if isinstance(value, dict) else value
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise InvalidRequestError("text.format: only plain text output is supported", param="text")
        elif name not in _READ:
            raise InvalidRequestError(f"unknown or unsupported field `{name}` on /v1/responses "
                                      "(refused rather than ignored)", param=name)
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat


def from_chat(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion's answer as a Responses object."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = chat.get("usage") or {}
    cut = choice.get("finish_reason") == "length"
    return {
        "id": f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "model": chat.get("model"), "output": output,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": True, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }
