"""Wire shapes of the engine server, copied field by field from what vLLM 0.32 answers.

Requests are pydantic models. Unlike vLLM, which ignores what it does not know, a generation
request with a field this server does not implement is refused (400 naming the field, see
`refuse_unsupported`): a field that changes nothing at the value sent (`user`, `store: false`,
`response_format: {"type": "text"}`...) passes, anything else would have been silently ignored.
Responses are built as plain dicts in vLLM's key order, so a client (or a test) cannot tell our
server from vLLM's. Fields we never fill (routed_experts, kv_transfer_params...) are present as
null, as in vLLM.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from rlix.errors import EngineStateError, InferenceError, InvalidRequestError
from rlix.httpkit import capped
from rlix.inference.server.limits import (MAX_ID_CHARS, MAX_KEYS, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_N,
                                          MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, MAX_PROMPTS, MAX_SEED,
                                          MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOKENS,
                                          MAX_TOOLS, MAX_TOP_K, MIN_SEED, at_most)
from rlix.version import package_version

SYSTEM_FINGERPRINT = "rlix"


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Checked(BaseModel):
    """A request whose unknown fields are kept (in model_extra) to be refused by name."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Checked):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


def _any(_: Any) -> bool:
    return True


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


#: Fields that change nothing here at the values these predicates accept (identifiers,
#: metadata, a feature left at its default), shared by both text endpoints; any other value is
#: refused (400 naming the field) instead of being silently ignored.
INERT: dict[str, Callable[[Any], bool]] = {
    "user": _any, "metadata": _any, "prompt_cache_key": _any, "safety_identifier": _any,
    "request_id": _any, "cache_salt": _any,  # identifiers (vLLM's request_id: we make our own)
    "store": _is(False), "service_tier": _is("auto", "default"), "priority": _is(0),
    "min_p": _is(0, 0.0), "use_beam_search": _is(False), "length_penalty": _is(1, 1.0),
    "spaces_between_special_tokens": _is(True), "truncate_prompt_tokens": _unset,
    "logprob_token_ids": _unset, "allowed_token_ids": _unset,
    "bad_words": _unset, "guided_json": _unset,
    "guided_regex": _unset, "guided_choice": _unset, "guided_grammar": _unset,
    "guided_decoding_backend": _unset, "kv_transfer_params": _unset, "vllm_xargs": _unset,
    "mm_processor_kwargs": _unset, "thinking_token_budget": _unset, "logits_processors": _unset,
}
#: ... the chat endpoint's own
CHAT_INERT: dict[str, Callable[[Any], bool]] = {
    **INERT, "modalities": lambda v: _unset(v) or v == ["text"],
    "audio": _unset, "prediction": _unset, "web_search_options": _unset, "functions": _unset,
    "function_call": _unset, "reasoning_effort": _unset, "verbosity": _unset,
    "echo": _is(False), "chat_template": _unset, "documents": _unset, "include_reasoning": _any,
    "add_special_tokens": _is(False),  # vLLM's chat default: the template adds what it needs
}
#: ... the completions endpoint's own (best_of is checked against n by the server)
COMPLETION_INERT: dict[str, Callable[[Any], bool]] = {
    **INERT, "suffix": _unset,
}
#: vLLM SamplingParams fields of /inference/v1/generate that change nothing for token output
#: (`include_stop_str_in_output` changes the text only: the token ids are the same either way)
GENERATE_INERT: dict[str, Callable[[Any], bool]] = {
    **{k: INERT[k] for k in ("min_p", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
                              "logprob_token_ids")},
    "skip_special_tokens": _any, "spaces_between_special_tokens": _any, "detokenize": _any,
    "include_stop_str_in_output": _any, "output_kind": _any, "extra_args": _unset,
    "best_of": _unset,
}
#: top-level fields of /inference/v1/generate besides the declared ones
GENERATE_REQUEST_INERT: dict[str, Callable[[Any], bool]] = {
    "cache_salt": _any, "priority": _is(0), "kv_transfer_params": _unset, "features": _unset,
}
STREAM_OPTIONS_INERT: dict[str, Callable[[Any], bool]] = {}


