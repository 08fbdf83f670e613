"""The Responses API's memory: stored responses, for `previous_response_id` and GET /v1/responses/{id}.

OpenAI keeps a response unless the request says `store: false`; a client (the Agents SDK with
its `previous_response_id` mode, a chat UI) then sends only the new turn. vLLM 0.32 has the same
API but keeps responses only when VLLM_ENABLE_RESPONSES_API_STORE is set, and then forever (its
own code warns about the leak). Here the store is always on and bounded: by the number of
responses and by their bytes (the JSON of the response and of the conversation kept to continue
it), the least recently used going first. A continuation reads its parent, which moves it to the
back, so a live conversation is not evicted by a burst of one-shot requests.

One store per server (the engine server's app, or the router's, which answers /v1/responses for
all its shards: a conversation continues on whatever shard the router picks). It lives on the
server's event loop and is touched only from there, so it needs no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: responses kept by default (`--responses-store-max`)
DEFAULT_MAX_RESPONSES = 1024
#: bytes of JSON kept by default (`--responses-store-mib`): responses and their conversations
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoreLimits:
    """How much the store keeps; either bound evicts the least recently used responses."""

    max_responses: int = DEFAULT_MAX_RESPONSES
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_responses < 0 or self.max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0 (0 keeps nothing)")


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the object GET returns, and the conversation a continuation starts
    from (chat messages: every earlier turn's input and output, this one's too; never the
    `instructions`, which OpenAI does not carry over to the next response)."""

    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    size: int  # bytes of JSON, what the byte bound counts

    @classmethod
    def of(cls, response: dict[str, Any], conversation: list[dict[str, Any]]) -> StoredResponse:
        size = (len(json.dumps(response, separators=(",", ":")))
                + len(json.dumps(conversation, separators=(",", ":"))))
        return cls(response, tuple(conversation), size)


class ResponseStore:
    """Stored responses by id, least recently used first; bounded by `StoreLimits`."""

    def __init__(self, limits: StoreLimits = StoreLimits()) -> None:
        self.limits = limits
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self.evicted = 0  # responses dropped to make room (a test's and an operator's check)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry` under its response's id, evicting the least recently used to make room.
        False when it alone is larger than the whole store (kept nothing, evicted nothing)."""
        rid = entry.response["id"]
        if entry.size > self.limits.max_bytes or self.limits.max_responses == 0:
            return False
        old = self._entries.pop(rid, None)
        if old is not None:
            self._bytes -= old.size
        while self._entries and (len(self._entries) >= self.limits.max_responses
                                 or self._bytes + entry.size > self.limits.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
            self.evicted += 1
        self._entries[rid] = entry
        self._bytes += entry.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None if never stored or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry
