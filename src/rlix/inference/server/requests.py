"""OpenAI/vLLM requests -> validated `Job`s for the engine, checked the way vLLM 0.32 checks them.

Pure (a tokenizer and the engine's context length), so every refusal is tested without a server:
max_tokens is capped to the context left after the prompt, a prompt that fills the context is a
400, min_tokens above the (capped) max_tokens is a 400 as in vLLM, a field the server would
ignore is refused (openai_schema.refuse_unsupported). A completions request with a list of
prompts becomes one Job per prompt (each checked on its own, as vLLM checks each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InvalidRequestError, ModelNotFoundError
from rlix.inference.engine.api import MAX_TOP_LOGPROBS, OutputConstraint, SamplingParams
from rlix.inference.server import openai_schema as S
from rlix.inference.server.structured import from_structured_outputs, request_constraint
from rlix.inference.server.token_prefix import required_prefix, splice
from rlix.inference.server.tool_calls import (ToolChoice, forced_call_constraint, template_messages,
                                              tool_choice_of)


@dataclass
class Job:
    """One validated request, ready for the engine."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token shown, in the endpoint's meaning
    #: chat with tools: whether the answer's <tool_call> blocks become tool_calls, and whether
    #: the output was constrained to calls (tool_choice "required" or named)
    tools: ToolChoice = field(default_factory=lambda: ToolChoice(False))
    parallel_tool_calls: bool = True  # False: only the first call is answered (vLLM's)
    echo: str | None = None  # completions `echo`: the prompt's text, ahead of each choice's
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string (or id) stays
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    prompt_index: int = 0  # which prompt of a completions request's list this is
    engine_id: str = ""  # the engine's request id, when not `rid` (the prompts of one request)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = 0.0  # time.monotonic() when the engine took it (metrics)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def parse_tools(self) -> bool:
        return self.tools.parse

    @property
    def engine_rid(self) -> str:
        return self.engine_id or self.rid

    @property
    def first_index(self) -> int:
        """The `index` of this prompt's first choice: vLLM numbers the choices of a list of
        prompts prompt by prompt, n each."""
        return self.prompt_index * self.n


