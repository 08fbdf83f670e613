"""RemoteInferenceClient: a pipeline's handle on its inference, picklable and backend-agnostic.

Plain config (router URL, shard URLs by DP rank, token); HTTP clients are made lazily, one per
event loop, and are not pickled, so the client travels into Ray actors as is. The data plane
goes through the router and the control plane straight to the shards (fanned out concurrently
to all of them or to a given subset of DP ranks), both on the lean keep-alive pool of
`rlix.httpkit` (httpx's pool cost half a core at 64 requests in flight, and a few ms per control
call on a busy CPU). Only the HTTP API is used, so the same client drives embedded and vLLM
shards. Weight updates have their own client (rlix.weights.http_endpoint.HttpShardEndpoint).
"""

from __future__ import annotations

import asyncio
import json
import json as _json
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from rlix.errors import EngineStateError, InferenceError, InvalidRequestError
from rlix.httpkit import HttpPool, UpstreamError, bearer
from rlix.inference.server.openai_schema import answer_error

_GAUGE = re.compile(r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)


def parse_load(metrics_text: str) -> dict[str, float]:
    """{"running": n, "waiting": n} summed over engines, from a /metrics page."""
    out = {"running": 0.0, "waiting": 0.0}
    for name, value in _GAUGE.findall(metrics_text):
        out[name.rsplit("_", 1)[1]] += float(value)
    return out


