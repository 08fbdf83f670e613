"""A shard's weight-transfer endpoints, as the sync driver (rlix.weights.sync) sees them.

`HttpShardEndpoint` maps the driver's calls (init_transfer, start, push, finish, abort, and
`apply`: all of an update in one call, /sync_weights) onto an engine server's control plane, so `WeightSync` drives embedded shards in other processes the
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

from rlix.errors import WeightTransferError, WeightUpdateError
from rlix.httpkit import HttpPool, UpstreamError


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

    def __init__(self, url: str, api_key: str, name: str | None = None, transport_ranks: int = 1,
                 timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.name = name or self.url
        self.transport_ranks = transport_ranks
        self.timeout_s = timeout_s
        self._http: tuple[asyncio.AbstractEventLoop, HttpPool] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_http": None}

    def _pool(self) -> HttpPool:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http[0] is not loop:
            self._http = (loop, HttpPool())
        return self._http[1]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            status, content = await asyncio.wait_for(
                self._pool().post_json(self.url, path, body, headers), self.timeout_s)
        except (UpstreamError, TimeoutError) as exc:
            raise WeightTransferError(f"{self.name}{path}: {type(exc).__name__}: {exc}") from None
        if status == 200:
            return json.loads(content) if content else {}
        try:
            msg = json.loads(content)["error"]["message"]
        except Exception:  # noqa: BLE001 - not our error shape: show the text
            msg = content.decode(errors="replace")[:500]
        raise WeightUpdateError(f"{self.name}{path} answered {status}: {msg}")

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

    async def apply(self, version: int, layout_id: str, transfer: dict[str, Any],
                    messages: list[Mapping[str, Any]], wake_up: bool = False) -> int:
        """Start, every message and finish in one call (/sync_weights), waking the engine first
        if asked; returns the version the shard says it serves afterwards."""
        out = await self._post("/sync_weights", {
            "weight_version": int(version), "layout_id": layout_id, "transfer": transfer,
            "updates": [encode_message(m) for m in messages], "wake_up": bool(wake_up)})
        return int(out["weight_version"])

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
