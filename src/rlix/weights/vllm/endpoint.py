"""A real vLLM server's weight path: rlix's worker extension, called over /collective_rpc.

`VllmShardEndpoint` is the sync driver's `ShardEndpoint` for a vLLM shard. The whole update goes
in one call (the buckets are read where they lie, in the trainer's shared-memory cache; see
weights/vllm_worker.py), then `/update_weight_version` makes vLLM stamp what it generates with
the new version. A failed call has changed nothing (the extension checks every bucket before
loading), so there is nothing to abort. vLLM's dev-mode control endpoints ignore the API key;
it is sent anyway.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rlix.errors import WeightUpdateError
from rlix.weights.http_endpoint import HttpShardEndpoint

#: vLLM reports this version until it is told one
UNSET_VERSION = "default"


class VllmShardEndpoint(HttpShardEndpoint):
    """See module doc. Only the one-call `sync` exists: the cache must be in shared memory."""

    last_update: dict[str, Any] = {}

    async def _rpc(self, method: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One extension method on every worker of the server; all must answer the same."""
        out = await self._post("/collective_rpc", {"method": method, "args": [json.dumps(payload)]})
        results = [json.loads(r) for r in out.get("results") or []]
        if not results:
            raise WeightUpdateError(f"{self.name}/collective_rpc {method}: no worker answered")
        if any(r != results[0] for r in results[1:]):
            raise WeightUpdateError(f"{self.name}/collective_rpc {method}: workers disagree: {results}")
        return results[0]

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return await self._rpc("rlix_init_transfer", init_info)

    async def sync(self, version: int, layout_id: str, transfer: dict[str, Any],
                   messages: list[Mapping[str, Any]], wake_up: bool = False) -> int:
        if wake_up:
            await self.wake_up()
        out = await self._rpc("rlix_sync", {"weight_version": int(version), "layout_id": layout_id,
                                            "updates": [dict(m) for m in messages]})
        await self.set_version(int(out["weight_version"]))
        self.last_update = out  # the worker's own timing: read_s (buckets in), reload_s (vLLM's load)
        return int(out["weight_version"])

    async def set_version(self, version: int) -> None:
        await self._post("/update_weight_version", {"new_version": str(int(version))})

    async def served_version(self) -> int:
        value = (await self._request("/weight_info", None, method="GET"))["weight_version"]
        return 0 if value in (None, UNSET_VERSION) else int(value)

    def _step_by_step(self) -> WeightUpdateError:
        return WeightUpdateError(f"{self.name}: a vLLM shard takes a whole update in one call, read from "
                                 "the trainer's shared-memory cache (host: shm)")

    async def start(self, version: int, layout_id: str, transfer: dict[str, Any]) -> None:
        raise self._step_by_step()

    async def push(self, message: Mapping[str, Any]) -> None:
        raise self._step_by_step()

    async def finish(self, version: int) -> int:
        raise self._step_by_step()

    async def abort(self, reason: str) -> None:
        """Nothing to undo: a failed update never touched the served weights."""
