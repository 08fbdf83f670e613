"""The one HTTP client of an engine server's weight endpoints.

`HttpShardEndpoint` is a shard behind an engine server as the drivers see it (weights/api.py's
`OneCallEndpoint`): `sync` (the whole update in one /sync_weights call: what the pipeline's
WeightPath sends) and init_transfer, start, push, finish, abort (the step-by-step protocol
`WeightSync` drives) map onto the server's weight-transfer endpoints. Only small control messages go over
HTTP; a bucket's bytes travel by the transport (shared memory on one host). `push_tensors`
sends named tensors as a safetensors body instead (small models, simple callers, a shard woken
from a level-2 sleep with nothing to fall back on).
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

from safetensors.torch import save

from rlix.errors import WeightTransferError, WeightUpdateError
from rlix.httpkit import HttpPool, UpstreamError, bearer


def safetensors_bytes(tensors: Mapping[str, Any]) -> bytes:
    """Named tensors as one safetensors file (CPU, contiguous)."""
    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def encode_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Plain JSON when it is; otherwise pickled (CUDA IPC handles), see control.bucket_message."""
    try:
        json.dumps(message)
        return dict(message)
    except (TypeError, ValueError):
        return {"message_b64": base64.b64encode(pickle.dumps(dict(message))).decode()}


class HttpShardEndpoint:
    """One engine server's weight-transfer endpoints. Picklable (connections are not kept).

    Calls go over the lean keep-alive pool (rlix.httpkit): on a busy CPU httpx cost a
    few ms per call, and a sync is several calls on the path of a waking shard."""

    one_call = True  # /sync_weights: the whole update (and a wake) in one call

    def __init__(self, url: str, api_key: str, name: str | None = None, transport_ranks: int = 1,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.name = name or self.url
        self.transport_ranks = transport_ranks
        self.timeout_s = timeout_s
        self._http: tuple[asyncio.AbstractEventLoop, HttpPool] | None = None
        self.last_phases_ms: dict[str, float] = {}  # the shard's own timing of the last sync call

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_http": None}

    def _pool(self) -> HttpPool:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            self._http = (loop, HttpPool())
        return self._http[1]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request(path, json.dumps(body).encode(), "application/json")

    async def _request(self, path: str, body: bytes | None, content_type: str | None = None,
                       method: str = "POST") -> dict[str, Any]:
        headers = bearer(self.api_key)
        if content_type:
            headers["content-type"] = content_type
        try:
            status, content = await asyncio.wait_for(
                self._send(method, path, body or b"", headers), self.timeout_s)
        except (UpstreamError, TimeoutError) as exc:
            raise WeightTransferError(f"{self.name}{path}: {type(exc).__name__}: {exc}") from None
        if status == 200:
            return json.loads(content) if content else {}
        try:
            msg = json.loads(content)["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape: show the text
            msg = content.decode(errors="replace")[:500]
        raise WeightUpdateError(f"{self.name}{path} answered {status}: {msg}")

    async def _send(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        resp = await self._pool().request(method, self.url, path, body, headers)
        return resp.status_code, await resp.read()

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return await self._post("/init_weight_transfer_engine", {"init_info": init_info})

    async def start(self, version: int, layout_id: str, transfer: dict[str, Any]) -> None:
        await self._post("/start_weight_update", {"weight_version": int(version), "layout_id": layout_id,
                                                  "transfer": transfer})

    async def push(self, message: Mapping[str, Any]) -> None:
        await self._post("/update_weights", {"update_info": encode_message(message)})

    async def finish(self, version: int) -> int:
        out = await self._post("/finish_weight_update", {"weight_version": int(version)})
        return int(out.get("weight_version", version))

    async def sync(self, version: int, layout_id: str, transfer: dict[str, Any],
                    messages: list[Mapping[str, Any]], wake_up: bool | list[str] = False) -> int:
        """Start, every message and finish in one call (/sync_weights), waking the engine first
        if asked (True: everything; a list: those wake-up tags); returns the version the shard
        says it serves afterwards."""
        out = await self._post("/sync_weights", {
            "weight_version": int(version), "layout_id": layout_id, "transfer": transfer,
            "updates": [encode_message(m) for m in messages],
            "wake_up": list(wake_up) if isinstance(wake_up, list) else bool(wake_up)})
        phases = out.get("phases_ms")
        self.last_phases_ms = {str(k): float(v) for k, v in phases.items()} if isinstance(phases, dict) else {}
        return int(out["weight_version"])

    async def push_tensors(self, tensors: Mapping[str, Any], version: int | None = None) -> int:
        """start -> one safetensors body -> finish; a failure aborts the update on the shard (the
        old weights keep serving). Returns the version the shard serves afterwards."""
        named = {} if version is None else {"weight_version": int(version)}
        await self._post("/start_weight_update", named)
        await self._request("/update_weights", safetensors_bytes(tensors), "application/octet-stream")
        await self._post("/finish_weight_update", named)
        return await self.served_version()

    async def served_version(self) -> int:
        """The version the shard says it serves (/weight_info)."""
        return int((await self._request("/weight_info", None, method="GET"))["weight_version"])

    async def wake_up(self) -> None:
        await self._post("/wake_up", {})

    async def abort(self, reason: str) -> None:
        await self._post("/abort_weight_update", {"reason": reason})

    async def aclose(self) -> None:
        if self._http is not None:
            loop, pool = self._http
            self._http = None
            if loop is asyncio.get_running_loop():
                await pool.aclose()


def http_endpoints(shard_urls: Mapping[int, str], api_key: str, ranks: Iterable[int] | None = None,
                   transport_ranks: int = 1) -> dict[int, HttpShardEndpoint]:
    """Endpoints for some (default all) of a pipeline's shards, keyed by DP rank."""
    chosen = sorted(shard_urls) if ranks is None else sorted(set(ranks))
    return {r: HttpShardEndpoint(shard_urls[r], api_key, f"shard {r}", transport_ranks) for r in chosen}
