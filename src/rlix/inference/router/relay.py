"""Forwarding one data-plane request to shards, re-dispatching it when a shard is taken away.

A request cut by preemption (finish_reason "abort" from a shard marked PREEMPTED, a 503 from a
shard that is no longer active, or a connection error) raises `ShardPreemptedError` inside the
relay (a connection error to a shard that is not being preempted also marks it DOWN: see
`_unreachable`); the relay then sends the *rest* of the request to another active shard, token-level: the
prompt ids plus every token generated so far, and max_tokens minus those. The caller sees one
answer: texts, token ids, logprobs and weight-version spans of all attempts joined, usage counted
against the original prompt. Upstream calls always ask for `return_token_ids`; the ids are
blanked again unless the caller asked for them. A chat request continues through
/v1/completions on the already-templated prompt ids.

A constrained request (response_format, structured_outputs, a forced tool call) continues under
its constraint from where the cut attempt left its grammar (attempts.py: `already_generated`). A
chat whose answer is parsed for tool calls gets them parsed from every attempt's text joined
(a shard leaves a cut answer unparsed); streamed, its text comes in one delta at the end, as a
shard streams such a chat.

A request of n > 1 samples goes whole to one shard (its samples share the prefill there). If
that attempt is cut, each sample cut short is continued on its own, token-level as above (its
prompt ids + its tokens, seed + index when seeded, as the engine seeds sample `index`), all of
them concurrently; finished samples are kept. The caller still sees one answer: n choices by
index (streamed: chunks of every sample, one usage chunk, one [DONE]).

Known approximations: a stop string split across two attempts is not seen; weight-version spans
of tokens streamed by a shard that then died without an abort event are labelled "unknown";
presence and frequency penalties, which count generated tokens, do not count those of earlier
attempts (they are the next attempt's prompt); a continued chat's top_logprobs come through
/v1/completions, whose {text: logprob} maps merge alternatives that decode to the same text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from rlix.errors import NoActiveShardError, ShardPreemptedError
from rlix.inference.server import openai_schema as S
from rlix.inference.server.paths import CHAT, GENERATE
from rlix.inference.server.tool_calls import answer_calls
from rlix.inference.router.attempts import Attempts, chat_items, requested_n
from rlix.inference.router.shard_table import Shard, ShardState, ShardTable
from rlix.httpkit import HttpPool, UpstreamError, UpstreamResponse, bearer

MAX_ATTEMPTS = 64
#: how often a DOWN shard's /health is tried (it goes back to its state when it answers)
REVIVE_S = 1.0
def _blank_ids(resp: dict, choice: dict, path: str) -> None:
    """Undo the router's `return_token_ids` (generate always returns output ids)."""
    for obj in (resp, choice):
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
    if "token_ids" in choice and path != GENERATE:
        choice["token_ids"] = None


