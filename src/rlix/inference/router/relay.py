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

Known approximations: a stop string split across two attempts is not seen; weight-version spans
of tokens streamed by a shard that then died without an abort event are labelled "unknown".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rlix.errors import NoActiveShardError, ShardPreemptedError
from rlix.inference.server import openai_schema as S
from rlix.inference.server.paths import CHAT, COMPLETIONS, GENERATE
from rlix.inference.router.shard_table import Shard, ShardState, ShardTable
from rlix.httpkit import HttpPool, UpstreamError, UpstreamResponse, bearer

MAX_ATTEMPTS = 64
#: how often a DOWN shard's /health is tried (it goes back to its state when it answers)
REVIVE_S = 1.0


@dataclass
class Progress:
    """What all attempts of one request produced so far."""

    path: str
    body: dict
    wants_ids: bool
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    lp_tokens: list[str] = field(default_factory=list)
    lp_values: list[float] = field(default_factory=list)
    gen_logprobs: list[dict] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)
    base: int = 0  # len(ids) when the current attempt began: its spans start there
    attempts: int = 0
    down_cuts: int = 0  # attempts cut because their shard could not be reached
    last_down: str = ""

    @property
    def max_tokens(self) -> int | None:
        if self.path == GENERATE:
            return self.body.get("sampling_params", {}).get("max_tokens", 16)
        if self.path == CHAT:
            mt = self.body.get("max_completion_tokens")
            return mt if mt is not None else self.body.get("max_tokens")
        return self.body.get("max_tokens", 16)

    def upstream(self) -> tuple[str, dict]:
        """Path and body for the next attempt."""
        self.base = len(self.ids)
        if self.prompt_ids is None:  # nothing came back yet: send the request as it was
            if self.path == GENERATE:  # output ids always come back; the prompt is in the body
                return self.path, self.body
            return self.path, {**self.body, "return_token_ids": True}
        left = None if self.max_tokens is None else self.max_tokens - len(self.ids)
        if self.path == GENERATE:
            sp = {**self.body.get("sampling_params", {}), "max_tokens": left}
            return GENERATE, {**self.body, "token_ids": self.prompt_ids + self.ids, "sampling_params": sp,
                              "return_token_ids": True}
        keep = {k: v for k, v in self.body.items()
                if k in ("model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                         "ignore_eos", "stream", "stream_options")}
        body = {**keep, "prompt": self.prompt_ids + self.ids, "return_token_ids": True}
        if left is not None:
            body["max_tokens"] = left
        if self.body.get("logprobs"):
            body["logprobs"] = 0
        return COMPLETIONS, body

    def see_prompt(self, resp: dict, choice: dict) -> None:
        if self.prompt_ids is None:
            pids = self.body.get("token_ids") if self.path == GENERATE else (
                resp.get("prompt_token_ids") or choice.get("prompt_token_ids"))
            if pids is not None:
                self.prompt_ids = list(pids)

    def add(self, path: str, choice: dict) -> None:
        """Take an attempt's output (whole or one chunk) into the running total."""
        self.ids.extend(choice.get("token_ids") or [])
        self.text += choice.get("text") or (choice.get("message") or {}).get("content") or \
            (choice.get("delta") or {}).get("content") or ""
        lp = choice.get("logprobs")
        if lp and path == COMPLETIONS:
            self.lp_tokens += lp.get("tokens", [])
            self.lp_values += lp.get("token_logprobs", [])
        elif lp and path == CHAT:
            for item in lp.get("content") or []:
                self.lp_tokens.append(item["token"])
                self.lp_values.append(item["logprob"])
        elif lp and path == GENERATE:
            self.gen_logprobs += lp.get("content") or []
        spans = choice.get("weight_versions")
        if spans:
            b = self.base
            self.spans += [{**s, "start": s["start"] + b, "end": s["end"] + b} for s in spans]

    def close_attempt_without_spans(self) -> None:
        """A generate stream died before its final chunk: its tokens' versions are unknown."""
        if self.path == GENERATE and len(self.ids) > self.base:
            covered = self.spans[-1]["end"] if self.spans else 0
            if covered < len(self.ids):
                self.spans.append({"version": "unknown", "start": covered, "end": len(self.ids)})

    def n_prompt(self) -> int:
        return len(self.prompt_ids or [])


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

    async def _acquire(self, session: str | None, exclude: set[int], prog: Progress) -> Shard:
        prog.attempts += 1
        if prog.attempts > MAX_ATTEMPTS:
            cuts = MAX_ATTEMPTS - prog.down_cuts
            down = f", {prog.down_cuts} by shards down (last: {prog.last_down})" if prog.down_cuts else ""
            raise NoActiveShardError(f"request cut {MAX_ATTEMPTS} times ({cuts} by preemption{down}); "
                                     f"giving up")
        return await self.table.acquire(session, self.hold_timeout_s, frozenset(exclude))

    def _unreachable(self, shard: Shard, exc: Exception, prog: Progress) -> None:
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
        prog = Progress(path, body, bool(body.get("return_token_ids")))
        raw_ok = path == GENERATE or prog.wants_ids  # nothing to blank in the common case
        exclude: set[int] = set()
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
                if raw_ok and prog.attempts == 1 and b'"abort"' not in raw:
                    done = True
                    return 200, raw  # the hot path: no parse, no re-serialisation
                data = json.loads(raw)
                choice = data["choices"][0]
                prog.see_prompt(data, choice)
                if self._cut(shard, 200, choice.get("finish_reason")):
                    prog.add(up_path, choice)
                    raise ShardPreemptedError(f"shard {shard.rank} preempted mid-request")
                done = True
                if prog.attempts == 1:  # the common case: one attempt
                    if not prog.wants_ids:
                        _blank_ids(data, choice, path)
                    return 200, data
                prog.add(up_path, choice)
                return 200, self._merged(prog, data, choice)
            except ShardPreemptedError:
                self._redispatch(shard, exclude)
            finally:
                self.table.release(shard, done)

    def _merged(self, prog: Progress, last: dict, choice: dict) -> dict:
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        ids = prog.ids if prog.wants_ids else None
        pids = prog.prompt_ids if prog.wants_ids else None
        rid = last.get("id") or last.get("request_id") or ""
        model = last.get("model") or prog.body.get("model") or ""
        if prog.path == GENERATE:
            lp = {"content": prog.gen_logprobs} if choice.get("logprobs") is not None else None
            return S.generate_response(rid, model, finish, stop_reason, prog.ids, lp, prog.spans,
                                       pids, prog.n_prompt())
        if prog.path == CHAT:
            lp = (S.chat_logprobs(prog.lp_tokens, prog.lp_values, bool(prog.body.get("top_logprobs")))
                  if prog.body.get("logprobs") else None)
            return S.chat_response(S.new_id("chatcmpl"), model, prog.text, finish, stop_reason, lp, ids,
                                   pids, prog.n_prompt(), len(prog.ids))
        lp = (S.completion_logprobs(prog.lp_tokens, prog.lp_values)
              if prog.body.get("logprobs") is not None else None)
        return S.completion_response(rid, model, prog.text, finish, stop_reason, lp, ids, pids,
                                     prog.n_prompt(), len(prog.ids))

    # ------------------------------------------------------------ streaming
    async def _connect(self, prog: Progress, session: str | None, exclude: set[int]
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
        prog = Progress(path, body, bool(body.get("return_token_ids")))
        exclude: set[int] = set()
        opened = await self._connect(prog, session, exclude)
        if isinstance(opened[0], int):
            return opened  # type: ignore[return-value]
        return self._stream(prog, opened, session, exclude)  # type: ignore[arg-type]

    async def _stream(self, prog: Progress, opened: tuple[Shard, str, UpstreamResponse],
                      session: str | None, exclude: set[int]) -> AsyncIterator[str]:
        opts = prog.body.get("stream_options")
        wants_usage = bool(opts and opts.get("include_usage", True))
        ident: dict[str, Any] = {}
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
                        if choice.get("text") or (choice.get("delta") or {}).get("content") \
                                or choice.get("token_ids"):
                            yield self._rechunk(prog, chunk, choice, up_path, ident, wants_usage)
                        break
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
        if wants_usage:
            yield self._usage(prog, ident)
        yield "data: [DONE]\n\n"

    def _rechunk(self, prog: Progress, chunk: dict, choice: dict, up_path: str, ident: dict,
                 wants_usage: bool) -> str:
        """An upstream chunk in the caller's format, under the first attempt's id."""
        finish = choice.get("finish_reason")
        if up_path == prog.path:  # same endpoint: keep the chunk, fix ids and the request id
            out = {**chunk, **{k: v for k, v in ident.items() if k in chunk}}
            c = dict(choice)
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
            lp = S.chat_logprobs(choice["logprobs"].get("tokens", []),
                                 choice["logprobs"].get("token_logprobs", []),
                                 bool(prog.body.get("top_logprobs")))
        ids = choice.get("token_ids") if prog.wants_ids else None
        return _sse(S.chat_chunk(ident.get("id", ""), ident.get("model", ""), ident.get("created", 0),
                                 choice.get("text", ""), finish, choice.get("stop_reason"), lp, ids,
                                 last=finish is not None and not wants_usage))

    def _usage(self, prog: Progress, ident: dict) -> str:
        if prog.path == GENERATE:
            return _sse(S.generate_usage_chunk(ident.get("request_id", ""), prog.n_prompt(), len(prog.ids)))
        obj = "chat.completion.chunk" if prog.path == CHAT else "text_completion"
        return _sse(S.usage_chunk(ident.get("id", ""), ident.get("model", ""), ident.get("created", 0), obj,
                                  prog.n_prompt(), len(prog.ids)))
