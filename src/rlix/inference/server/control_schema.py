"""Request bodies of the engine server's control plane, validated as the data plane's are.

Unknown fields are ignored (as vLLM does). `parse_body` turns a JSON body into one of these
models or raises `InvalidRequestError` naming the first bad field, so every refusal is a 400
with `param` set and nothing has changed on the engine yet.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from rlix.errors import InvalidRequestError

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AbortRequestsBody(_Body):
    request_ids: list[str] | None = None  # none: abort everything in flight


class InitTransferInfo(_Body):
    """`init_info` of /init_weight_transfer_engine. With a `layout`, buckets are received."""

    model_config = ConfigDict(extra="allow")  # the receiver reads transport-specific keys
    layout: dict[str, Any] | str | None = None
    idle_timeout_s: float | None = Field(None, gt=0)


class InitTransferBody(_Body):
    init_info: InitTransferInfo


class StartWeightUpdateBody(_Body):
    weight_version: int | None = None  # none: the serving version + 1
    layout_id: str | None = None  # set: the update comes as packed buckets
    transfer: dict[str, Any] = Field(default_factory=dict)


class FinishWeightUpdateBody(_Body):
    weight_version: int | None = None


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

    weight_version: int
    layout_id: str = Field(min_length=1)
    transfer: dict[str, Any] = Field(default_factory=dict)
    updates: list[dict[str, Any]] = Field(min_length=1)
    wake_up: StrictBool | list[Literal["weights", "kv_cache"]] = False  # a list: those tags only


class AbortWeightUpdateBody(_Body):
    reason: str | None = None


class RouterShardBody(_Body):
    """POST /router/shards on the router's admin API."""

    rank: int = Field(ge=0, strict=True)
    url: str | None = None
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