class RequestBuilder:
    """Validates requests and turns them into Jobs; `max_model_len()` is the engine's context."""

    def __init__(self, tokenizer: Any, model_name: str, model_root: str, max_model_len) -> None:  # type: ignore[no-untyped-def]
        self.tok = tokenizer
        self.model_name = model_name
        self.model_root = model_root
        self.max_model_len = max_model_len

    def check_model(self, model: str | None) -> None:
        if model and model not in (self.model_name, self.model_root):
            raise ModelNotFoundError(
                f"The model `{model}` does not exist. Valid aliases: {self.model_name}.", param="model")

    def _params(self, req: Any, prompt_len: int, max_tokens: int | None, default_max: int | None,
                logprobs: bool, top: int = 0, prompt_logprobs: int | None = None,
                constraint: OutputConstraint | None = None, already_generated: int = 0) -> SamplingParams:
        if req.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {req.n}", param="n")
        limit = self.check_room(prompt_len, isinstance(req, S.GenerateSamplingParams))
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        room = limit - prompt_len
        wanted = max_tokens if max_tokens is not None else (default_max or room)
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = req.top_k if req.top_k and req.top_k > 0 else 0
        if temperature < 0 or not 0 < top_p <= 1:
            raise InvalidRequestError("temperature must be >= 0 and top_p in (0, 1]", param="temperature")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if already_generated > prompt_len:
            raise InvalidRequestError(f"already_generated ({already_generated}) counts more tokens than the "
                                      f"prompt holds ({prompt_len})", param="already_generated")
        capped = min(wanted, room)
        if req.min_tokens > capped:  # vLLM's check and wording, against max_tokens once capped
            where = "sampling_params." if isinstance(req, S.GenerateSamplingParams) else ""
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={capped}, "
                                      f"got {req.min_tokens}.", param=f"{where}min_tokens")
        return SamplingParams(max_tokens=capped, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=req.seed, stop=stop,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos, logprobs=logprobs, n=req.n,
                              top_logprobs=top, prompt_logprobs=prompt_logprobs,
                              presence_penalty=req.presence_penalty or 0.0,
                              frequency_penalty=req.frequency_penalty or 0.0,
                              repetition_penalty=(1.0 if req.repetition_penalty is None
                                                  else req.repetition_penalty),
                              logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens,
                              constraint=constraint, already_generated=already_generated)

    def check_room(self, prompt_len: int, token_level: bool = False) -> int:
        """The context length, or InvalidRequestError if a prompt this long leaves no room
        (vLLM's wording: `token_level` for /inference/v1/generate's). Checked before the ids
        are (a prompt longer than the context is refused without looking at each id)."""
        limit = self.max_model_len()
        if prompt_len >= limit and token_level:
            raise InvalidRequestError(
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model length "
                f"of {limit}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which leaves no room for output tokens. "
                f"Please reduce the length of the input prompt.", param="input_tokens")
        return limit

    @classmethod
    def _prompt_logprobs(cls, k: int | None, stream: bool, name: str) -> int | None:
        """A checked `prompt_logprobs`: None, or 0 (the prompt tokens' own logprobs) to 20
        alternatives; vLLM's -1 (the whole vocabulary) is past the 20 both servers allow. As in
        vLLM, a stream carries none (400 unless 0)."""
        cls._check_top(k, name)
        if stream and k:
            raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.", param=name)
        return k

    @staticmethod
    def _check_top(k: int | None, name: str) -> None:
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"{name} must lie in [0, {MAX_TOP_LOGPROBS}], got {k}", param=name)

    def check_ids(self, ids: list[int], what: str) -> None:
        vocab = len(self.tok)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} holds token ids outside the vocabulary (size {vocab}): "
                                      f"{bad[:5]}", param=what)

    @staticmethod
    def _prompts(prompt: Any) -> list[Any]:
        """The prompts of a completions request: one string or token-id list, or a list of them."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    def _encode_prompt(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            self.check_room(len(prompt))
            self.check_ids(prompt, "prompt")
            return list(prompt)
        raise InvalidRequestError("a prompt is a string or a list of token ids", param="prompt")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        try:
            text = self.tok.apply_chat_template(
                template_messages(messages), tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except InvalidRequestError:
            raise
        except Exception as exc:  # jinja errors: bad roles, missing content...
            raise InvalidRequestError(f"cannot apply the chat template to these messages: {exc}",
                                      param="messages") from None
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prepare_completion(self, req: S.CompletionRequest) -> list[Job]:
        """One Job per prompt (a list of prompts is vLLM's batch form), all under one response
        id; each prompt is checked (context room, vocabulary, min_tokens) before any runs."""
        self.check_model(req.model)
        S.refuse_unsupported(req, S.COMPLETION_INERT)
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of other than n is not supported (every sample is "
                                      "returned: ask for n)", param="best_of")
        self._check_top(req.logprobs, "logprobs")
        asked = self._prompt_logprobs(req.prompt_logprobs, req.stream, "prompt_logprobs")
        prompts = self._prompts(req.prompt)
        constraint = request_constraint(req.response_format, req.structured_outputs)
        rid = S.new_id("cmpl")
        jobs = []
        for i, prompt in enumerate(prompts):
            ids = self._encode_prompt(prompt, req.add_special_tokens)
            k = req.logprobs
            # vLLM's: echo with logprobs computes the prompt's too (and returns them as such)
            prompt_lp = asked if asked is not None else (k if req.echo else None)
            params = self._params(req, len(ids), req.max_tokens, 16, k is not None, top=k or 0,
                                  prompt_logprobs=prompt_lp, constraint=constraint,
                                  already_generated=req.already_generated)
            job = self._job("cmpl", ids, params, req, logprobs=k is not None, top=k or 0)
            job.rid, job.prompt_index = rid, i
            if len(prompts) > 1:  # vLLM's engine ids for the prompts of one request
                job.engine_id = f"{rid}-{i}"
            if req.echo:
                job.echo = prompt if isinstance(prompt, str) else self.tok.decode(ids)
            jobs.append(job)
        return jobs

    def prepare_chat(self, req: S.ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        S.refuse_unsupported(req, S.CHAT_INERT)
        self._check_top(req.top_logprobs, "top_logprobs")
        prompt_lp = self._prompt_logprobs(req.prompt_logprobs, req.stream, "prompt_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                                      param="top_logprobs")
        tools = tool_choice_of(req.tools, req.tool_choice)
        constraint = request_constraint(req.response_format, req.structured_outputs)
        if tools.forced is not None:  # a forced call overrides the other constraints (vLLM's)
            constraint = forced_call_constraint(req.tools or [], tools, req.parallel_tool_calls is not False)
        ids = self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                               req.chat_template_kwargs, req.tools if req.tool_choice != "none" else None)
        found = required_prefix(req.required_prefix_token_ids, req.messages)
        if found is not None:  # earlier turns as sampled, not as re-tokenized (token_prefix.py)
            prefix, where = found
            self.check_ids(prefix, where)
            ids = splice(ids, prefix, self.tok.all_special_ids, where)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        params = self._params(req, len(ids), max_tokens, None, bool(req.logprobs), top=top,
                              prompt_logprobs=prompt_lp, constraint=constraint)
        job = self._job("chatcmpl", ids, params, req, logprobs=bool(req.logprobs), top=top)
        job.tools, job.parallel_tool_calls = tools, req.parallel_tool_calls is not False
        return job

    def prepare_generate(self, req: S.GenerateRequest) -> Job:
        self.check_model(req.model)
        sp = req.sampling_params
        S.refuse_unsupported(req, S.GENERATE_REQUEST_INERT)
        S.refuse_unsupported(sp, S.GENERATE_INERT, "sampling_params.")
        self._check_top(sp.logprobs, "sampling_params.logprobs")
        self.check_room(len(req.token_ids), token_level=True)
        self.check_ids(req.token_ids, "token_ids")
        k = sp.logprobs
        # vLLM's shape: the sampled token then the best others, max(k, 1) entries: k >= 2 needs
        # the k best (the sampled one may be among them); 0 and 1 need none
        prompt_lp = self._prompt_logprobs(sp.prompt_logprobs, req.stream, "sampling_params.prompt_logprobs")
        params = self._params(sp, len(req.token_ids), sp.max_tokens, 16, k is not None,
                              top=k if k and k >= 2 else 0, prompt_logprobs=prompt_lp,
                              constraint=from_structured_outputs(sp.structured_outputs,
                                                                 "sampling_params.structured_outputs"),
                              already_generated=req.already_generated)
        job = self._job("", req.token_ids, params, req, logprobs=k is not None, top=k or 0)
        job.rid = f"generate-tokens-{req.request_id}"
        return job

    def _job(self, prefix: str, ids: list[int], params: SamplingParams, req: Any, *,
             logprobs: bool, top: int = 0) -> Job:
        opts = req.stream_options
        usage = bool(opts and opts.include_usage)
        return Job(rid=S.new_id(prefix) if prefix else "", prompt_ids=ids, params=params,
                   stream=bool(req.stream), include_usage=usage,
                   return_token_ids=bool(req.return_token_ids), logprobs=logprobs, top_logprobs=top,
                   skip_special_tokens=getattr(req, "skip_special_tokens", True),
                   tokens_as_ids=bool(getattr(req, "return_tokens_as_token_ids", False)),
                   include_stop=bool(getattr(req, "include_stop_str_in_output", False)),
                   # vLLM's rule: per-chunk usage only along with the final usage chunk
                   continuous_usage=usage and bool(opts.continuous_usage_stats))


def _logit_bias(raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs (the engine checks ids and ranges)."""
    out = []
    for key, bias in (raw or {}).items():
        try:
            out.append((int(key), float(bias)))
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                      param="logit_bias") from None
    return tuple(out)