def refuse_unsupported(req: BaseModel, inert: Mapping[str, Callable[[Any], bool]], where: str = "") -> None:
    """InvalidRequestError naming the first field of `req` (a _Checked model) that this server
    would otherwise ignore: unknown, or one of `inert` at a value that would change something."""
    for name, value in (req.model_extra or {}).items():
        field = f"{where}{name}"
        check = inert.get(name)
        if check is None:
            raise InvalidRequestError(f"unknown or unsupported field `{field}`: this server does not "
                                      f"implement it (refused rather than ignored)", param=field)
        if not check(value):
            raise InvalidRequestError(f"`{field}`={json.dumps(value)[:100]} is not supported: this "
                                      f"server has no such feature (leave it out)", param=field)
    opts = getattr(req, "stream_options", None)
    if isinstance(opts, StreamOptions):
        refuse_unsupported(opts, STREAM_OPTIONS_INERT, "stream_options.")


# Bounded types (limits.py says why). Lists stop at their first bad item (fail_fast: 200,000
# wrong items cost 700 ms and 200,000 errors without it) and at their bound; objects are counted
# before their entries are validated (`at_most`: pydantic validates every entry first). In
# unions the list comes first, so that an over-long list's error is the first one named.
StopStr = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Annotated[list[StopStr], Field(max_length=MAX_STOP, fail_fast=True)] | StopStr
StopTokenIds = Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)]
LogitBias = Annotated[dict[str, float], at_most(MAX_LOGIT_BIAS)]
PromptIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS, fail_fast=True)]
PromptStr = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
Prompt = (PromptIds | PromptStr | Annotated[list[PromptStr], Field(max_length=MAX_PROMPTS, fail_fast=True)]
          | Annotated[list[PromptIds], Field(max_length=MAX_PROMPTS, fail_fast=True)])
Name = Annotated[str, Field(max_length=MAX_ID_CHARS)]
#: the chat roles OpenAI's API takes; another one (a typo, "god") is refused, not templated
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def known_roles(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            shown = json.dumps(role)[:40] if role is not None else "missing"
            raise ValueError(f"messages[{i}].role: {shown} is not one of {', '.join(sorted(ROLES))}")
    return messages


Messages = Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True),
                     AfterValidator(known_roles)]
Tools = Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS, fail_fast=True)]
Samples = Annotated[int, Field(le=MAX_N)]
MaxTokens = Annotated[int, Field(le=MAX_TOKENS)]
MinTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
#: rlix's own (the router's continuations): how many of the prompt's last ids an earlier attempt
#: generated; at most a prompt's length (the request builder checks it against this prompt's)
AlreadyGenerated = Annotated[int, Field(ge=0, le=MAX_PROMPT_TOKENS)]
TopK = Annotated[int, Field(le=MAX_TOP_K)]
Seed = Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)]
SmallObject = Annotated[dict[str, Any], at_most(MAX_KEYS)]


class _SamplingFields(_Checked):
    """The OpenAI + vLLM sampling fields we honour."""

    model: Name | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    n: Samples = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: LogitBias | None = None
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None
    min_tokens: MinTokens = 0
    include_stop_str_in_output: bool = False
    # structured outputs (structured.py reads and bounds them)
    response_format: SmallObject | None = None
    structured_outputs: SmallObject | None = None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    best_of: Samples | None = None
    add_special_tokens: bool = True
    already_generated: AlreadyGenerated = 0  # not vLLM's: SamplingParams.already_generated


