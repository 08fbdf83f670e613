"""OpenAI's Responses API as a translation to chat completions and back (the request and the answer).

`/v1/responses` takes input items (or one string), `instructions`, function tools and the items
of earlier turns (messages, function calls and their outputs, reasoning); it is answered by the
same chat completion (so the router's stickiness and re-dispatch, the chat template and the
tool-call parser apply unchanged) and its message turned into output items: an `output_text`
message (with logprobs when `include` asks) and one `function_call` item per tool call.

Field policy (docs/INFERENCE_SERVING.md has the table against vLLM): a field that exists on chat
completions too (sampling, identifiers, vLLM's extras) is passed on under its chat name, so the
chat endpoint's rule for it applies here unchanged (accepted, honoured or refused the same way on
both); the Responses fields are read here (`_OWN`); anything else is refused by name rather than
ignored. The store (`previous_response_id`), streaming and the endpoint itself are in
responses_service.py; the streamed events in responses_stream.py.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.server.limits import MAX_MESSAGES, check_bounds
from rlix.inference.server.paths import RESPONSES

_ROLES = {"user", "system", "developer", "assistant"}
#: Responses fields with a chat completion field of another name
_RENAMED = {"max_output_tokens": "max_tokens"}
#: fields passed to the chat completion as they are: the chat endpoint's rule decides each
_PASSED = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "skip_special_tokens",
    "include_stop_str_in_output", "min_tokens", "parallel_tool_calls", "user", "metadata",
    "service_tier", "prompt_cache_key", "safety_identifier", "priority", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "structured_outputs",
    "chat_template_kwargs", "return_tokens_as_token_ids",
})
#: the Responses API's own fields, read here (vLLM 0.32's ResponsesRequest names them all)
_OWN = frozenset({
    "input", "instructions", "tools", "tool_choice", "stream", "store", "background",
    "previous_response_id", "include", "top_logprobs", "truncation", "reasoning", "max_tool_calls",
    "text", "request_id", "prompt", "include_reasoning", "enable_response_messages",
    "previous_input_messages", "watermarking", "session_id", "mm_payload", "return_mm_kwargs",
    "media_io_kwargs", "ec_transfer_params",
})
#: `include` values vLLM accepts. Only the logprobs one adds anything here: the others name
#: items this server never produces (built-in tool calls, images, encrypted reasoning)
INCLUDES = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: `reasoning.effort` values (OpenAI's); vLLM passes the effort to the chat template
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
#: an input message part's text types (a part of another type, an image, is refused)
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesTurn:
    """One Responses request, read: the chat completion that answers it and what its answer
    needs. `conversation` is every chat message of the conversation so far (a stored parent's,
    then this request's input), the instructions excepted: what the store keeps to continue."""

    body: dict[str, Any]
    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    truncation: str = "disabled"
    response_id: str = ""  # minted here: the first streamed event names it
    created_at: int = field(default_factory=lambda: int(time.time()))

    def messages(self, drop: int = 0) -> list[dict[str, Any]]:
        """The chat messages sent: the instructions, then the conversation less its first
        `drop` messages (`truncation: "auto"` drops the oldest)."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + self.conversation[drop:]


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])  # an earlier answer's refusal is what it said
                continue
            if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS
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


def _tool_choice(choice: Any) -> Any:
    """Responses' tool_choice in chat's shape (a named function is `{"type": "function", "name"}`
    in Responses, `{"type": "function", "function": {"name"}}` in chat); the chat endpoint's
    rule then applies."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(value: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text, nothing to send)."""
    fmt = value.get("format") if isinstance(value, dict) else None
    if value is not None and not isinstance(value, dict):
        raise InvalidRequestError("text must be an object ({'format': {...}})", param="text")
    for key, setting in (value or {}).items():
        if key != "format" and setting is not None:  # `verbosity`: chat's, refused there too
            raise InvalidRequestError(f"text.{key} is not supported (leave it out)", param=f"text.{key}")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError("text.format must be text, json_object or json_schema", param="text")


def _reasoning_kwargs(reasoning: Any, kwargs: Any) -> dict[str, Any] | None:
    """`reasoning` as vLLM reads it: its effort goes to the chat template (`reasoning_effort`,
    and `enable_thinking` unless the request sets it), for templates that read them."""
    if reasoning is None:
        return kwargs
    if not isinstance(reasoning, dict):
        raise InvalidRequestError("reasoning must be an object ({'effort': ...})", param="reasoning")
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise InvalidRequestError(f"reasoning.{sorted(unknown)[0]} is not a reasoning field", param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise InvalidRequestError(f"reasoning.effort must be one of {sorted(EFFORTS)}", param="reasoning.effort")
    out = dict(kwargs) if isinstance(kwargs, dict) else {}
    out["reasoning_effort"] = effort
    out.setdefault("enable_thinking", effort != "none")
    return out


class _Messages:
    """Input items -> chat messages, an assistant's turn kept as one message: its reasoning,
    text and tool calls arrive as separate items (in that order) and go into the message that
    the first of them opened, as vLLM joins them."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []

    def _assistant(self, key: str) -> dict[str, Any] | None:
        """The last message, if it is an assistant's turn that has no `key` yet."""
        last = self.out[-1] if self.out else None
        if last is not None and last["role"] == "assistant" and last.get(key) is None:
            return last
        return None

    def add(self, i: int, item: Any) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequestError(f"{where}: role must be one of {sorted(_ROLES)}", param="input")
            text = _text(item.get("content"), where)
            if role == "assistant":
                open_turn = self._assistant("content")
                if open_turn is not None and not open_turn.get("tool_calls"):
                    open_turn["content"] = text  # after its reasoning
                    return
            self.out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not (isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str)):
                raise InvalidRequestError(f"{where}: a function_call needs name and call_id", param="input")
            args = item.get("arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": args if isinstance(args, str) and args else "{}"}}
            last = self.out[-1] if self.out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", [])
                if last["tool_calls"] is None:
                    last["tool_calls"] = []
                last["tool_calls"].append(call)  # the calls of one turn travel as one message
            else:
                self.out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"{where}: a function_call_output needs call_id", param="input")
            self.out.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), where)})
        elif kind == "reasoning":
            self._reasoning(item, where)
        else:
            raise InvalidRequestError(f"{where}: item type {kind!r} is not supported", param="input")

    def _reasoning(self, item: dict[str, Any], where: str) -> None:
        """A reasoning item passed back: its text (content, else its summary) on the turn's
        assistant message as `reasoning` (and `reasoning_content`, the name most templates
        read), as vLLM renders it; a template that ignores both drops it. Encrypted reasoning
        cannot be read back here: refused, as vLLM refuses it."""
        if item.get("encrypted_content"):
            raise InvalidRequestError(f"{where}: encrypted reasoning content is not supported", param="input")
        text = ""
        for key in ("content", "summary"):
            parts = item.get(key)
            if isinstance(parts, list) and parts:
                first = parts[0]
                if not (isinstance(first, dict) and isinstance(first.get("text"), str)):
                    raise InvalidRequestError(f"{where}.{key}[0] needs text", param="input")
                text = first["text"]
                break
        open_turn = self._assistant("reasoning")
        if open_turn is not None:
            open_turn["reasoning"] = open_turn["reasoning_content"] = text
        else:
            self.out.append({"role": "assistant", "content": None, "reasoning": text, "reasoning_content": text})


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """A request's `input` (a string, or a list of items) as chat messages."""
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input must be a string or a non-empty list of items", param="input")
    messages = _Messages()
    for i, item in enumerate(items):
        messages.add(i, item)
    return messages.out


