"""Wire shapes of the engine server, copied field by field from what vLLM 0.32 answers.

Requests are pydantic models (unknown fields ignored, as vLLM does); responses are built as
plain dicts in vLLM's key order, so a client (or a test) cannot tell our server from vLLM's.
Fields we never fill (routed_experts, kv_transfer_params...) are present as null, as in vLLM.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlix.errors import EngineStateError, InferenceError, InvalidRequestError

SYSTEM_FINGERPRINT = "rlix"


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Req):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Req):
    """The OpenAI + vLLM sampling fields we honour."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class GenerateSamplingParams(_Req):
    """vLLM's SamplingParams fields that /inference/v1/generate callers use."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None


class GenerateRequest(_Req):
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    model: str | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


class TokenizeRequest(_Req):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Req):
    tokens: list[int]


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def answer_error(status: int, body: bytes | Any, what: str,
                 error: type[InferenceError] = InferenceError) -> InferenceError:
    """The typed error a refusal means, read back from `error_body`'s shape (or any text):
    503 -> EngineStateError (the shard cannot now); 400/404/422 -> InvalidRequestError unless the
    caller names its own class (retrying will not help); anything else -> `error`."""
    try:
        data = json.loads(body) if isinstance(body, bytes) else body
        msg = data["error"]["message"] if isinstance(data.get("error"), dict) else str(data)
    except Exception:  # noqa: BLE001 - not JSON, or not our shape: quote the text
        msg = (body.decode(errors="replace") if isinstance(body, bytes) else str(body))[:500]
    if status == 503:
        return EngineStateError(f"{what}: {msg}")
    if status in (400, 404, 422) and error is InferenceError:
        return InvalidRequestError(f"{what}: {msg}")
    return error(f"{what} answered {status}: {msg}")


def usage(prompt: int, completion: int, *, details: bool = True) -> dict:
    out = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if details:
        out.update(prompt_tokens_details=None, completion_tokens_details=None)
    return out


def weight_spans(spans: list[tuple[int, int]], n_tokens: int) -> list[dict]:
    """Engine (start, version) pairs -> vLLM's [{"version", "start", "end"}] over output indices."""
    out = []
    for i, (start, version) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else n_tokens
        if end > start:
            out.append({"version": str(version), "start": start, "end": end})
    return out


def completion_logprobs(tokens: list[str], logprobs: list[float], offset0: int = 0) -> dict:
    """OpenAI completions logprobs; top_logprobs holds the sampled token only (see server doc)."""
    offsets, pos = [], offset0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)]}


def chat_logprobs(tokens: list[str], logprobs: list[float], top: bool) -> dict:
    content = []
    for tok, lp in zip(tokens, logprobs):
        b = list(tok.encode("utf-8"))
        item = {"token": tok, "logprob": lp, "bytes": b,
                "top_logprobs": [{"token": tok, "logprob": lp, "bytes": b}] if top else []}
        content.append(item)
    return {"content": content}


def generate_logprobs(token_ids: list[int], logprobs: list[float]) -> dict:
    return {"content": [{"token_id": t, "logprob": lp, "rank": None,
                         "top_logprobs": [{"token_id": t, "logprob": lp, "rank": None}]}
                        for t, lp in zip(token_ids, logprobs)]}


def completion_response(rid: str, model: str, text: str, finish: str, stop_reason: Any,
                        logprobs: dict | None, token_ids: list[int] | None,
                        prompt_ids: list[int] | None, n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": None,
                     "prompt_token_ids": prompt_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage(n_prompt, n_out),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     stop_reason: Any, logprobs: dict | None, token_ids: list[int] | None,
                     prompt_ids: list[int] | None, last: bool = False) -> dict:
    """`last`: the finishing chunk with no usage chunk after it carries the fingerprint."""
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": stop_reason, "prompt_token_ids": prompt_ids,
                        "token_ids": token_ids}]}
    if last:
        out["system_fingerprint"] = SYSTEM_FINGERPRINT
    return out


def chat_response(rid: str, model: str, content: str | None, finish: str, stop_reason: Any,
                  logprobs: dict | None, token_ids: list[int] | None,
                  prompt_ids: list[int] | None, n_prompt: int, n_out: int,
                  tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "reasoning": None}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason, "token_ids": token_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage(n_prompt, n_out),
        "prompt_logprobs": None, "prompt_token_ids": prompt_ids, "prompt_text": None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def chat_first_chunk(rid: str, model: str, created: int, prompt_ids: list[int] | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": prompt_ids, "prompt_text": None}


def chat_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
               stop_reason: Any, logprobs: dict | None, token_ids: list[int] | None,
               last: bool = False) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = token_ids
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [choice]}
    if last:
        out["system_fingerprint"] = SYSTEM_FINGERPRINT
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, n_prompt: int, n_out: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(n_prompt, n_out, details=False), "system_fingerprint": SYSTEM_FINGERPRINT}


def generate_response(rid: str, model: str, finish: str, stop_reason: Any, token_ids: list[int],
                      logprobs: dict | None, spans: list[dict], prompt_ids: list[int] | None,
                      n_prompt: int) -> dict:
    return {
        "request_id": rid, "model": model, "created": int(time.time()),
        "usage": usage(n_prompt, len(token_ids)), "prompt_logprobs": None,
        "prompt_token_id_logprobs": None, "prompt_token_ids": prompt_ids, "mm_placeholders": None,
        "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [{"index": 0, "finish_reason": finish, "stop_reason": stop_reason,
                     "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                     "weight_versions": spans, "logprobs": logprobs}],
    }


def generate_chunk(rid: str, finish: str | None, stop_reason: Any, token_ids: list[int],
                   logprobs: dict | None, spans: list[dict] | None,
                   prompt_ids: list[int] | None) -> dict:
    out: dict[str, Any] = {"request_id": rid, "usage": None}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    out["output_mode"] = "tokens"
    out["choices"] = [{"index": 0, "finish_reason": finish, "stop_reason": stop_reason,
                       "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                       "weight_versions": spans, "logprobs": logprobs}]
    return out


def generate_usage_chunk(rid: str, n_prompt: int, n_out: int) -> dict:
    return {"request_id": rid, "usage": usage(n_prompt, n_out, details=False),
            "output_mode": "tokens", "choices": []}


def models_response(name: str, root: str, max_model_len: int, created: int) -> dict:
    perm = {"id": new_id("modelperm"), "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "rlix", "root": root, "parent": None,
                                        "max_model_len": max_model_len, "permission": [perm]}]}
