"""The engine server's data plane as a plain class: a validated Job (requests.py) -> EngineAPI ->
vLLM-compatible wire dicts, whole or streamed.

No HTTP here (app.py is a thin shell around it), so stop strings and streaming are tested with a
fake engine. Behaviour follows vLLM 0.32 where it is observable: a stop string ends the output and
is not part of the text, nor is the text of the end-of-sequence or stop token id that ended it
(both stay with include_stop_str_in_output), `return_token_ids` adds prompt and output ids. `n`
samples share the prompt's prefill and come back as `n` choices (by `index`, streamed
interleaved); logprobs carry up to 20 alternatives per token (`top_logprobs`, completions'
`logprobs`); completions `echo` prepends the prompt (with its logprobs, computed in the prefill).
A completions request with a list of prompts runs them concurrently as requests of their own
(each prompt's samples share its prefill) and answers with n choices per prompt, numbered prompt
by prompt, usage summed. `stream_options.continuous_usage_stats` puts vLLM's usage (that choice's
tokens so far) on every streamed chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import InvalidRequestError, RlixError
from rlix.inference.engine.api import EngineAPI, GenerationOutput, TopLogprobs
from rlix.inference.server import openai_schema as S
from rlix.inference.server.generation_log import GenerationLog
from rlix.inference.server.metrics import EngineMetrics
from rlix.inference.server.requests import Job, RequestBuilder
from rlix.inference.server.text_stream import TextStream
from rlix.inference.server.token_text import MAX_CONTEXT, TokenTexts
from rlix.inference.server.tool_calls import ToolCall, answer_calls, check_tools


@dataclass
class Step:
    """What one engine yield added to choice `index`."""

    out: GenerationOutput
    new_ids: list[int]
    new_logprobs: list[float]
    text: str
    finish: str | None
    stop_reason: Any
    index: int = 0
    new_top: list[TopLogprobs] = field(default_factory=list)


async def _together(coros: list[Any]) -> list[Any]:
    """The results of `coros`, run concurrently; the first failure is raised as it is (not as
    an ExceptionGroup: the app maps rlix's errors to answers) after the others are cancelled."""
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
        self.token_texts = TokenTexts(tokenizer)  # logprob tokens' strings, as vLLM's
        self.requests = RequestBuilder(tokenizer, model_name, self.model_root,
                                       lambda: self.engine.max_model_len)

    # ------------------------------------------------------------ requests (requests.py)
    def check_model(self, model: str | None) -> None:
        self.requests.check_model(model)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        return self.requests.render_chat(messages, add_generation_prompt, continue_final_message,
                                         kwargs, tools)

    def prepare_completion(self, req: S.CompletionRequest) -> list[Job]:
        return self.requests.prepare_completion(req)

    def prepare_chat(self, req: S.ChatCompletionRequest) -> Job:
        return self.requests.prepare_chat(req)

    def prepare_generate(self, req: S.GenerateRequest) -> Job:
        return self.requests.prepare_generate(req)


    # ------------------------------------------------------------ running
    def _texts(self, job: Job, always: bool = True) -> list[TextStream | None]:
        """One text stream per choice (for token-level generate only to apply stop strings)."""
        if not always and not job.params.stop:
            return [None] * job.n
        return [TextStream(self.tok, job.params.stop, job.prompt_ids[-8:], job.skip_special_tokens,
                           job.params.min_tokens, job.include_stop)
                for _ in range(job.n)]

    def start(self, job: Job) -> AsyncIterator[GenerationOutput]:
        """Hand the request to the engine, which validates it now (before a stream's 200)."""
        # nothing to send or check before the end: the engine wakes this loop once, not per step
        final_only = not job.stream and not job.params.stop
        job.started = time.monotonic()
        return self.engine.generate(job.engine_rid, job.prompt_ids, job.params, final_only=final_only)

    def start_all(self, jobs: list[Job]) -> list[AsyncIterator[GenerationOutput]]:
        """`start` each prompt's job; if the engine refuses one, those already handed over
        are closed (none of them has run: the engine starts a request when it is iterated)."""
        started: list[AsyncIterator[GenerationOutput]] = []
        try:
            for job in jobs:
                started.append(self.start(job))
        except BaseException:
            for agen in started:
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    self._bg_task(aclose())
            raise
        return started

    async def run(self, job: Job, texts: list[TextStream | None],
                  agen: AsyncIterator[GenerationOutput] | None = None) -> AsyncIterator[Step]:
        """Engine outputs -> Steps (one per output that added something to a choice); a stop
        string ends its choice (the engine is told to abort that sample). `agen`: the request
        as `start` handed it over (else it is started here). Metrics: each sample is a request
        of its own (vLLM's child requests), its prompt counted once it is prefilled (the samples
        share one prefill: the engine reports the copies as cached prompt tokens)."""
        if agen is None:
            agen = self.start(job)
        n = job.n
        seen = [0] * n
        finishes: list[str | None] = [None] * n  # choices whose finish went out
        first_at: list[float | None] = [None] * n
        closed = 0
        prompt_counted = [False] * n
        failed = False  # the engine failed the request (not: its caller left)
        try:
            async for out in agen:
                i = out.index
                if finishes[i] is not None:
                    continue  # a sample still running after its stop string: being aborted
                first_at[i] = out.first_token_at
                text = texts[i]
                finish, stop_reason = out.finish_reason, None
                delta = ""
                if text is not None and (job.stream or text.stop or finish):
                    # ended by end-of-sequence or a stop id (a stop string's stop_reason is
                    # the string): that token's text is not part of the output (vLLM's rule)
                    dropped = (finish == "stop" and not job.include_stop
                               and not isinstance(out.stop_reason, str))
                    delta = text.update(out.token_ids, final=finish is not None,
                                        cut=finish == "abort", drop_last=dropped)
                    if text.stopped:
                        if finish is None:
                            self._abort_later(out.request_id)
                        finish, stop_reason = "stop", text.stopped
                if finish == "stop" and stop_reason is None:
                    stop_reason = out.stop_reason
                k = seen[i]
                new_ids, new_lps = out.token_ids[k:], out.logprobs[k:]
                new_top = out.top_logprobs[k:] if out.top_logprobs else []
                if self.metrics is not None and new_ids:  # a sample's prompt counts once prefilled
                    self.metrics.tokens(0 if prompt_counted[i] else len(job.prompt_ids), len(new_ids))
                    prompt_counted[i] = True
                seen[i] = len(out.token_ids)
                if finish is not None:
                    finishes[i] = finish
                    closed += 1
                if new_ids or finish is not None:
                    yield Step(out, new_ids, new_lps, delta, finish, stop_reason, i, new_top)
                if closed == n:
                    return
        except Exception:
            failed = True
            raise
        finally:
            if self.metrics is not None:  # a sample not ended here was failed or left (vLLM's reasons)
                now = time.monotonic()
                for i in range(n):
                    self.metrics.sample_done(prompt_tokens=len(job.prompt_ids), generation_tokens=seen[i],
                                             max_tokens=job.params.max_tokens,
                                             finish_reason=finishes[i] or ("error" if failed else "abort"),
                                             ttft_s=None if first_at[i] is None else first_at[i] - job.started,
                                             e2e_s=now - job.started)
                self.metrics.request_done(n=n, generated=seen)
            if closed < n:
                self._abort_later(job.engine_rid)
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                self._bg_task(aclose())

    def _abort_later(self, rid: str) -> None:
        self._bg_task(self.engine.abort([rid]))

    def _bg_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _finals(self, job: Job, always: bool = True,
                      agen: AsyncIterator[GenerationOutput] | None = None) -> list[tuple[Step, str]]:
        """Each choice's last step and whole text, by index. The engine takes (and validates)
        the request before the per-sample text streams are made: a refused `n` costs nothing."""
        if agen is None:
            agen = self.start(job)
        texts = self._texts(job, always)
        last: dict[int, Step] = {}
        chunks: dict[int, list[str]] = {}
        async for step in self.run(job, texts, agen):
            last[step.index] = step
            chunks.setdefault(step.index, []).append(step.text)
        return [(last[i], "".join(chunks[i])) for i in range(job.n)]  # every choice ends

    def _token_str(self, token: int, as_id: bool = False, before: list[int] | tuple[int, ...] = ()) -> str:
        """A logprob token's string: its id (return_tokens_as_token_ids), or its text after
        the tokens `before` it (token_text.py)."""
        if as_id:
            return f"token_id:{token}"
        return self.token_texts.at(token, before)

    def _contexts(self, ids: list[int], before: list[int]) -> list[list[int]]:
        """For each of `ids`, the tokens just before it (`before`: those preceding ids[0])."""
        window = list(before[-MAX_CONTEXT:])
        out = []
        for t in ids:
            out.append(window)
            window = [*window[1 - MAX_CONTEXT:], t]
        return out

    # ------------------------------------------------------------ logprobs
    def _prompt_lp(self, job: Job, out: GenerationOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` of the job's prompt (None when not asked for)."""
        if job.params.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        n = len(job.prompt_ids)
        contexts = self._contexts(job.prompt_ids, [])
        return S.prompt_logprobs_of(job.prompt_ids, out.prompt_logprobs, out.prompt_top_logprobs or [[]] * n,
                                    lambda token, j: self._token_str(token, False, contexts[j]))

    def _completion_lp(self, job: Job, out: GenerationOutput, ids: list[int], lps: list[float],
                       tops: list[TopLogprobs], offset0: int = 0, echo: bool = False) -> dict:
        """Completions logprobs of `ids` (the echoed prompt's first when `echo`); each token's
        top_logprobs: the `logprobs` best tokens, and the token itself."""
        as_id, k = job.tokens_as_ids, job.top_logprobs
        tokens: list[str] = []
        values: list[float | None] = []
        top: list[dict[str, float] | None] = []

        def add(token: int, lp: float | None, alts: TopLogprobs, before: list[int]) -> None:
            values.append(lp)
            if lp is None:  # the prompt's first token: decoded alone, as vLLM's (no logprob entry)
                tokens.append(self._token_str(token, True) if as_id else self.tok.decode([token]))
                top.append(None)
                return
            tokens.append(self._token_str(token, as_id, before))
            # vLLM's order: the token itself, then the alternatives by rank (an alternative
            # whose string is the same replaces its value, as in vLLM's dict)
            best = {tokens[-1]: lp}
            for t, v in alts[:k]:
                best[self._token_str(t, as_id, before)] = v
            top.append(best)

        if echo:
            n = len(job.prompt_ids)
            # a prompt token follows the prompt tokens before it that have logprobs (not the first)
            contexts = [[], *self._contexts(job.prompt_ids[1:], [])]
            for token, lp, alts, before in zip(job.prompt_ids, out.prompt_logprobs or [None] * n,
                                               out.prompt_top_logprobs or [[]] * n, contexts):
                add(token, lp, alts, before)
        contexts = self._contexts(ids, out.token_ids[:len(out.token_ids) - len(ids)])
        for token, lp, alts, before in zip(ids, lps, tops or [[]] * len(ids), contexts):
            add(token, lp, alts, before)
        return S.completion_logprobs(tokens, values, offset0, top)

    def _chat_lp(self, job: Job, ids: list[int], lps: list[float], tops: list[TopLogprobs],
                 before: list[int] | None = None) -> dict:
        """Chat logprobs of `ids`, the output tokens after `before` (a streamed chunk's)."""
        as_id = job.tokens_as_ids
        contexts = self._contexts(ids, before or [])
        top = ([[(self._token_str(t, as_id, ctx), v) for t, v in alts] for alts, ctx in zip(tops, contexts)]
               if job.top_logprobs else None)
        return S.chat_logprobs([self._token_str(t, as_id, ctx) for t, ctx in zip(ids, contexts)], lps, top)

    # ------------------------------------------------------------ completions
    async def completion(self, jobs: list[Job]) -> dict:
        """The answer to a completions request: its prompts' choices by index, usage summed."""
        agens = self.start_all(jobs)
        if len(jobs) == 1:
            finals = [await self._finals(jobs[0], agen=agens[0])]
        else:
            finals = await _together([self._finals(job, agen=agen) for job, agen in zip(jobs, agens)])
        choices, n_out = [], 0
        for job, results in zip(jobs, finals):
            for i, (last, text) in enumerate(results):
                out = last.out
                lp = (self._completion_lp(job, out, out.token_ids, out.logprobs, out.top_logprobs,
                                          echo=job.echo is not None) if job.logprobs else None)
                if job.echo is not None:
                    text = job.echo + text
                choices.append(S.completion_choice(job.first_index + i, text, lp, last.finish,
                                                   last.stop_reason,
                                                   out.token_ids if job.return_token_ids else None,
                                                   job.prompt_ids if job.return_token_ids else None,
                                                   self._prompt_lp(job, out)))
                n_out += len(out.token_ids)
        return S.completion_response(jobs[0].rid, self.model_name, choices,
                                     sum(len(job.prompt_ids) for job in jobs), n_out)

    def completion_stream(self, jobs: list[Job]) -> AsyncIterator[str]:
        """The SSE text; the engine refuses a bad request here, before any of it is sent."""
        return self._completion_stream(jobs, self.start_all(jobs))

    async def _completion_stream(self, jobs: list[Job], agens: list[AsyncIterator[GenerationOutput]]
                                 ) -> AsyncIterator[str]:
        head = jobs[0]
        total = len(jobs) * head.n
        offsets, n_out, first = [0] * total, [0] * total, [True] * total
        steps = self._steps(jobs, agens)
        try:
            async for job, step in steps:
                if isinstance(step, str):
                    yield step
                    return
                i = job.first_index + step.index
                echo = job.echo is not None and first[i]
                lp = None
                if job.logprobs:
                    lp = self._completion_lp(job, step.out, step.new_ids, step.new_logprobs, step.new_top,
                                             offsets[i], echo)
                    if lp["tokens"]:
                        offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                n_out[i] = len(step.out.token_ids)
                prompt = job.prompt_ids if job.return_token_ids and first[i] else None
                first[i] = False
                usage = S.usage(len(job.prompt_ids), n_out[i], details=False) if job.continuous_usage else None
                yield sse(S.completion_chunk(head.rid, self.model_name, head.created,
                                             (job.echo or "") + step.text if echo else step.text,
                                             step.finish, step.stop_reason, lp,
                                             step.new_ids if job.return_token_ids else None, prompt,
                                             last=bool(step.finish) and not job.include_usage, index=i,
                                             usage=usage))
        finally:
            await steps.aclose()  # type: ignore[attr-defined]  # ends every prompt's task
        if head.include_usage:
            yield sse(S.usage_chunk(head.rid, self.model_name, head.created, "text_completion",
                                    sum(len(job.prompt_ids) for job in jobs), sum(n_out)))
        yield DONE

    async def _steps(self, jobs: list[Job], agens: list[AsyncIterator[GenerationOutput]]
                     ) -> AsyncIterator[tuple[Job, Step | str]]:
        """The Steps of every prompt's job as they come (a str: the error event that ends the
        stream). One job is iterated here; several run as tasks feeding one queue, all of them
        cancelled (their requests aborted) when the stream ends early or one of them fails."""
        if len(jobs) == 1:
            async for step in self._guard(self.run(jobs[0], self._texts(jobs[0]), agens[0])):
                yield jobs[0], step
            return
        queue: asyncio.Queue[tuple[Job, Step | str] | BaseException | None] = asyncio.Queue()

        async def pump(job: Job, agen: AsyncIterator[GenerationOutput]) -> None:
            try:
                async for step in self._guard(self.run(job, self._texts(job), agen)):
                    queue.put_nowait((job, step))
            except Exception as exc:  # noqa: BLE001 - raised again in the stream's own task
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pump(job, agen)) for job, agen in zip(jobs, agens)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ chat
    async def chat(self, job: Job) -> dict:
        choices, n_out, prompt_lp = [], 0, None
        for i, (last, text) in enumerate(await self._finals(job)):
            out = last.out
            prompt_lp = prompt_lp or self._prompt_lp(job, out)
            lp = self._chat_lp(job, out.token_ids, out.logprobs, out.top_logprobs) if job.logprobs else None
            content, calls, finish = self._tool_calls(job, text, last.finish)
            choices.append(S.chat_choice(i, content, finish, last.stop_reason, lp,
                                         out.token_ids if job.return_token_ids else None,
                                         [c.as_openai() for c in calls] or None))
            n_out += len(out.token_ids)
        return S.chat_response(job.rid, self.model_name, choices,
                               job.prompt_ids if job.return_token_ids else None,
                               len(job.prompt_ids), n_out, prompt_lp)

    @staticmethod
    def _tool_calls(job: Job, text: str, finish: str) -> tuple[str | None, list[ToolCall], str]:
        """The answer's content, tool calls and finish reason (tool_calls.answer_calls)."""
        return answer_calls(text, finish, job.tools, job.parallel_tool_calls)

    def chat_stream(self, job: Job) -> AsyncIterator[str]:
        """The SSE text; the engine refuses a bad request here, before any of it is sent."""
        return self._chat_stream(job, self.start(job))

    async def _chat_stream(self, job: Job, agen: AsyncIterator[GenerationOutput]) -> AsyncIterator[str]:
        n_prompt = len(job.prompt_ids)
        for i in range(job.n):
            yield sse(S.chat_first_chunk(job.rid, self.model_name, job.created,
                                         job.prompt_ids if job.return_token_ids and i == 0 else None,
                                         index=i, usage=self._chat_usage(job, 0)))
        if job.parse_tools:  # a call is known only once its block closes: one delta at the end
            async for chunk in self._chat_stream_with_tools(job, agen):
                yield chunk
            return
        n_out = [0] * job.n
        async for step in self._guard(self.run(job, self._texts(job), agen)):
            if isinstance(step, str):
                yield step
                return
            lp = (self._chat_lp(job, step.new_ids, step.new_logprobs, step.new_top,
                                before=step.out.token_ids[:len(step.out.token_ids) - len(step.new_ids)])
                  if job.logprobs else None)
            n_out[step.index] = len(step.out.token_ids)
            yield sse(S.chat_chunk(job.rid, self.model_name, job.created, step.text, step.finish,
                                   step.stop_reason, lp, step.new_ids if job.return_token_ids else None,
                                   last=bool(step.finish) and not job.include_usage, index=step.index,
                                   usage=self._chat_usage(job, n_out[step.index])))
        if job.include_usage:
            yield sse(S.usage_chunk(job.rid, self.model_name, job.created, "chat.completion.chunk",
                                    n_prompt, sum(n_out)))
        yield DONE

    @staticmethod
    def _chat_usage(job: Job, n_out: int) -> dict | None:
        """A chat chunk's continuous usage (None unless asked for): vLLM's shape there names
        completion_tokens_details (null without a reasoning parser)."""
        if not job.continuous_usage:
            return None
        return {**S.usage(len(job.prompt_ids), n_out, details=False), "completion_tokens_details": None}

    async def _chat_stream_with_tools(self, job: Job, agen: AsyncIterator[GenerationOutput]
                                      ) -> AsyncIterator[str]:
        parts: dict[int, list[str]] = {i: [] for i in range(job.n)}
        new_ids: dict[int, list[int]] = {i: [] for i in range(job.n)}
        n_out = 0
        async for step in self._guard(self.run(job, self._texts(job), agen)):
            if isinstance(step, str):
                yield step
                return
            i = step.index
            parts[i].append(step.text)
            new_ids[i] += step.new_ids
            if step.finish is None:
                continue
            out = step.out
            n_out += len(out.token_ids)
            content, calls, finish = self._tool_calls(job, "".join(parts[i]), step.finish)
            lp = self._chat_lp(job, out.token_ids, out.logprobs, out.top_logprobs) if job.logprobs else None
            chunk = S.chat_chunk(job.rid, self.model_name, job.created, content or "", finish,
                                 step.stop_reason, lp, new_ids[i] if job.return_token_ids else None,
                                 last=not job.include_usage, index=i,
                                 usage=self._chat_usage(job, len(out.token_ids)))
            if calls:
                chunk["choices"][0]["delta"]["tool_calls"] = [c.as_openai(j) for j, c in enumerate(calls)]
            yield sse(chunk)
        if job.include_usage:
            yield sse(S.usage_chunk(job.rid, self.model_name, job.created, "chat.completion.chunk",
                                    len(job.prompt_ids), n_out))
        yield DONE

    # ------------------------------------------------------------ token-level generate
    def _generate_lp(self, job: Job, ids: list[int], lps: list[float], tops: list[TopLogprobs]) -> dict:
        return S.generate_logprobs(ids, lps, tops or None, job.top_logprobs)

    async def generate(self, job: Job) -> dict:
        choices, prompt_lp = [], None
        for i, (last, _) in enumerate(await self._finals(job, always=False)):
            out = last.out
            prompt_lp = prompt_lp or self._prompt_lp(job, out)
            ids = out.token_ids
            lp = self._generate_lp(job, ids, out.logprobs, out.top_logprobs) if job.logprobs else None
            if self.generation_log is not None:
                self.generation_log.write(out.request_id, job.prompt_ids, ids, list(out.logprobs),
                                          last.finish)
            choices.append(S.generate_choice(i, last.finish, last.stop_reason, ids, lp,
                                             S.weight_spans(out.weight_versions, len(ids))))
        return S.generate_response(job.rid, self.model_name, choices,
                                   job.prompt_ids if job.return_token_ids else None, len(job.prompt_ids),
                                   prompt_lp)

    def generate_stream(self, job: Job) -> AsyncIterator[str]:
        """The SSE text; the engine refuses a bad request here, before any of it is sent."""
        return self._generate_stream(job, self.start(job))

    async def _generate_stream(self, job: Job, agen: AsyncIterator[GenerationOutput]) -> AsyncIterator[str]:
        prompt, n_out = (job.prompt_ids if job.return_token_ids else None), [0] * job.n
        async for step in self._guard(self.run(job, self._texts(job, always=False), agen)):
            if isinstance(step, str):
                yield step
                return
            n_out[step.index] = len(step.out.token_ids)
            spans = S.weight_spans(step.out.weight_versions, n_out[step.index]) if step.finish else None
            lp = self._generate_lp(job, step.new_ids, step.new_logprobs, step.new_top) if job.logprobs else None
            usage = (S.usage(len(job.prompt_ids), n_out[step.index]) if job.continuous_usage else None)
            yield sse(S.generate_chunk(job.rid, step.finish, step.stop_reason, step.new_ids, lp, spans,
                                       prompt, index=step.index, usage=usage))
            prompt = None
        if job.include_usage:
            yield sse(S.generate_usage_chunk(job.rid, len(job.prompt_ids), sum(n_out)))
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
        self.requests.check_ids(req.tokens, "tokens")
        return {"prompt": self.tok.decode(req.tokens)}

    def models(self) -> dict:
        return S.models_response(self.model_name, self.model_root, self.engine.max_model_len, self.created)
