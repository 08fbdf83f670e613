"""The policy endpoint a pipeline's agents call: chat completions, token in and token out.

An agent sends OpenAI chat messages; the gateway renders them with the model's chat template,
generates through the pipeline's router (session-sticky, re-dispatched on preemption) at the
pipeline's own sampling settings, and answers an OpenAI chat completion (hermes tool calls
parsed). It records, per episode (`X-Session-ID`), every turn's exact prompt ids, the sampled
ids, their logprobs and weight versions.

Why token-exact: re-tokenising an assistant's text seldom gives back the ids it sampled (BPE
merges differ), so a training sample built from text would not be what the policy generated.
Here turn k+1's prompt is turn k's prompt + its sampled ids + the new context (the rest of the
template's closing after the assistant's end token, then the new messages), each tokenised once.
That holds only while the agent extends the conversation it was answered with; if it edits
history (or the template does not render as a prefix), the episode is marked broken, still
served, and dropped by the collector with the reason.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.router.router import Generation, VersionSpan
from rlix.inference.server.openai_schema import ROLES, GenerateSamplingParams
from rlix.inference.server.responses_api import from_chat, parse
from rlix.inference.server.tool_calls import check_tools, parse_tool_calls, template_messages

#: (prompt token ids, sampling params, session id) -> the answer; the pipeline's router
Generate = Callable[[list[int], GenerateSamplingParams, str | None], Awaitable[Generation]]

_PROBE = "\x00rlix-probe\x00"


@dataclass
class Turn:
    """One policy call of an episode, as the engine answered it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[VersionSpan]
    finish_reason: str


@dataclass
class EpisodeTrace:
    session_id: str
    seed: int | None = None
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # incl. the last answer given
    tools: list[dict[str, Any]] | None = None
    broken: str | None = None  # why its turns cannot be stitched exactly (first reason)
    busy: bool = False

    def mark_broken(self, reason: str) -> None:
        if self.broken is None:
            self.broken = f"turn {len(self.turns) + 1}: {reason}"


def _norm_message(m: dict[str, Any]) -> tuple:
    """What makes two chat messages the same turn (ids of tool calls and argument spacing aside)."""
    calls = tuple((c.get("function", {}).get("name"), _norm_args(c.get("function", {}).get("arguments")))
                  for c in m.get("tool_calls") or [])
    return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"), m.get("name"))


def _norm_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True)