class ChatCompletionRequest(_SamplingFields):
    messages: Messages
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    #: NeMo Gym's: the prompt starts with exactly these ids (token_prefix.py)
    required_prefix_token_ids: PromptIds | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Annotated[dict[str, Any], at_most(MAX_KEYS)] | None = None
    tools: Tools | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: the first call only (vLLM's rule)


class GenerateSamplingParams(_Checked):
    """vLLM's SamplingParams fields that /inference/v1/generate callers use."""

    n: Samples = 1
    max_tokens: MaxTokens | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: LogitBias | None = None
    min_tokens: MinTokens = 0
    structured_outputs: SmallObject | None = None


class GenerateRequest(_Checked):
    request_id: Name = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: PromptIds = Field(min_length=1)
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    model: Name | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    already_generated: AlreadyGenerated = 0  # not vLLM's: SamplingParams.already_generated
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


class TokenizeRequest(_Req):
    prompt: PromptStr | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    tools: Tools | None = None


class DetokenizeRequest(_Req):
    tokens: PromptIds


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    """vLLM's error shape; message and param capped (an error quoting a huge input, an unknown
    field's name, must not echo it whole)."""
    return {"error": {"message": capped(message), "type": type_,
                      "param": None if param is None else capped(param, 200), "code": code}}


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


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offset0: int = 0,
                        top: list[dict[str, float] | None] | None = None) -> dict:
    """OpenAI completions logprobs. `top`: each token's {token: logprob} alternatives (None for
    an echoed first prompt token); without it, the sampled token alone."""
    offsets, pos = [], offset0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    if top is None:
        top = [{t: lp} if lp is not None else None for t, lp in zip(tokens, logprobs)]
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": top}


def chat_logprob_item(token: str, logprob: float, top: list[tuple[str, float]] = ()) -> dict:
    """One token of a chat answer's logprobs; `top` its alternatives, most likely first."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                             for t, lp in top]}


def chat_logprobs(tokens: list[str], logprobs: list[float],
                  top: list[list[tuple[str, float]]] | None = None) -> dict:
    return {"content": [chat_logprob_item(tok, lp, top[i] if top is not None else ())
                        for i, (tok, lp) in enumerate(zip(tokens, logprobs))]}


def generate_logprobs(token_ids: list[int], logprobs: list[float],
                      top: list[list[tuple[int, float]]] | None = None, k: int = 0) -> dict:
    """vLLM's generate logprobs: each token with its rank (when alternatives were computed and
    it is among them) and `top_logprobs`: the sampled token, then the best others, max(k, 1) in all."""
    if top is None:  # the rollouts' case: no alternatives computed
        return {"content": [{"token_id": t, "logprob": lp, "rank": None,
                             "top_logprobs": [{"token_id": t, "logprob": lp, "rank": None}]}
                            for t, lp in zip(token_ids, logprobs)]}
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        rank = None
        entries = [{"token_id": t, "logprob": lp, "rank": None}]
        if top[i]:
            ranks = {tid: r for r, (tid, _) in enumerate(top[i], 1)}
            rank = entries[0]["rank"] = ranks.get(t)
            entries += [{"token_id": tid, "logprob": v, "rank": r}
                        for r, (tid, v) in enumerate(top[i], 1) if tid != t]
        content.append({"token_id": t, "logprob": lp, "rank": rank,
                        "top_logprobs": entries[: max(k, 1)]})
    return {"content": content}


def prompt_logprobs_of(prompt_ids: list[int], values: list[float | None], tops: list[list[tuple[int, float]]],
                       decode: Callable[[int, int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing precedes it), then for
    each one a map from token id to {logprob, rank, decoded_token}: the prompt's own token first,
    then the alternatives computed (the best k, which may hold the token itself). -inf is sent as
    -9999.0, as vLLM clamps it (JSON has no infinity). The token's rank is known when it is among
    the alternatives (vLLM ranks it over the whole vocabulary; here None otherwise). `decode(token,
    j)`: a token's text in place of prompt token j (after the tokens before it)."""
    out: list[dict | None] = []
    for j, (token, value, alts) in enumerate(zip(prompt_ids, values, tops)):
        if value is None:
            out.append(None)
            continue
        ranks = {tid: r for r, (tid, _) in enumerate(alts, 1)}
        entry = {str(token): {"logprob": max(value, -9999.0), "rank": ranks.get(token), "decoded_token": decode(token, j)}}
        for r, (tid, v) in enumerate(alts, 1):
            entry.setdefault(str(tid), {"logprob": max(v, -9999.0), "rank": r, "decoded_token": decode(tid, j)})
        out.append(entry)
    return out


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str, stop_reason: Any,
                      token_ids: list[int] | None, prompt_ids: list[int] | None,
                      prompt_logprobs: list[dict | None] | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt_ids, "routed_experts": None}