class RemoteInferenceClient:
    """See module doc. `shard_urls` maps DP rank -> engine server URL."""

    def __init__(self, router_url: str | None, shard_urls: Mapping[int, str], api_key: str,
                 model: str | None = None, timeout_s: float = 600.0) -> None:
        self.router_url = router_url.rstrip("/") if router_url else None
        self.shard_urls = {int(r): u.rstrip("/") for r, u in shard_urls.items()}
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s
        self._lean: tuple[asyncio.AbstractEventLoop, HttpPool] | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_lean"] = None
        return state

    def with_shards(self, shard_urls: Mapping[int, str]) -> RemoteInferenceClient:
        return RemoteInferenceClient(self.router_url, shard_urls, self.api_key, self.model, self.timeout_s)

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.api_key)

    def _pool(self) -> HttpPool:
        """The lean pool, one per event loop: httpx's connection pool scans every connection
        (a syscall each) per request, which cost half a core at 64 rollouts in flight."""
        loop = asyncio.get_running_loop()
        if self._lean is None or self._lean[0] is not loop:
            self._lean = (loop, HttpPool())
        return self._lean[1]

    async def aclose(self) -> None:
        if self._lean is not None:
            await self._lean[1].aclose()
            self._lean = None

    # ------------------------------------------------------------ data plane (via the router)
    async def post(self, path: str, body: dict, session_id: str | None = None) -> dict:
        if not self.router_url:
            raise InferenceError("this client has no router URL")
        headers = {**self.headers, **({"X-Session-ID": session_id} if session_id else {})}
        try:
            status, content = await asyncio.wait_for(
                self._pool().post_json(self.router_url, path, body, headers), self.timeout_s)
        except UpstreamError as exc:
            raise EngineStateError(f"router {self.router_url} unreachable: {exc}") from None
        except TimeoutError:
            raise EngineStateError(f"router {path}: no answer within {self.timeout_s:g} s") from None
        return _check_answer(status, content, f"router {path}")

    async def completions(self, prompt: str | list[int], session_id: str | None = None, **kw: Any) -> dict:
        return await self.post("/v1/completions", {"model": self.model, "prompt": prompt, **kw}, session_id)

    async def chat(self, messages: list[dict], session_id: str | None = None, **kw: Any) -> dict:
        return await self.post("/v1/chat/completions", {"model": self.model, "messages": messages, **kw},
                               session_id)

    async def generate(self, token_ids: list[int], sampling_params: dict | None = None,
                       session_id: str | None = None, **kw: Any) -> dict:
        """Token-level: the answer's choice has token_ids, logprobs and weight_versions."""
        body = {"token_ids": token_ids, "sampling_params": sampling_params or {}, **kw}
        return await self.post("/inference/v1/generate", body, session_id)

    # ------------------------------------------------------------ control plane (fan-out)
    def _ranks(self, ranks: Iterable[int] | None) -> list[int]:
        if ranks is None:
            return sorted(self.shard_urls)
        ranks = sorted(set(ranks))
        unknown = [r for r in ranks if r not in self.shard_urls]
        if unknown:
            raise InvalidRequestError(f"unknown DP ranks {unknown}; known: {sorted(self.shard_urls)}")
        return ranks

    async def _one(self, rank: int, method: str, path: str, error: type[InferenceError], *,
                   params: Any = None, json: Any = None, content: bytes | None = None,
                   headers: Mapping[str, str] | None = None) -> Any:
        """One control call on the lean keep-alive pool (httpx cost a few ms per call on a busy
        CPU, and a preemption or a wake makes several in a row)."""
        base = self.shard_urls[rank]
        target = path + (f"?{urlencode(params, doseq=True)}" if params else "")
        body = content if content is not None else (b"" if json is None else _json.dumps(json).encode())
        head = {**self.headers, **({"content-type": "application/json"} if json is not None else {}),
                **dict(headers or {})}
        try:
            status, answer = await asyncio.wait_for(self._request(method, base, target, body, head),
                                                    self.timeout_s)
        except UpstreamError as exc:
            raise EngineStateError(f"shard {rank} ({base}) unreachable: {exc}") from None
        except TimeoutError:
            raise EngineStateError(f"shard {rank} {path}: no answer within {self.timeout_s:g} s") from None
        if path == "/metrics":
            if status != 200:
                raise EngineStateError(f"shard {rank} /metrics answered {status}")
            return answer.decode(errors="replace")
        return _check_answer(status, answer, f"shard {rank} {path}", error)

    async def _request(self, method: str, base: str, target: str, body: bytes,
                       headers: dict[str, str]) -> tuple[int, bytes]:
        resp = await self._pool().request(method, base, target, body, headers)
        return resp.status_code, await resp.read()

    async def fan_out(self, method: str, path: str, ranks: Iterable[int] | None = None,
                      error: type[InferenceError] = EngineStateError, **kw: Any) -> dict[int, Any]:
        """Call every rank concurrently; all calls run to the end, then the first failure raises."""
        chosen = self._ranks(ranks)
        results = await asyncio.gather(*(self._one(r, method, path, error, **kw) for r in chosen),
                                       return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return dict(zip(chosen, results))

    async def pause(self, mode: str = "keep", ranks: Iterable[int] | None = None) -> dict[int, Any]:
        return await self.fan_out("POST", "/pause", ranks, params={"mode": mode})

    async def resume(self, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        return await self.fan_out("POST", "/resume", ranks)

    async def is_paused(self, ranks: Iterable[int] | None = None) -> dict[int, bool]:
        return {r: v["is_paused"] for r, v in (await self.fan_out("GET", "/is_paused", ranks)).items()}

    async def sleep(self, level: int = 1, ranks: Iterable[int] | None = None, mode: str = "abort") -> dict[int, Any]:
        return await self.fan_out("POST", "/sleep", ranks, params={"level": level, "mode": mode})

    async def wake_up(self, tags: list[str] | None = None, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        return await self.fan_out("POST", "/wake_up", ranks, params=[("tags", t) for t in tags or []])

    async def is_sleeping(self, ranks: Iterable[int] | None = None) -> dict[int, bool]:
        return {r: v["is_sleeping"] for r, v in (await self.fan_out("GET", "/is_sleeping", ranks)).items()}

    async def abort_requests(self, ranks: Iterable[int] | None = None,
                             request_ids: list[str] | None = None) -> dict[int, Any]:
        body = {"request_ids": request_ids} if request_ids else {}
        return await self.fan_out("POST", "/abort_requests", ranks, json=body)

    async def load(self, ranks: Iterable[int] | None = None) -> dict[int, dict[str, float]]:
        """Running and waiting requests per shard, from vLLM's gauges."""
        return {r: parse_load(t) for r, t in (await self.fan_out("GET", "/metrics", ranks)).items()}


def _check_answer(status: int, content: bytes, what: str,
                  error: type[InferenceError] = InferenceError) -> Any:
    """The JSON of a 200 answer; otherwise the error its status means, with its message."""
    if status == 200:
        return json.loads(content) if content else None
    raise answer_error(status, content, what, error)

