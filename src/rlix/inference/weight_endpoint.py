"""A shard's weight-transfer endpoints, as the sync driver (rlix.weights.sync) sees them.

`HttpShardEndpoint` maps the driver's five calls (init_transfer, start, push, finish, abort) onto
an engine server's control plane, so `WeightSync` drives embedded shards in other processes the
same way it drives in-process ones. Only small control messages go over HTTP; a bucket's bytes
travel by the transport (shared memory on one host).
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from rlix.errors import WeightTransferError, WeightUpdateError


def encode_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Plain JSON when it is; otherwise pickled (CUDA IPC handles), see control.bucket_message."""
    try:
        json.dumps(message)
        return dict(message)
    except (TypeError, ValueError):
        return {"message_b64": base64.b64encode(pickle.dumps(dict(message))).decode()}


class HttpShardEndpoint:
    """One engine server's weight-transfer endpoints. Picklable (the httpx client is not kept)."""

    def __init__(self, url: str, api_key: str, name: str | None = None, transport_ranks: int = 1,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.name = name or self.url
        self.transport_ranks = transport_ranks
        self.timeout_s = timeout_s
        self._http: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_http": None}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            self._http = (loop, httpx.AsyncClient(timeout=self.timeout_s,
                                                  headers={"Authorization": f"Bearer {self.api_key}"}))
        return self._http[1]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await self._client().post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise WeightTransferError(f"{self.name}{path}: {type(exc).__name__}: {exc}") from None
        if r.status_code == 200:
            return r.json()
        try:
            msg = r.json()["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape: show the text
            msg = r.text[:500]
        raise WeightUpdateError(f"{self.name}{path} answered {r.status_code}: {msg}")

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

    async def abort(self, reason: str) -> None:
        await self._post("/abort_weight_update", {"reason": reason})

    async def aclose(self) -> None:
        if self._http is not None:
            loop, client = self._http
            self._http = None
            if loop is asyncio.get_running_loop():
                await client.aclose()


def http_endpoints(shard_urls: Mapping[int, str], api_key: str, ranks: Iterable[int] | None = None,
                   transport_ranks: int = 1) -> dict[int, HttpShardEndpoint]:
    """Endpoints for some (default all) of a pipeline's shards, keyed by DP rank."""
    chosen = sorted(shard_urls) if ranks is None else sorted(set(ranks))
    return {r: HttpShardEndpoint(shard_urls[r], api_key, f"shard {r}", transport_ranks) for r in chosen}
