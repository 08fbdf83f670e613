"""A streamed chat completion as the Responses API's server-sent events.

The stream is the chat completion's own (serving.py's `chat_stream` on an engine server, the
relay's on the router, re-dispatch included), read chunk by chunk and re-told as OpenAI's events,
in the order OpenAI and vLLM 0.32 send them:

    response.created, response.in_progress,
    per text item:  response.output_item.added, response.content_part.added,
                    response.output_text.delta ..., response.output_text.done,
                    response.content_part.done, response.output_item.done
    per tool call:  response.output_item.added, response.function_call_arguments.delta,
                    response.function_call_arguments.done, response.output_item.done
    response.completed (its status "incomplete" when max_output_tokens cut the answer, as vLLM
                        sends it; OpenAI would send response.incomplete, which the Agents SDK
                        treats as a failure)

each as `event: TYPE` and `data: {...}` with `type` and `sequence_number` (0, 1, ...), no [DONE].
An error after the stream began (the chat stream's error event) becomes an `error` event that
ends the stream, as vLLM's. The completed response's items are the streamed ones (same ids), so
a client that rebuilds the response from the events (the openai client's `responses.stream`)
finds the final object consistent with them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from rlix.inference.server import responses_api as R


def event_text(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _chunks(text: str) -> list[dict[str, Any] | None]:
    """The JSON objects in a piece of chat SSE text (None for [DONE]); one piece may hold
    several events (an error event and [DONE] travel together)."""
    out: list[dict[str, Any] | None] = []
    for line in text.split("\n"):
        if not line.startswith("data: "):
            continue
        payload = line[6:].strip()
        out.append(None if payload == "[DONE]" else json.loads(payload))
    return out


def _stream_logprobs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat logprob items in the shape a text delta carries them (no bytes, OpenAI's)."""
    return [{"token": lp["token"], "logprob": lp["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp.get("top_logprobs") or []]}
            for lp in items]


class ResponseEvents:
    """Re-tells one chat stream as Responses events; `on_done(response)` is called with the
    completed response object (the caller stores it) before the last event is sent."""

    def __init__(self, turn: R.ResponsesTurn, on_done: Callable[[dict[str, Any]], None]) -> None:
        self.turn, self.on_done = turn, on_done
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.model: str | None = turn.body.get("model")
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self._msg_id: str | None = None  # the text item open now
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta

    def _event(self, type_: str, **fields: Any) -> str:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event_text(event)

    def _lifecycle(self, type_: str, status: str, output: list[dict[str, Any]],
                   usage: dict[str, Any] | None) -> str:
        return self._event(type_, response=R.response_object(self.turn, output, status, usage, self.model))

    async def events(self, chat_sse: AsyncIterator[str]) -> AsyncIterator[str]:
        """The events' SSE text. Closed early (the caller went away), it closes the chat
        stream now, which aborts the request (rather than whenever the collector finds it)."""
        try:
            yield self._lifecycle("response.created", "in_progress", [], None)
            yield self._lifecycle("response.in_progress", "in_progress", [], None)
            async for piece in chat_sse:
                for chunk in _chunks(piece):
                    if chunk is None:
                        continue
                    if "error" in chunk:
                        for text in self._close_text():
                            yield text
                        yield self._error(chunk["error"])
                        return
                    for text in self._chunk(chunk):
                        yield text
        finally:
            aclose = getattr(chat_sse, "aclose", None)
            if aclose is not None:
                await aclose()
        for text in self._close_text():
            yield text
        status = R.status_of(self.finish)
        n_prompt = (self.usage or {}).get("prompt_tokens", 0)
        n_out = (self.usage or {}).get("completion_tokens", 0)
        response = R.response_object(self.turn, self.output, status, R.usage(n_prompt, n_out), self.model)
        self.on_done(response)
        yield self._event("response.completed", response=response)

    def _error(self, error: Any) -> str:
        err = error if isinstance(error, dict) else {"message": str(error)}
        return self._event("error", code=str(err.get("code") or err.get("type") or "error"),
                           message=str(err.get("message")), param=err.get("param"))

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        self.model = chunk.get("model") or self.model
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if self.turn.logprobs:
                # a token whose text is held back (part of a character) sends its logprob with
                # no text: it goes with the next text, as the whole answer lists it
                self._pending += (choice.get("logprobs") or {}).get("content") or []
            if content:
                out += self._text_delta(content)
            for call in delta.get("tool_calls") or []:
                out += self._close_text()
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text_delta(self, text: str) -> list[str]:
        out: list[str] = []
        logprobs, self._pending = self._pending, []
        index = len(self.output)
        if self._msg_id is None:
            self._msg_id = f"msg_{secrets.token_hex(16)}"
            self._text, self._logprobs = [], []
            out.append(self._event("response.output_item.added", output_index=index,
                                   item=R.message_item("", [], self._msg_id, status="in_progress")))
            out.append(self._event("response.content_part.added", item_id=self._msg_id, output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        self._text.append(text)
        self._logprobs += logprobs
        out.append(self._event("response.output_text.delta", item_id=self._msg_id, output_index=index,
                               content_index=0, delta=text, logprobs=_stream_logprobs(logprobs)))
        return out

    def _close_text(self) -> list[str]:
        if self._msg_id is None:
            return []
        index, item_id = len(self.output), self._msg_id
        out: list[str] = []
        if self._pending:  # the answer's last tokens wrote no text: their logprobs still count
            out += self._text_delta("")
        text = "".join(self._text)
        item = R.message_item(text, self._logprobs if self.turn.logprobs else None, item_id)
        part = item["content"][0]
        self._msg_id = None
        self.output.append(item)
        return out + [
            self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                        text=text, logprobs=_stream_logprobs(self._logprobs)),
            self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """One whole tool call (the chat stream sends a call once its block has closed)."""
        fn = call.get("function") or {}
        index, item_id = len(self.output), f"fc_{secrets.token_hex(16)}"
        name, args = fn.get("name") or "", fn.get("arguments") or ""
        call_id = call.get("id") or f"call_{secrets.token_hex(12)}"
        item = R.call_item(call_id, name, args, item_id)
        self.output.append(item)
        return [
            self._event("response.output_item.added", output_index=index,
                        item=R.call_item(call_id, name, "", item_id, status="in_progress")),
            self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                        delta=args),
            self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                        name=name, arguments=args),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