class PolicyGateway:
    """See module doc. `sampling` is the pipeline's (temperature, max_tokens); the agent's own
    sampling fields are ignored, so every turn is sampled as the trainer assumes."""

    def __init__(self, generate: Generate, tokenizer: Any, model_name: str, *, temperature: float,
                 max_tokens: int) -> None:
        self.generate, self.tok, self.model_name = generate, tokenizer, model_name
        self.temperature, self.max_tokens = float(temperature), int(max_tokens)
        self._traces: dict[str, EpisodeTrace] = {}
        self._lock = threading.Lock()  # open/take come from the collector's thread
        self.closing = self._closing()
        self.requests = 0

    # ------------------------------------------------------------------ episodes
    def open(self, session_id: str, seed: int | None = None) -> None:
        """Record the episode `session_id` from its first call on."""
        with self._lock:
            self._traces[session_id] = EpisodeTrace(session_id, seed)

    def take(self, session_id: str) -> EpisodeTrace:
        """The episode's record, closed: later calls in that session are refused (400)."""
        with self._lock:
            trace = self._traces.pop(session_id, None)
        if trace is None:
            raise KeyError(f"no open episode {session_id!r}")
        return trace

    def discard(self, session_id: str) -> None:
        with self._lock:
            self._traces.pop(session_id, None)

    def turns_left(self, max_turns: int) -> int:
        """Policy calls the open episodes may still make."""
        with self._lock:
            return sum(max(max_turns - len(t.turns), 0) for t in self._traces.values())

    def open_episodes(self) -> int:
        with self._lock:
            return len(self._traces)

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, prompt: bool) -> str:
        return self.tok.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                            add_generation_prompt=prompt)

    def _closing(self) -> str:
        """What the template writes after an assistant's content (`<|im_end|>\\n` for ChatML)."""
        text = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
                            None, False)
        return text.split(_PROBE, 1)[1] if _PROBE in text else ""

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, trace: EpisodeTrace, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """Turn k+1's prompt, stitched to turn k's exact tokens where the conversation allows."""
        text_all = self._render(messages, tools, True)
        if trace.turns:
            text_prev = self._render(trace.messages, tools, False)
            reason = self._stitch_problem(trace, messages, tools, text_prev, text_all)
            if reason is None:
                last = trace.turns[-1]
                rest = self.closing
                end = self.tok.decode(last.token_ids[-1:], skip_special_tokens=False) if last.token_ids else ""
                if end and last.token_ids[-1] in self.tok.all_special_ids and rest.startswith(end):
                    rest = rest[len(end):]  # the model wrote the end token itself
                return last.prompt_ids + last.token_ids + self._encode(rest + text_all[len(text_prev):])
            trace.mark_broken(reason)
        return self._encode(text_all)

    def _stitch_problem(self, trace: EpisodeTrace, messages: list[dict[str, Any]], tools: list[dict] | None,
                        text_prev: str, text_all: str) -> str | None:
        prev = trace.messages
        if (tools or None) != (trace.tools or None):
            return "the tools changed between turns"
        if len(messages) <= len(prev):
            return f"{len(messages)} messages do not extend the {len(prev)} of the previous turn"
        for i, (a, b) in enumerate(zip(prev, messages)):
            if _norm_message(a) != _norm_message(b):
                return f"message {i} differs from what the previous turn saw or answered"
        if not text_all.startswith(text_prev) or not text_prev.endswith(self.closing):
            return "the chat template does not render the conversation as a prefix of the next prompt"
        return None

    # ------------------------------------------------------------------ serving
    async def chat(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        """One chat completion for the episode `session_id` (InvalidRequestError -> 400)."""
        messages, tools = self._check(body)
        if not session_id:
            raise InvalidRequestError("the policy endpoint needs an X-Session-ID header (one per episode)")
        with self._lock:
            trace = self._traces.get(session_id)
        if trace is None:
            raise InvalidRequestError(f"session {session_id!r} is not an open episode (it ended or was never "
                                      "started by the pipeline)")
        if trace.busy:
            trace.mark_broken("a second call while the previous one was in flight")
        parse = check_tools(tools, body.get("tool_choice"))
        ids = self.prompt_ids(trace, messages, tools)
        params = GenerateSamplingParams(
            temperature=self.temperature, max_tokens=self.max_tokens, logprobs=1,
            seed=None if trace.seed is None else (trace.seed + len(trace.turns)) % (1 << 31))
        trace.busy = True
        self.requests += 1
        try:
            gen = await self.generate(ids, params, session_id)
        finally:
            trace.busy = False
        text = self.tok.decode(gen.token_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text) if parse else (text, [])
        finish = "tool_calls" if calls else ("length" if gen.finish_reason == "length" else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        trace.turns.append(Turn(ids, list(gen.token_ids), list(gen.logprobs), list(gen.weight_versions),
                                gen.finish_reason))
        trace.messages = [*messages, message]
        trace.tools = tools
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                          "total_tokens": len(ids) + len(gen.token_ids)}}

    async def responses(self, body: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        """The Responses API (see server/responses_api.py), on the same path as chat. The episode
        is the conversation: nothing is stored, so previous_response_id is refused (and
        streaming, as on chat)."""
        if body.get("previous_response_id") is not None:
            raise InvalidRequestError("the policy endpoint keeps no responses: send the whole conversation",
                                      param="previous_response_id")
        turn = parse(body)
        return from_chat(await self.chat(turn.chat, session_id), turn)

    @staticmethod
    def _check(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict] | None]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects",
                                      param="messages")
        unknown = next((i for i, m in enumerate(messages) if m["role"] not in ROLES), None)
        if unknown is not None:
            raise InvalidRequestError(f"messages[{unknown}].role {messages[unknown]['role'][:40]!r} is not one "
                                      f"of {', '.join(sorted(ROLES))}", param="messages")
        if body.get("stream"):
            raise InvalidRequestError("the policy endpoint does not stream", param="stream")
        if body.get("n", 1) != 1:
            raise InvalidRequestError("n must be 1 (one episode, one answer per turn)", param="n")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list", param="tools")
        return messages, tools
