"""What enters and leaves TorchEngine: request validation (at generate(), before anything is
queued) and the folding of per-step deltas into the cumulative GenerationOutput a caller sees."""

from __future__ import annotations

import math

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import MAX_TOP_LOGPROBS, GenerationOutput, SamplingParams
from rlix.inference.engine.sequence import Delta


def validate_request(request_id: str, prompt: list[int], params: SamplingParams, *,
                     vocab_size: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The prompt as ints, or InvalidRequestError saying what is wrong with the request."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams")
    try:
        ids = [int(t) for t in prompt]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError("prompt_token_ids must be a list of integers") from exc
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if params.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be >= 1")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise InvalidRequestError(f"min_tokens must lie in [0, max_tokens={params.max_tokens}], got "
                                  f"{params.min_tokens}", param="min_tokens")
    if not 0 <= params.already_generated <= len(ids):
        raise InvalidRequestError(f"already_generated must lie in [0, {len(ids)}] (the prompt's length), "
                                  f"got {params.already_generated}", param="already_generated")
    if len(ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len {max_model_len}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequestError("temperature must be a finite number >= 0")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequestError("top_p must lie in (0, 1]")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise InvalidRequestError("stop strings must be non-empty strings")
    _validate_extras(params, vocab_size, max_num_seqs)
    return ids


def _validate_extras(params: SamplingParams, vocab_size: int, max_num_seqs: int) -> None:
    """n, logprob counts, penalties and bias (what the common request leaves at defaults)."""
    if not 1 <= params.n <= max_num_seqs:
        raise InvalidRequestError(f"n must lie in [1, {max_num_seqs}] (this engine's "
                                  f"max_num_seqs: the samples of a request run together)", param="n")
    for name in ("top_logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"{name} must lie in [0, {MAX_TOP_LOGPROBS}], got {k}", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidRequestError(f"{name} must lie in [-2, 2], got {value}", param=name)
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise InvalidRequestError("repetition_penalty must be a finite number > 0",
                                  param="repetition_penalty")
    for token, bias in params.logit_bias:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token} is outside the vocabulary "
                                      f"[0, {vocab_size})", param="logit_bias")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidRequestError(f"logit_bias values must lie in [-100, 100], got {bias}",
                                      param="logit_bias")


def copy_output(out: GenerationOutput) -> GenerationOutput:
    """A snapshot of a cumulative output (the caller may keep it while more tokens come)."""
    return GenerationOutput(out.request_id, out.prompt_token_ids, list(out.token_ids),
                            list(out.logprobs), out.finish_reason, list(out.weight_versions),
                            out.stop_reason, out.first_token_at, out.index, list(out.top_logprobs),
                            out.prompt_logprobs, out.prompt_top_logprobs)


def merge_delta(out: GenerationOutput, delta: Delta) -> BaseException | None:
    out.token_ids.extend(delta.token_ids)
    out.logprobs.extend(delta.logprobs)
    out.weight_versions.extend(delta.weight_versions)
    if out.first_token_at is None:
        out.first_token_at = delta.first_token_at
    if delta.top_logprobs:
        out.top_logprobs.extend(delta.top_logprobs)
    if delta.prompt_logprobs is not None:
        out.prompt_logprobs, out.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
        out.stop_reason = delta.stop_reason
    return delta.error


def fold_delta(into: Delta | None, delta: Delta) -> Delta:
    """`delta` appended to the deltas folded so far (worker thread)."""
    if into is None:
        return delta
    into.token_ids.extend(delta.token_ids)
    into.logprobs.extend(delta.logprobs)
    into.weight_versions.extend(delta.weight_versions)
    into.top_logprobs.extend(delta.top_logprobs)
    if delta.prompt_logprobs is not None:
        into.prompt_logprobs, into.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
    into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason
    into.error = delta.error
    if into.first_token_at is None:
        into.first_token_at = delta.first_token_at
    return into