def _json_or_error(raw: bytes, status: int) -> dict:
    try:
        return json.loads(raw)
    except ValueError:
        return S.error_body(raw.decode(errors="replace")[:500], "UpstreamError", status)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Relay:
    """Dispatch with re-dispatch over a ShardTable; one per router."""

    def __init__(self, table: ShardTable, pool: HttpPool, shard_api_key: str,
                 hold_timeout_s: float = 60.0) -> None:
        self.table = table
        self.pool = pool
        self.headers = bearer(shard_api_key)
        self.hold_timeout_s = hold_timeout_s
        self.redispatched = 0
        self.requests = 0
        self.down_marks = 0  # shards found unreachable
        self._revivers: set[asyncio.Task] = set()

    def _cut(self, shard: Shard, status: int | None = None, finish: str | None = None) -> bool:
        """Did this attempt end because its shard is being taken away?"""
        if status is None:
            return True  # connection error
        if status == 503:
            return shard.state is not ShardState.ACTIVE
        return finish == "abort" and self.table.is_preempted(shard.rank)

    async def _acquire(self, session: str | None, exclude: set[int], prog: Attempts) -> Shard:
        prog.attempts += 1
        if prog.attempts > MAX_ATTEMPTS:
            cuts = MAX_ATTEMPTS - prog.down_cuts
            down = f", {prog.down_cuts} by shards down (last: {prog.last_down})" if prog.down_cuts else ""
            raise NoActiveShardError(f"request cut {MAX_ATTEMPTS} times ({cuts} by preemption{down}); "
                                     f"giving up")
        return await self.table.acquire(session, self.hold_timeout_s, frozenset(exclude))

    def _unreachable(self, shard: Shard, exc: Exception, prog: Attempts) -> None:
        """A connection to `shard` failed: unless it is being preempted (then it is a preemption
        cut), it is DOWN until its /health answers again or the fleet replaces it."""
        if shard.state is ShardState.PREEMPTED:
            return
        prog.down_cuts += 1
        prog.last_down = f"shard {shard.rank}: {exc}"[:200]
        if self.table.mark_down(shard.rank, str(exc)):
            self.down_marks += 1
            task = asyncio.get_running_loop().create_task(self._revive(shard.rank, shard.url))
            self._revivers.add(task)
            task.add_done_callback(self._revivers.discard)

    async def _revive(self, rank: int, url: str) -> None:
        while True:
            await asyncio.sleep(REVIVE_S)
            shard = self.table.shards.get(rank)
            if shard is None or shard.state is not ShardState.DOWN or shard.url != url:
                return  # removed, replaced or set anew by the fleet
            try:
                resp = await self.pool.request("GET", url, "/health", b"", self.headers)
                await resp.read()
            except UpstreamError:
                continue
            if resp.status_code == 200:
                self.table.revive(rank, url)
                return

    def down_shards(self) -> list[dict]:
        return [s.view() for s in self.table.down()]

    def _redispatch(self, shard: Shard, exclude: set[int]) -> None:
        exclude.add(shard.rank)
        self.redispatched += 1

    # ------------------------------------------------------------ unary
    async def unary(self, path: str, body: dict, session: str | None) -> tuple[int, dict | bytes]:
        """(status, answer); the answer is the shard's raw JSON bytes when nothing needs fixing."""
        self.requests += 1
        n = requested_n(path, body)
        if n > 1:
            return await self._unary_n(path, body, session, n)
        return await self._unary(Attempts(path, body, bool(body.get("return_token_ids"))), session, set())

    async def _send(self, prog: Attempts, session: str | None, exclude: set[int],
                    answer: Callable[[Shard, str, bytes], Any]) -> tuple[int, Any]:
        """Send prog's request to shards until one answers for good: (status, error body) for a
        refusal, else (200, `answer(shard, upstream path, raw body)`). An unreachable or preempted
        shard, or `answer` raising ShardPreemptedError, sends it again elsewhere."""
        while True:
            shard = await self._acquire(session, exclude, prog)
            up_path, up_body = prog.upstream()
            done = False
            try:
                try:
                    status, raw = await self.pool.post_json(shard.url, up_path, up_body, self.headers)
                except UpstreamError as exc:
                    self._unreachable(shard, exc, prog)
                    raise ShardPreemptedError(f"shard {shard.rank}: {exc}") from None
                if status != 200:
                    if self._cut(shard, status):
                        raise ShardPreemptedError(f"shard {shard.rank} answered {status}")
                    done = True
                    return status, _json_or_error(raw, status)
                result = answer(shard, up_path, raw)
                done = True
                return 200, result
            except ShardPreemptedError:
                self._redispatch(shard, exclude)
            finally:
                self.table.release(shard, done)

    async def _unary(self, prog: Attempts, session: str | None, exclude: set[int]
                     ) -> tuple[int, dict | bytes]:
        path = prog.path
        raw_ok = path == GENERATE or prog.wants_ids  # nothing to blank in the common case

        def answer(shard: Shard, up_path: str, raw: bytes) -> dict | bytes:
            if raw_ok and prog.fresh and b'"abort"' not in raw:
                return raw  # the hot path: no parse, no re-serialisation
            data = json.loads(raw)
            choice = data["choices"][0]
            prog.see_prompt(data, choice)
            if self._cut(shard, 200, choice.get("finish_reason")):
                prog.add(up_path, choice)
                raise ShardPreemptedError(f"shard {shard.rank} preempted mid-request")
            if prog.fresh:  # the common case: one attempt
                if not prog.wants_ids:
                    _blank_ids(data, choice, path)
                return data
            prog.add(up_path, choice)
            return self._merged(prog, data, choice)

        return await self._send(prog, session, exclude, answer)

    def _merged_choice(self, prog: Attempts, choice: dict) -> dict:
        """One choice of all attempts joined; `choice` is the last attempt's."""
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        ids = prog.ids if prog.wants_ids else None
        if prog.path == GENERATE:
            lp = {"content": prog.gen_logprobs} if choice.get("logprobs") is not None else None
            return S.generate_choice(prog.index, finish, stop_reason, prog.ids, lp, prog.spans)
        if prog.path == CHAT:
            lp = {"content": prog.lp_items} if prog.body.get("logprobs") else None
            content, found, finish = answer_calls(prog.text, finish, prog.tools, prog.parallel_calls)
            calls = [c.as_openai() for c in found] if prog.tools.parse else None
            return S.chat_choice(prog.index, content, finish, stop_reason, lp, ids, calls)
        lp = (S.completion_logprobs(prog.lp_tokens, prog.lp_values, 0, prog.lp_top)
              if prog.body.get("logprobs") is not None else None)
        return S.completion_choice(prog.index, prog.text, lp, finish, stop_reason, ids,
                                   prog.prompt_ids if prog.wants_ids else None)

    def _merged(self, prog: Attempts, last: dict, choice: dict) -> dict:
        rid = last.get("id") or last.get("request_id") or ""
        model = last.get("model") or prog.body.get("model") or ""
        merged = self._merged_choice(prog, choice)
        pids = prog.prompt_ids if prog.wants_ids else None
        if prog.path == GENERATE:
            return S.generate_response(rid, model, [merged], pids, prog.n_prompt())
        if prog.path == CHAT:
            return S.chat_response(S.new_id("chatcmpl"), model, [merged], pids, prog.n_prompt(),
                                   len(prog.ids))
        return S.completion_response(rid, model, [merged], prog.n_prompt(), len(prog.ids))

    async def _unary_n(self, path: str, body: dict, session: str | None, n: int) -> tuple[int, dict | bytes]:
        """n samples: the whole request on one shard; the samples it cut continue on their own."""
        wants_ids = bool(body.get("return_token_ids"))
        first = Attempts(path, body, wants_ids)
        exclude: set[int] = set()

        def answer(shard: Shard, up_path: str, raw: bytes) -> tuple[dict, set[int], int]:
            data = json.loads(raw)
            cut = {c["index"] for c in data["choices"] if self._cut(shard, 200, c.get("finish_reason"))}
            return data, cut, shard.rank

        status, got = await self._send(first, session, exclude, answer)
        if status != 200:
            return status, got
        data, cut, rank = got
        choices = data["choices"]
        pids = body.get("token_ids") if path == GENERATE else (
            data.get("prompt_token_ids") or choices[0].get("prompt_token_ids"))
        n_out = sum(len(c.get("token_ids") or []) for c in choices if c["index"] not in cut)
        if cut:
            exclude.add(rank)
            self.redispatched += len(cut)  # each cut sample is re-dispatched on its own
            lanes = []
            for c in choices:
                if c["index"] in cut:
                    lane = Attempts.lane(path, body, wants_ids, c["index"])
                    lane.prompt_ids = list(pids) if pids is not None else None
                    lane.add(path, c)
                    lanes.append(lane)
            answers = await asyncio.gather(*(self._unary(lane, session, set(exclude)) for lane in lanes))
            for lane, (status, answer) in zip(lanes, answers):
                if status != 200:
                    return status, answer
                merged = (json.loads(answer) if isinstance(answer, bytes) else answer)["choices"][0]
                choices[lane.index] = merged
                n_out += len(lane.ids)
        for c in choices:
            if not wants_ids:
                _blank_ids(data, c, path)
        if cut:
            n_prompt = len(pids or [])
            data["usage"] = S.usage(n_prompt, n_out)
        return 200, data

    # ------------------------------------------------------------ streaming
    async def _connect(self, prog: Attempts, session: str | None, exclude: set[int]
                       ) -> tuple[Shard, str, UpstreamResponse] | tuple[int, dict]:
        """Open the next attempt's stream, skipping shards that are going away."""
        while True:
            shard = await self._acquire(session, exclude, prog)
            path, body = prog.upstream()
            try:
                resp = await self.pool.request("POST", shard.url, path, json.dumps(body).encode(),
                                               {**self.headers, "content-type": "application/json"})
                if resp.status_code == 200:
                    return shard, path, resp
                raw = await resp.read()
            except UpstreamError as exc:
                self.table.release(shard, False)
                self._unreachable(shard, exc, prog)
                self._redispatch(shard, exclude)
                continue
            self.table.release(shard, False)
            if not self._cut(shard, resp.status_code):
                return resp.status_code, _json_or_error(raw, resp.status_code)
            self._redispatch(shard, exclude)

    async def open_stream(self, path: str, body: dict, session: str | None
                          ) -> tuple[int, dict] | AsyncIterator[str]:
        """Either an error answer to pass on (status, body) or the SSE text to stream back."""
        self.requests += 1
        prog = Attempts(path, body, bool(body.get("return_token_ids")))
        exclude: set[int] = set()
        opened = await self._connect(prog, session, exclude)
        if isinstance(opened[0], int):
            return opened  # type: ignore[return-value]
        n = requested_n(path, body)
        if n > 1:
            return self._stream_n(prog, n, opened, session, exclude)  # type: ignore[arg-type]
        return self._stream(prog, opened, session, exclude)  # type: ignore[arg-type]

    async def _stream(self, prog: Attempts, opened: tuple[Shard, str, UpstreamResponse],
                      session: str | None, exclude: set[int], ident: dict[str, Any] | None = None,
                      tail: bool = True) -> AsyncIterator[str]:
        """One choice's stream over as many attempts as it takes; `tail`: end with the usage
        chunk (if asked for) and [DONE] (a sample of an n > 1 request leaves them to its caller,
        which also gives the request's `ident`)."""
        opts = prog.body.get("stream_options")
        wants_usage = bool(opts and opts.get("include_usage", True))
        ident = dict(ident or {})
        shard, up_path, resp = opened
        while True:
            cut = done = False
            try:
                async for line in resp.lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        yield line + "\n\n"
                        done = True
                        continue
                    if not chunk.get("choices"):
                        continue  # upstream usage: ours counts all attempts
                    choice = chunk["choices"][0]
                    prog.see_prompt(chunk, choice)
                    ident = ident or {k: chunk[k] for k in ("id", "request_id", "created", "model") if k in chunk}
                    finish = choice.get("finish_reason")
                    prog.add(up_path, choice)
                    if finish is not None and self._cut(shard, 200, finish):
                        cut = True
                        choice = {**choice, "finish_reason": None, "stop_reason": None}
                        if not prog.holds_calls and (choice.get("text") or (choice.get("delta") or {}).get(
                                "content") or choice.get("token_ids")):
                            yield self._rechunk(prog, chunk, choice, up_path, ident, wants_usage)
                        break
                    if prog.holds_calls and up_path != prog.path:
                        # a continued chat with tools: its calls are parsed from the whole text
                        if finish is not None:
                            yield self._calls_chunk(prog, choice, ident, wants_usage)
                    else:
                        yield self._rechunk(prog, chunk, choice, up_path, ident, wants_usage)
                    done = done or finish is not None
            except UpstreamError as exc:
                cut = not done
                prog.close_attempt_without_spans()
                if cut:
                    self._unreachable(shard, exc, prog)
            finally:
                await resp.aclose()
                self.table.release(shard, done)
            if not cut:
                break
            self._redispatch(shard, exclude)
            try:
                opened_next = await self._connect(prog, session, exclude)
            except NoActiveShardError as exc:  # headers are sent: report it in the stream
                opened_next = (503, S.error_body(str(exc), "ServiceUnavailableError", 503))
            if isinstance(opened_next[0], int):
                yield _sse(opened_next[1])  # type: ignore[arg-type]
                break
            shard, up_path, resp = opened_next  # type: ignore[misc]
        if tail and wants_usage:
            yield self._usage(prog.path, ident, prog.n_prompt(), len(prog.ids))
        if tail:
            yield "data: [DONE]\n\n"

    async def _stream_n(self, first: Attempts, n: int, opened: tuple[Shard, str, UpstreamResponse],
                        session: str | None, exclude: set[int]) -> AsyncIterator[str]:
        """n samples: the whole request's stream from one shard; if it is cut, the samples it
        cut continue each on its own (concurrently), their chunks under their index."""
        path, body = first.path, first.body
        opts = body.get("stream_options")
        wants_usage = bool(opts and opts.get("include_usage", True))
        lanes = [Attempts.lane(path, body, first.wants_ids, i) for i in range(n)]
        pids = body.get("token_ids") if path == GENERATE else None
        ident: dict[str, Any] = {}
        finished: set[int] = set()
        cut: set[int] = set()
        shard, up_path, resp = opened
        try:
            async for line in resp.lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    yield line + "\n\n"
                    finished.update(range(n))
                    continue
                if not chunk.get("choices"):
                    continue  # upstream usage: ours counts all attempts
                choice = chunk["choices"][0]
                lane = lanes[choice.get("index", 0)]
                found = chunk.get("prompt_token_ids") or choice.get("prompt_token_ids")
                if pids is None and found:
                    pids = list(found)
                ident = ident or {k: chunk[k] for k in ("id", "request_id", "created", "model") if k in chunk}
                finish = choice.get("finish_reason")
                lane.add(up_path, choice)
                if finish is not None and self._cut(shard, 200, finish):
                    cut.add(lane.index)
                    choice = {**choice, "finish_reason": None, "stop_reason": None}
                    if not lane.holds_calls and (choice.get("text") or (choice.get("delta") or {}).get(
                            "content") or choice.get("token_ids")):
                        yield self._rechunk(lane, chunk, choice, up_path, ident, wants_usage)
                    continue
                yield self._rechunk(lane, chunk, choice, up_path, ident, wants_usage)
                if finish is not None:
                    finished.add(lane.index)
        except UpstreamError as exc:
            left = [i for i in range(n) if i not in finished and i not in cut]
            if left:
                self._unreachable(shard, exc, first)
            for i in left:
                lanes[i].close_attempt_without_spans()
                cut.add(i)
        finally:
            await resp.aclose()
            self.table.release(shard, not cut)
        if cut:
            exclude.add(shard.rank)
            self.redispatched += len(cut)
            continued = [lanes[i] for i in sorted(cut)]
            for lane in continued:
                lane.prompt_ids = list(pids) if pids is not None else None
            async for piece in self._merge_lanes(continued, session, exclude, ident):
                yield piece
        if wants_usage:
            yield self._usage(path, ident, len(pids or []), sum(len(lane.ids) for lane in lanes))
        yield "data: [DONE]\n\n"

    async def _merge_lanes(self, lanes: list[Attempts], session: str | None, exclude: set[int],
                           ident: dict[str, Any]) -> AsyncIterator[str]:
        """The continued samples' streams, concurrently, as their chunks come."""
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        async def run(lane: Attempts) -> None:
            try:
                try:
                    opened = await self._connect(lane, session, set(exclude))
                except NoActiveShardError as exc:
                    opened = (503, S.error_body(str(exc), "ServiceUnavailableError", 503))
                if isinstance(opened[0], int):
                    await queue.put(_sse(opened[1]))  # type: ignore[arg-type]
                    return
                pieces = self._stream(lane, opened, session, set(exclude), ident, tail=False)  # type: ignore[arg-type]
                async for piece in pieces:
                    await queue.put(piece)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
                await queue.put(_sse(S.error_body(f"sample {lane.index}: {exc}", "InternalServerError", 500)))
            finally:
                await queue.put(None)

        tasks = [asyncio.get_running_loop().create_task(run(lane)) for lane in lanes]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _rechunk(self, prog: Attempts, chunk: dict, choice: dict, up_path: str, ident: dict,
                 wants_usage: bool) -> str:
        """An upstream chunk in the caller's format, under the first attempt's id."""
        finish = choice.get("finish_reason")
        usage = self._running_usage(prog, chunk)
        if up_path == prog.path:  # same endpoint: keep the chunk, fix ids and the request id
            out = {**chunk, **{k: v for k, v in ident.items() if k in chunk}}
            if usage is not None:
                out["usage"] = usage
            c = {**choice, "index": prog.index}
            if not prog.wants_ids:
                _blank_ids(out, c, prog.path)
                if prog.path == GENERATE:  # vLLM omits it from generate chunks
                    out.pop("prompt_token_ids", None)
            if finish is not None and prog.path == GENERATE:
                c["weight_versions"] = prog.spans
            if finish is not None and "system_fingerprint" in out and wants_usage:
                del out["system_fingerprint"]
            out["choices"] = [c]
            return _sse(out)
        # a chat request continued through /v1/completions
        lp = None
        if prog.body.get("logprobs") and choice.get("logprobs"):
            lp = {"content": chat_items(choice["logprobs"], prog.chat_top)}
        ids = choice.get("token_ids") if prog.wants_ids else None
        return _sse(S.chat_chunk(ident.get("id", ""), ident.get("model", ""), ident.get("created", 0),
                                 choice.get("text", ""), finish, choice.get("stop_reason"), lp, ids,
                                 last=finish is not None and not wants_usage, index=prog.index,
                                 usage=usage))

    def _calls_chunk(self, prog: Attempts, choice: dict, ident: dict, wants_usage: bool) -> str:
        """The one delta of a re-dispatched chat with tools: content and tool calls parsed from
        every attempt's text (a shard streams such a chat the same way: all of it at the end,
        and a cut attempt's text is held back, unparsed), with every attempt's ids and logprobs."""
        content, calls, finish = answer_calls(prog.text, choice.get("finish_reason"), prog.tools,
                                              prog.parallel_calls)
        lp = {"content": prog.lp_items} if prog.body.get("logprobs") else None
        chunk = S.chat_chunk(ident.get("id", ""), ident.get("model", ""), ident.get("created", 0),
                             content or "", finish, choice.get("stop_reason"), lp,
                             prog.ids if prog.wants_ids else None, last=not wants_usage, index=prog.index,
                             usage=self._running_usage(prog, {}))
        if calls:
            chunk["choices"][0]["delta"]["tool_calls"] = [c.as_openai(j) for j, c in enumerate(calls)]
        return _sse(chunk)

    @staticmethod
    def _running_usage(prog: Attempts, chunk: dict) -> dict | None:
        """A chunk's continuous usage (stream_options.continuous_usage_stats) counted over every
        attempt of its choice, in the caller's endpoint's shape; None when not asked for."""
        opts = prog.body.get("stream_options")
        if not (isinstance(opts, dict) and opts.get("include_usage", True) and opts.get("continuous_usage_stats")):
            return None
        upstream = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else {}
        n_prompt = prog.n_prompt() if prog.prompt_ids is not None else upstream.get("prompt_tokens", 0)
        if prog.path == GENERATE:
            return S.usage(n_prompt, len(prog.ids))
        usage = S.usage(n_prompt, len(prog.ids), details=False)
        return {**usage, "completion_tokens_details": None} if prog.path == CHAT else usage

    @staticmethod
    def _usage(path: str, ident: dict, n_prompt: int, n_out: int) -> str:
        if path == GENERATE:
            return _sse(S.generate_usage_chunk(ident.get("request_id", ""), n_prompt, n_out))
        obj = "chat.completion.chunk" if path == CHAT else "text_completion"
        return _sse(S.usage_chunk(ident.get("id", ""), ident.get("model", ""), ident.get("created", 0), obj,
                                  n_prompt, n_out))