def completion_response(rid: str, model: str, choices: list[dict], n_prompt: int, n_out: int) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(n_prompt, n_out), "kv_transfer_params": None, "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     stop_reason: Any, logprobs: dict | None, token_ids: list[int] | None,
                     prompt_ids: list[int] | None, last: bool = False, index: int = 0,
                     usage: dict | None = None) -> dict:
    """`last`: the finishing chunk with no usage chunk after it carries the fingerprint;
    `usage`: continuous usage stats (vLLM puts them after the choices)."""
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": stop_reason, "prompt_token_ids": prompt_ids,
                        "token_ids": token_ids}]}
    if usage is not None:
        out["usage"] = usage
    if last:
        out["system_fingerprint"] = SYSTEM_FINGERPRINT
    return out


def chat_choice(index: int, content: str | None, finish: str, stop_reason: Any, logprobs: dict | None,
                token_ids: list[int] | None, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "reasoning": None}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason, "token_ids": token_ids, "routed_experts": None}


def chat_response(rid: str, model: str, choices: list[dict], prompt_ids: list[int] | None,
                  n_prompt: int, n_out: int, prompt_logprobs: list[dict | None] | None = None) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(n_prompt, n_out), "prompt_logprobs": prompt_logprobs, "prompt_token_ids": prompt_ids,
        "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def chat_first_chunk(rid: str, model: str, created: int, prompt_ids: list[int] | None,
                     index: int = 0, usage: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]}
    if usage is not None:
        out["usage"] = usage
    out.update(prompt_token_ids=prompt_ids, prompt_text=None)
    return out


def chat_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
               stop_reason: Any, logprobs: dict | None, token_ids: list[int] | None,
               last: bool = False, index: int = 0, usage: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "logprobs": logprobs,
                              "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = token_ids
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    if last:
        out["system_fingerprint"] = SYSTEM_FINGERPRINT
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, n_prompt: int, n_out: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(n_prompt, n_out, details=False), "system_fingerprint": SYSTEM_FINGERPRINT}


def generate_choice(index: int, finish: str, stop_reason: Any, token_ids: list[int],
                    logprobs: dict | None, spans: list[dict]) -> dict:
    return {"index": index, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": token_ids,
            "routed_experts": None, "sampling_mask": None, "weight_versions": spans, "logprobs": logprobs}


def generate_response(rid: str, model: str, choices: list[dict], prompt_ids: list[int] | None,
                      n_prompt: int, prompt_logprobs: list[dict | None] | None = None) -> dict:
    return {
        "request_id": rid, "model": model, "created": int(time.time()),
        "usage": usage(n_prompt, sum(len(c["token_ids"]) for c in choices)), "prompt_logprobs": prompt_logprobs,
        "prompt_token_id_logprobs": None, "prompt_token_ids": prompt_ids, "mm_placeholders": None,
        "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
        "output_mode": "tokens", "choices": choices,
    }


def generate_chunk(rid: str, finish: str | None, stop_reason: Any, token_ids: list[int],
                   logprobs: dict | None, spans: list[dict] | None,
                   prompt_ids: list[int] | None, index: int = 0, usage: dict | None = None) -> dict:
    out: dict[str, Any] = {"request_id": rid, "usage": usage}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    out["output_mode"] = "tokens"
    out["choices"] = [{"index": index, "finish_reason": finish, "stop_reason": stop_reason,
                       "token_ids": token_ids, "routed_experts": None, "sampling_mask": None,
                       "weight_versions": spans, "logprobs": logprobs}]
    return out


def generate_usage_chunk(rid: str, n_prompt: int, n_out: int) -> dict:
    return {"request_id": rid, "usage": usage(n_prompt, n_out, details=False),
            "output_mode": "tokens", "choices": []}


def version_response() -> dict:
    """`GET /version`: vLLM's shape, `{"version": ...}`, naming rlix's version (a client that
    logs or checks the server's version sees what it talks to, not a vLLM version it is not)."""
    return {"version": package_version()}


def models_response(name: str, root: str, max_model_len: int, created: int) -> dict:
    perm = {"id": new_id("modelperm"), "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "rlix", "root": root, "parent": None,
                                        "max_model_len": max_model_len, "permission": [perm]}]}
