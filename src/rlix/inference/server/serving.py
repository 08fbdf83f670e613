"""The engine server's data plane as a plain class: OpenAI/vLLM requests -> EngineAPI -> wire dicts.

No HTTP here (server.py is a thin shell around it), so validation, stop strings and streaming
are tested with a fake engine. Behaviour follows vLLM 0.32 where it is observable: max_tokens is
capped to the context left after the prompt, a prompt that fills the context is a 400, a stop
string ends the output and is not part of the text, `return_token_ids` adds prompt and output ids.
Not supported (400): n > 1, several prompts in one request, echo. Logprobs carry the sampled
token only (the engine computes no top-k alternatives).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InvalidRequestError, ModelNotFoundError, RlixError
from rlix.inference.server import openai_schema as S
from rlix.inference.engine.api import EngineAPI, GenerationOutput, SamplingParams
from rlix.inference.server.generation_log import GenerationLog
from rlix.inference.server.metrics import EngineMetrics
from rlix.inference.server.tool_calls import ToolCall, check_tools, parse_tool_calls, template_messages


class TextStream:
    """Cumulative token ids -> text deltas. Holds back a trailing partial UTF-8 character and
    the tail that could still grow into a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), prefix: list[int] = ()) -> None:
        self.tok = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.stopped: str | None = None
        # The prompt's last tokens are decoded with the output so that a character whose
        # bytes started in the prompt (a request re-dispatched with its accumulated tokens)
        # comes out whole; a prefix ending mid-character counts from where that character starts.
        self.prefix = list(prefix)
        self.skip = len(tokenizer.decode(self.prefix, skip_special_tokens=True).rstrip("\ufffd"))

    def update(self, token_ids: list[int], final: bool, cut: bool = False) -> str:
        """`cut`: the request ended early (aborted), so a trailing partial character is dropped
        rather than sent as U+FFFD: whoever continues the request will complete it."""
        full = self.tok.decode(self.prefix + token_ids, skip_special_tokens=True)[self.skip:]
        if self.stop:
            hits = [(full.find(s), s) for s in self.stop if s in full]
            if hits:
                pos, self.stopped = min(hits)
                full, final = full[:pos], True
        safe = len(full) if final else len(full) - self.hold
        if not final or cut:
            while safe > 0 and full[safe - 1] == "\ufffd":
                safe -= 1
        delta = full[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta


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
    top_logprobs: bool = False
    parse_tools: bool = False  # chat with tools: the answer's <tool_call> blocks become tool_calls
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Step:
    """What one engine yield added."""

    out: GenerationOutput
    new_ids: list[int]
    new_logprobs: list[float]
    text: str
    finish: str | None
    stop_reason: Any


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Validates requests, runs them on the engine and shapes vLLM-compatible answers."""

    def __init__(self, engine: EngineAPI, tokenizer: Any, model_name: str, model_root: str = "",
                 generation_log: GenerationLog | None = None, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.generation_log = generation_log
        self.metrics = metrics  # tokens, time to first token, latency of every request
        self.tok = tokenizer
        self.model_name = model_name
        self.model_root = model_root or model_name
        self.created = int(time.time())
        self._bg: set[asyncio.Task] = set()

    # ------------------------------------------------------------ validation
    def check_model(self, model: str | None) -> None:
        if model and model not in (self.model_name, self.model_root):
            raise ModelNotFoundError(
                f"The model `{model}` does not exist. Valid aliases: {self.model_name}.", param="model")

    def _params(self, req: Any, prompt_len: int, max_tokens: int | None, default_max: int | None,
                logprobs: bool) -> SamplingParams:
        if req.n != 1:
            raise InvalidRequestError("n must be 1: rlix's engine server samples one sequence per "
                                      "request (send n requests instead)", param="n")
        limit = self.engine.max_model_len
        if prompt_len >= limit and isinstance(req, S.GenerateSamplingParams):
            raise InvalidRequestError(
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model length "
                f"of {limit}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which leaves no room for output tokens. "
                f"Please reduce the length of the input prompt.", param="input_tokens")
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
        return SamplingParams(max_tokens=min(wanted, room), temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=req.seed, stop=stop,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=req.ignore_eos, logprobs=logprobs)

    def _check_ids(self, ids: list[int], what: str) -> None:
        vocab = len(self.tok)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} holds token ids outside the vocabulary (size {vocab}): "
                                      f"{bad[:5]}", param=what)

    def _encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tok(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            self._check_ids(prompt, "prompt")
            return list(prompt)
        raise InvalidRequestError("one prompt per request: a string or a list of token ids", param="prompt")

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

    def prepare_completion(self, req: S.CompletionRequest) -> Job:
        self.check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        ids = self._encode_prompt(req.prompt)
        params = self._params(req, len(ids), req.max_tokens, 16, req.logprobs is not None)
        return self._job("cmpl", ids, params, req, logprobs=req.logprobs is not None)

    def prepare_chat(self, req: S.ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        parse_tools = check_tools(req.tools, req.tool_choice)
        ids = self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                               req.chat_template_kwargs, req.tools if req.tool_choice != "none" else None)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(ids), max_tokens, None, req.logprobs)
        job = self._job("chatcmpl", ids, params, req, logprobs=req.logprobs, top=bool(req.top_logprobs))
        job.parse_tools = parse_tools
        return job

    def prepare_generate(self, req: S.GenerateRequest) -> Job:
        self.check_model(req.model)
        self._check_ids(req.token_ids, "token_ids")
        sp = req.sampling_params
        params = self._params(sp, len(req.token_ids), sp.max_tokens, 16, sp.logprobs is not None)
        job = self._job("", req.token_ids, params, req, logprobs=sp.logprobs is not None)
        job.rid = f"generate-tokens-{req.request_id}"
        return job

    def _job(self, prefix: str, ids: list[int], params: SamplingParams, req: Any, *,
             logprobs: bool, top: bool = False) -> Job:
        opts = req.stream_options
        return Job(rid=S.new_id(prefix) if prefix else "", prompt_ids=ids, params=params,
                   stream=bool(req.stream), include_usage=bool(opts and opts.include_usage),
                   return_token_ids=bool(req.return_token_ids), logprobs=logprobs, top_logprobs=top)

    # ------------------------------------------------------------ running
    async def run(self, job: Job, text: TextStream | None) -> AsyncIterator[Step]:
        """Engine outputs -> Steps; a stop string ends the request (the engine is told to abort)."""
        # nothing to send or check before the end: the engine wakes this loop once, not per step
        final_only = not job.stream and not job.params.stop
        started = time.monotonic()
        agen = self.engine.generate(job.rid, job.prompt_ids, job.params, final_only=final_only)
        seen, done, finish, first_at = 0, False, None, None
        try:
            async for out in agen:
                first_at = out.first_token_at
                finish, stop_reason = out.finish_reason, None
                delta = ""
                if text is not None and (job.stream or text.stop or finish):
                    delta = text.update(out.token_ids, final=finish is not None,
                                        cut=finish == "abort")
                    if text.stopped:
                        if finish is None:
                            self._abort_later(job.rid)
                        finish, stop_reason = "stop", text.stopped
                if finish == "stop" and stop_reason is None:
                    stop_reason = out.stop_reason
                new_ids, new_lps = out.token_ids[seen:], out.logprobs[seen:]
                if self.metrics is not None and new_ids:  # the prompt counts once prefilled
                    self.metrics.tokens(0 if seen else len(job.prompt_ids), len(new_ids))
                seen = len(out.token_ids)
                done = finish is not None
                if new_ids or done:
                    yield Step(out, new_ids, new_lps, delta, finish, stop_reason)
                if done:
                    return
        finally:
            if self.metrics is not None:
                self.metrics.request_done(prompt_tokens=len(job.prompt_ids), generation_tokens=seen,
                                          finish_reason=finish if done else None,
                                          ttft_s=None if first_at is None else first_at - started,
                                          e2e_s=time.monotonic() - started)
            if not done:
                self._abort_later(job.rid)
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                self._bg_task(aclose())

    def _abort_later(self, rid: str) -> None:
        self._bg_task(self.engine.abort([rid]))

    def _bg_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _final(self, job: Job, text: TextStream | None) -> tuple[Step, str]:
        last, chunks = None, []
        async for step in self.run(job, text):
            last = step
            chunks.append(step.text)
        assert last is not None  # the engine always ends with a finish reason
        return last, "".join(chunks)

    def _strs(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t]) for t in ids]

    # ------------------------------------------------------------ completions
    async def completion(self, job: Job) -> dict:
        last, text = await self._final(job, TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]))
        out = last.out
        lp = S.completion_logprobs(self._strs(out.token_ids), out.logprobs) if job.logprobs else None
        return S.completion_response(job.rid, self.model_name, text, last.finish, last.stop_reason, lp,
                                     out.token_ids if job.return_token_ids else None,
                                     job.prompt_ids if job.return_token_ids else None,
                                     len(job.prompt_ids), len(out.token_ids))

    async def completion_stream(self, job: Job) -> AsyncIterator[str]:
        text, offset, n_out = TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]), 0, 0
        prompt = job.prompt_ids if job.return_token_ids else None
        async for step in self._guard(self.run(job, text)):
            if isinstance(step, str):
                yield step
                return
            lp = None
            if job.logprobs:
                strs = self._strs(step.new_ids)
                lp = S.completion_logprobs(strs, step.new_logprobs, offset)
                offset += sum(len(s) for s in strs)
            n_out = len(step.out.token_ids)
            yield sse(S.completion_chunk(job.rid, self.model_name, job.created, step.text, step.finish,
                                         step.stop_reason, lp,
                                         step.new_ids if job.return_token_ids else None, prompt,
                                         last=bool(step.finish) and not job.include_usage))
            prompt = None
        if job.include_usage:
            yield sse(S.usage_chunk(job.rid, self.model_name, job.created, "text_completion",
                                    len(job.prompt_ids), n_out))
        yield DONE

    # ------------------------------------------------------------ chat
    async def chat(self, job: Job) -> dict:
        last, text = await self._final(job, TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]))
        out = last.out
        lp = S.chat_logprobs(self._strs(out.token_ids), out.logprobs, job.top_logprobs) if job.logprobs else None
        content, calls, finish = self._tool_calls(job, text, last.finish)
        return S.chat_response(job.rid, self.model_name, content, finish, last.stop_reason, lp,
                               out.token_ids if job.return_token_ids else None,
                               job.prompt_ids if job.return_token_ids else None,
                               len(job.prompt_ids), len(out.token_ids),
                               tool_calls=[c.as_openai() for c in calls] if job.parse_tools else None)

    @staticmethod
    def _tool_calls(job: Job, text: str, finish: str) -> tuple[str | None, list[ToolCall], str]:
        """The answer's content, its tool calls, and the finish reason ("tool_calls" if any)."""
        if not job.parse_tools:
            return text, [], finish
        content, calls = parse_tool_calls(text)
        return content, calls, "tool_calls" if calls and finish == "stop" else finish

    async def chat_stream(self, job: Job) -> AsyncIterator[str]:
        yield sse(S.chat_first_chunk(job.rid, self.model_name, job.created,
                                     job.prompt_ids if job.return_token_ids else None))
        if job.parse_tools:  # a call is known only once its block closes: one delta at the end
            async for chunk in self._chat_stream_with_tools(job):
                yield chunk
            return
        text, n_out = TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]), 0
        async for step in self._guard(self.run(job, text)):
            if isinstance(step, str):
                yield step
                return
            lp = (S.chat_logprobs(self._strs(step.new_ids), step.new_logprobs, job.top_logprobs)
                  if job.logprobs else None)
            n_out = len(step.out.token_ids)
            yield sse(S.chat_chunk(job.rid, self.model_name, job.created, step.text, step.finish,
                                   step.stop_reason, lp, step.new_ids if job.return_token_ids else None,
                                   last=bool(step.finish) and not job.include_usage))
        if job.include_usage:
            yield sse(S.usage_chunk(job.rid, self.model_name, job.created, "chat.completion.chunk",
                                    len(job.prompt_ids), n_out))
        yield DONE

    async def _chat_stream_with_tools(self, job: Job) -> AsyncIterator[str]:
        text = TextStream(self.tok, job.params.stop, job.prompt_ids[-8:])
        parts: list[str] = []
        new_ids: list[int] = []
        last: Step | None = None
        async for step in self._guard(self.run(job, text)):
            if isinstance(step, str):
                yield step
                return
            parts.append(step.text)
            new_ids += step.new_ids
            last = step
        assert last is not None
        content, calls, finish = self._tool_calls(job, "".join(parts), last.finish or "stop")
        lp = (S.chat_logprobs(self._strs(last.out.token_ids), last.out.logprobs, job.top_logprobs)
              if job.logprobs else None)
        chunk = S.chat_chunk(job.rid, self.model_name, job.created, content or "", finish, last.stop_reason, lp,
                             new_ids if job.return_token_ids else None, last=not job.include_usage)
        if calls:
            chunk["choices"][0]["delta"]["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
        yield sse(chunk)
        if job.include_usage:
            yield sse(S.usage_chunk(job.rid, self.model_name, job.created, "chat.completion.chunk",
                                    len(job.prompt_ids), len(last.out.token_ids)))
        yield DONE

    # ------------------------------------------------------------ token-level generate
    async def generate(self, job: Job) -> dict:
        text = TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]) if job.params.stop else None
        last, _ = await self._final(job, text)
        out = last.out
        ids = out.token_ids
        lp = S.generate_logprobs(ids, out.logprobs) if job.logprobs else None
        if self.generation_log is not None:
            self.generation_log.write(job.rid, job.prompt_ids, ids, list(out.logprobs), last.finish)
        return S.generate_response(job.rid, self.model_name, last.finish, last.stop_reason, ids, lp,
                                   S.weight_spans(out.weight_versions, len(ids)),
                                   job.prompt_ids if job.return_token_ids else None, len(job.prompt_ids))

    async def generate_stream(self, job: Job) -> AsyncIterator[str]:
        text = TextStream(self.tok, job.params.stop, job.prompt_ids[-8:]) if job.params.stop else None
        prompt, n_out = (job.prompt_ids if job.return_token_ids else None), 0
        async for step in self._guard(self.run(job, text)):
            if isinstance(step, str):
                yield step
                return
            n_out = len(step.out.token_ids)
            spans = S.weight_spans(step.out.weight_versions, n_out) if step.finish else None
            lp = S.generate_logprobs(step.new_ids, step.new_logprobs) if job.logprobs else None
            yield sse(S.generate_chunk(job.rid, step.finish, step.stop_reason, step.new_ids, lp, spans, prompt))
            prompt = None
        if job.include_usage:
            yield sse(S.generate_usage_chunk(job.rid, len(job.prompt_ids), n_out))
        yield DONE

    async def _guard(self, steps: AsyncIterator[Step]) -> AsyncIterator[Step | str]:
        """Errors after the 200 header went out become one error event and [DONE], as in vLLM."""
        try:
            async for step in steps:
                yield step
        except RlixError as exc:
            yield sse(S.error_body(str(exc), type(exc).__name__, 500)) + DONE
        finally:
            await steps.aclose()  # type: ignore[attr-defined]  # aborts the request if unfinished

    # ------------------------------------------------------------ tokenizer endpoints
    def tokenize(self, req: S.TokenizeRequest) -> dict:
        if req.messages is not None:
            check_tools(req.tools, None)
            ids = self.render_chat(req.messages, req.add_generation_prompt, tools=req.tools)
        elif req.prompt is not None:
            ids = self.tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise InvalidRequestError("give `prompt` or `messages`", param="prompt")
        strs = self.tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, req: S.DetokenizeRequest) -> dict:
        self._check_ids(req.tokens, "tokens")
        return {"prompt": self.tok.decode(req.tokens)}

    def models(self) -> dict:
        return S.models_response(self.model_name, self.model_root, self.engine.max_model_len, self.created)
