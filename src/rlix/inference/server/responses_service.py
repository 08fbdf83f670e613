"""The /v1/responses endpoint, for the engine server and the router alike.

A Responses request is read (responses_api.py), continued from its stored parent
(`previous_response_id`), answered by a chat completion through a `ChatBackend` (the engine
server's own serving, or the router's relay to its shards), and its answer stored (unless
`store: false`), whole or streamed (responses_stream.py). Both servers own one
`ResponsesService` with its `ResponseStore`, so the rules (404 for a response not held, what is
stored, `truncation: "auto"`) are one piece of code.

`truncation: "auto"` is honoured with OpenAI's meaning: when the conversation does not fit the
model's context, its oldest turns are dropped (whole turns: a cut is made only where a user
message starts, so a tool call never loses its output, and the instructions always stay) until
it does; the fewest turns are dropped (a binary search, each step a tokenization, no generation).
The request is first sent whole, so a conversation that fits costs nothing more. vLLM 0.32 cuts
tokens instead (its tokenizer's truncation, the prompt's end on Qwen tokenizers), which leaves a
prompt without its generation prompt. What was sent is what is stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from rlix.errors import InvalidRequestError, ResponseNotFoundError, UpstreamAnswerError
from rlix.inference.server import openai_schema as S
from rlix.inference.server import responses_api as R
from rlix.inference.server.limits import check_bounds
from rlix.inference.server.paths import RESPONSES
from rlix.inference.server.responses_store import ResponseStore, StoredResponse
from rlix.inference.server.responses_stream import ResponseEvents

if TYPE_CHECKING:  # the router uses this module and stays without torch (serving.py imports it)
    from rlix.inference.server.serving import OpenAIServing

#: the `param` of the refusal of a prompt that leaves no room in the context (requests.py's)
TOO_LONG_PARAM = "input_tokens"


class ChatBackend(Protocol):
    """Who answers the chat completion a Responses request becomes. A refusal is raised: an
    rlix error (the engine server's own) or UpstreamAnswerError (a shard's answer, relayed)."""

    async def complete(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    async def stream(self, chat: dict[str, Any]) -> AsyncIterator[str]:
        """The chat completion's SSE text; refusals are raised before it starts."""
        ...

    async def prompt_tokens(self, chat: dict[str, Any]) -> tuple[int, int]:
        """(tokens of the chat's rendered prompt, the model's context length)."""
        ...


class EngineChat:
    """The engine server's chat completions as a ChatBackend. `offload`: validate and render
    in a worker thread (a large body: the HTTP loop keeps answering meanwhile, see app.py)."""

    def __init__(self, serving: OpenAIServing, offload: bool = False) -> None:
        self.serving, self.offload = serving, offload

    @staticmethod
    def _request(chat: dict[str, Any]) -> S.ChatCompletionRequest:
        try:
            return S.ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first.get("loc", ()))) or None
            raise InvalidRequestError(f"invalid request: {where + ': ' if where else ''}{first.get('msg')}",
                                      param=where) from None

    async def _job(self, chat: dict[str, Any]) -> Any:
        prepare = lambda: self.serving.prepare_chat(self._request(chat))  # noqa: E731
        return await asyncio.to_thread(prepare) if self.offload else prepare()

    async def complete(self, chat: dict[str, Any]) -> dict[str, Any]:
        return await self.serving.chat(await self._job(chat))

    async def stream(self, chat: dict[str, Any]) -> AsyncIterator[str]:
        return self.serving.chat_stream(await self._job(chat))

    async def prompt_tokens(self, chat: dict[str, Any]) -> tuple[int, int]:
        req = self._request(chat)

        def render() -> int:
            return len(self.serving.render_chat(req.messages, req.add_generation_prompt,
                                                req.continue_final_message, req.chat_template_kwargs,
                                                req.tools if req.tool_choice != "none" else None))

        n = await asyncio.to_thread(render) if self.offload else render()
        return n, self.serving.engine.max_model_len


def _too_long(exc: Exception) -> bool:
    """A refusal of a prompt that leaves no room in the context (ours, or a shard's 400)."""
    if isinstance(exc, UpstreamAnswerError):
        return exc.status == 400 and exc.param == TOO_LONG_PARAM
    return isinstance(exc, InvalidRequestError) and exc.param == TOO_LONG_PARAM


class ResponsesService:
    """Creates and retrieves responses; owns the store (one per server)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def _previous(self, body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        """The conversation `previous_response_id` continues (404 if it is not held, as vLLM)."""
        rid = body.get("previous_response_id")
        if rid is None:
            return ()
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("previous_response_id must be a response's id", param="previous_response_id")
        stored = self.store.get(rid)
        if stored is None:
            raise ResponseNotFoundError(
                f"Response with id '{rid}' not found (never stored, `store: false`, or evicted from this "
                f"server's bounded store of {self.store.limits.max_responses} responses)",
                param="previous_response_id")
        return stored.conversation

    async def create(self, body: dict[str, Any], backend: ChatBackend) -> dict[str, Any] | AsyncIterator[str]:
        """The response (a dict), or its events' SSE text when the request streams. A refusal is
        raised before anything is streamed."""
        check_bounds(RESPONSES, body)  # before the store is asked or anything is rendered
        turn = R.parse(body, self._previous(body))
        if turn.stream:
            chat_sse = await self._send(turn, backend, backend.stream)
            return ResponseEvents(turn, lambda response: self._keep(turn, response)).events(chat_sse)
        response = R.from_chat(await self._send(turn, backend, backend.complete), turn)
        self._keep(turn, response)
        return response

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: a stored response, as it was answered."""
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
        return stored.response

    def _keep(self, turn: R.ResponsesTurn, response: dict[str, Any]) -> None:
        if turn.store:
            conversation = turn.conversation + R.output_messages(response["output"])
            self.store.put(StoredResponse.of(response, conversation))

    async def _send(self, turn: R.ResponsesTurn, backend: ChatBackend, call: Any) -> Any:
        try:
            return await call(turn.chat)
        except (InvalidRequestError, UpstreamAnswerError) as exc:
            if turn.truncation != "auto" or not _too_long(exc):
                raise
            drop = await self._fit(turn, backend)
            if drop is None:
                raise
        turn.conversation = turn.conversation[drop:]
        turn.chat["messages"] = turn.messages()
        return await call(turn.chat)

    async def _fit(self, turn: R.ResponsesTurn, backend: ChatBackend) -> int | None:
        """The fewest leading conversation messages to drop (at a user message: a turn's start)
        for the prompt to leave room for output; None when even the last turn alone does not."""
        cuts = [k for k, m in enumerate(turn.conversation) if k > 0 and m.get("role") == "user"]
        found: int | None = None
        lo, hi = 0, len(cuts) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            n, limit = await backend.prompt_tokens({**turn.chat, "messages": turn.messages(cuts[mid])})
            if n < limit:
                found, hi = cuts[mid], mid - 1
            else:
                lo = mid + 1
        return found