def _continues(raw: Any) -> bool:
    """The input ends with an assistant message still in progress: the answer continues it
    (vLLM's partial-message completion) instead of starting a new turn."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[-1], dict):
        return False
    last = raw[-1]
    return (last.get("type", "message") == "message" and last.get("role") == "assistant"
            and last.get("status") in ("in_progress", "incomplete"))


def _refuse_set(body: dict[str, Any], name: str, allowed: Any = (None,), why: str = "") -> None:
    value = body.get(name)
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise InvalidRequestError(f"`{name}` is not supported on /v1/responses{why}", param=name)


def _include(body: dict[str, Any]) -> bool:
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or len(include) > len(INCLUDES):
        raise InvalidRequestError(f"include must be a list of at most {len(INCLUDES)} of "
                                  f"{sorted(INCLUDES)}", param="include")
    for value in include:
        if value not in INCLUDES:
            raise InvalidRequestError(f"include: {str(value)[:80]!r} is not one of {sorted(INCLUDES)}",
                                      param="include")
    return LOGPROBS_INCLUDE in include


def parse(body: dict[str, Any], previous: tuple[dict[str, Any], ...] = ()) -> ResponsesTurn:
    """A Responses request as the chat completion that answers it (its fields bounded first:
    limits.py). `previous`: the stored conversation `previous_response_id` continues."""
    check_bounds(RESPONSES, body)
    for name in body:
        if name not in _OWN and name not in _PASSED and name not in _RENAMED:
            raise InvalidRequestError(f"unknown or unsupported field `{name}` on /v1/responses "
                                      "(refused rather than ignored)", param=name)
    _refuse_set(body, "background", (None, False),
                ": background responses are not run here (send the request and wait, or stream it)")
    _refuse_set(body, "prompt", why=": prompt templates are not supported (vLLM refuses them too)")
    _refuse_set(body, "previous_input_messages", (None, []),
                " (Harmony message history): send input items or use previous_response_id")
    _refuse_set(body, "enable_response_messages", (None, False),
                ": raw input/output messages are not returned by this server")
    _refuse_set(body, "watermarking", (None, False))
    _refuse_set(body, "media_io_kwargs", (None, {}), ": no media inputs here")
    _refuse_set(body, "ec_transfer_params", (None, {}))
    for name in ("stream", "store", "include_reasoning"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequestError(f"{name} must be a boolean", param=name)
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise InvalidRequestError("truncation must be 'auto' or 'disabled'", param="truncation")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise InvalidRequestError("top_logprobs must be an integer >= 0", param="top_logprobs")
    # (its upper bound is the chat endpoint's, which refuses more under the same name)
    calls = body.get("max_tool_calls")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
        raise InvalidRequestError("max_tool_calls must be an integer >= 0", param="max_tool_calls")
    # top_logprobs > 0 asks for alternatives, so for logprobs too (vLLM would drop it unasked)
    logprobs = _include(body) or bool(top)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        instructions = _text(instructions, "instructions")
    conversation = [dict(m) for m in previous] + input_messages(body.get("input"))
    if len(conversation) > MAX_MESSAGES:
        raise InvalidRequestError(f"the conversation holds {len(conversation)} messages with its earlier "
                                  f"turns; at most {MAX_MESSAGES} are accepted", param="previous_response_id")
    chat: dict[str, Any] = {}
    for name, value in body.items():
        if (name in _PASSED or name in _RENAMED) and value is not None:
            chat[_RENAMED.get(name, name)] = value
    kwargs = _reasoning_kwargs(body.get("reasoning"), chat.get("chat_template_kwargs"))
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if logprobs:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    if turn_stream := bool(body.get("stream")):  # usage comes in the stream's last chunk
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    if _continues(body.get("input")):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    rid = body.get("request_id")
    turn = ResponsesTurn(body=body, chat=chat, conversation=conversation, instructions=instructions or None,
                         stream=turn_stream, store=body.get("store") is not False,
                         logprobs=logprobs, top_logprobs=top or 0, truncation=truncation,
                         response_id=rid if isinstance(rid, str) and rid else f"resp_{secrets.token_hex(16)}")
    turn.chat["messages"] = turn.messages()
    return turn


# ---------------------------------------------------------------- answers
def message_item(text: str, logprobs: list[dict] | None, item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": item_id or f"msg_{secrets.token_hex(16)}", "status": status,
            "role": "assistant", "content": [part] if text else []}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or f"fc_{secrets.token_hex(16)}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def usage(prompt: int, output: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def response_object(turn: ResponsesTurn, output: list[dict[str, Any]], status: str,
                    usage_: dict[str, Any] | None, model: str | None = None) -> dict[str, Any]:
    """The Responses object, in vLLM 0.32's keys and order (no `error`: vLLM sends none, and
    OpenAI's clients read it as null); the request's settings echoed as sent (vLLM echoes its
    resolved defaults: temperature 1.0...)."""
    body = turn.body
    return {
        "id": turn.response_id, "created_at": turn.created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "model": model or body.get("model"), "object": "response", "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"), "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "background": False,
        "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"), "prompt": None,
        "reasoning": body.get("reasoning"), "service_tier": body.get("service_tier") or "auto",
        "status": status, "text": body.get("text") or {"format": {"type": "text"}},
        "top_logprobs": turn.top_logprobs, "truncation": turn.truncation, "usage": usage_,
        "user": body.get("user"), "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"), "kv_transfer_params": None,
        "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }


def status_of(finish: str | None) -> str:
    """A chat finish reason as a response's status (vLLM's rule: only a cut is not complete)."""
    return "incomplete" if finish == "length" else "completed"


def from_chat(chat: dict[str, Any], turn: ResponsesTurn) -> dict[str, Any]:
    """The chat completion's answer as a Responses object."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("content"):
        lps = (choice.get("logprobs") or {}).get("content") if turn.logprobs else None
        output.append(message_item(message["content"], lps if turn.logprobs else None))
    for call in message.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    u = chat.get("usage") or {}
    return response_object(turn, output, status_of(choice.get("finish_reason")),
                           usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)), chat.get("model"))


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat message that continues the conversation (none if
    the answer was empty): its text and its calls, one assistant turn."""
    text = "".join(p.get("text", "") for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
