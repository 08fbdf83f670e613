"""Request bodies of the engine server's control plane, validated as the data plane's are.

Unknown fields are ignored (as vLLM does), except on the endpoints whose parameters are in the
query string (`QueryOnlyBody`). `parse_body` turns a JSON body into one of these models or raises
`InvalidRequestError` naming the first bad field, so every refusal is a 400 with `param` set and
nothing has changed on the engine yet. Every field is bounded (server/limits.py says why): a
list's length, a string's characters, a number's range.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from rlix.errors import InvalidRequestError
from rlix.httpkit import MAX_JSON_DEPTH, json_too_deep
from rlix.inference.server.limits import (MAX_ABORT_IDS, MAX_BUCKETS, MAX_ID_CHARS, MAX_KEYS,
                                          MAX_TRANSFER_BODY_BYTES, at_most)

M = TypeVar("M", bound=BaseModel)

Name = Annotated[str, Field(max_length=MAX_ID_CHARS)]
#: a weight version (the trainer's step): torch's long, as every version a shard reports
Version = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Details = Annotated[dict[str, Any], at_most(MAX_KEYS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class QueryOnlyBody(_Body):
    """The body of /pause, /resume, /sleep and /wake_up, whose parameters are in the query
    string (as in vLLM): empty or `{}`. Anything else is refused before the engine is touched:
    a body the server ignored would let a malformed call sleep the engine."""

    model_config = ConfigDict(extra="forbid")


class AbortRequestsBody(_Body):
    # none: abort everything in flight
    request_ids: Annotated[list[Name], Field(max_length=MAX_ABORT_IDS, fail_fast=True)] | None = None


class InitTransferInfo(_Body):
    """`init_info` of /init_weight_transfer_engine. With a `layout`, buckets are received."""

    model_config = ConfigDict(extra="allow")  # the receiver reads transport-specific keys
    layout: dict[str, Any] | Annotated[str, Field(max_length=MAX_TRANSFER_BODY_BYTES)] | None = None
    idle_timeout_s: float | None = Field(None, gt=0)

    @field_validator("layout")
    @classmethod
    def _shallow(cls, v: Any) -> Any:
        """A layout given as JSON text is parsed by the receiver: bounded as bodies are."""
        if isinstance(v, str) and json_too_deep(v.encode(), MAX_JSON_DEPTH):
            raise ValueError(f"the layout nests JSON deeper than {MAX_JSON_DEPTH} levels")
        return v


class InitTransferBody(_Body):
    init_info: InitTransferInfo


class StartWeightUpdateBody(_Body):
    weight_version: Version | None = None  # none: the serving version + 1
    layout_id: Name | None = None  # set: the update comes as packed buckets
    transfer: Details = Field(default_factory=dict)


class FinishWeightUpdateBody(_Body):
    weight_version: Version | None = None


class BucketUpdateInfo(_Body):
    """`update_info` of a bucket message: plain JSON, or pickled (CUDA IPC handles)."""

    model_config = ConfigDict(extra="allow")
    bucket: int | None = None
    message_b64: str | None = None
    safetensors_b64: str | None = None


class UpdateWeightsBody(_Body):
    update_info: BucketUpdateInfo


class SyncWeightsBody(_Body):
    """rlix's one-call sync: [wake,] start, every bucket message, finish."""

    weight_version: Version
    layout_id: Name = Field(min_length=1)
    transfer: Details = Field(default_factory=dict)
    updates: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BUCKETS, fail_fast=True)
    # a list: those tags only
    wake_up: StrictBool | Annotated[list[Literal["weights", "kv_cache"]], Field(max_length=2)] = False


class AbortWeightUpdateBody(_Body):
    reason: Name | None = None


class RouterShardBody(_Body):
    """POST /router/shards on the router's admin API."""

    rank: int = Field(ge=0, le=2**20, strict=True)
    url: Name | None = None
    state: Literal["active", "inactive", "preempted"] | None = None


def parse_body(model: type[M], body: Any) -> M:
    """`body` (decoded JSON; None for an empty body) as `model`, or an InvalidRequestError."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InvalidRequestError("Request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or None
        raise InvalidRequestError(f"{where}: {first.get('msg')}" if where else str(first.get("msg")),
                                  param=where) from None


async def json_body(request: Request, required: bool = False) -> Any:
    """The request's body as JSON (None when empty and not `required`), or an InvalidRequestError;
    its size and nesting were bounded by the RequestGuard before it was read."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidRequestError("Invalid JSON format")
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InvalidRequestError("Invalid JSON format") from None
