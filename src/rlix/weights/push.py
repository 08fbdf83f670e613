"""The trainer-process side of selective sync: sync engine servers to a cached version over HTTP.

The bucket cache lives in the trainer's process (its shared-memory or pinned slots), so the
sync driver runs there too (TrainerActor.sync_weights calls `sync(version, {rank: url})`).
One event loop in a helper thread serves every sync, so HTTP connections and each shard's
"layout already sent" state survive between syncs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping

from rlix.weights.http_endpoint import HttpShardEndpoint
from rlix.weights.api import SyncReport
from rlix.weights.cache import BucketCache
from rlix.weights.device_copy import DeviceCopy
from rlix.weights.sync import WeightSync


class ShardWeightPusher:
    def __init__(self, cache: Callable[[], BucketCache | DeviceCopy], api_key: str, transport: str = "shm",
                 idle_timeout_s: float = 60.0, endpoint: type[HttpShardEndpoint] = HttpShardEndpoint,
                 wake_tags: list[str] | None = None) -> None:
        self._cache, self.api_key, self.transport = cache, api_key, transport
        self.wake_tags = wake_tags  # what a wake inside a sync brings back (None: everything)
        self.endpoint = endpoint  # the shards' weight protocol: rlix's engine server, or vLLM's
        self.idle_timeout_s = idle_timeout_s
        self._sync: WeightSync | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlix-weight-push", daemon=True)
        self._thread.start()

    def sync(self, version: int, urls: Mapping[int, str], wake: Iterable[int] = (),
             timeout_s: float = 600.0) -> SyncReport:
        """Blocking: move those shards to `version` (which must be in the cache), waking the
        ranks in `wake` first."""
        return asyncio.run_coroutine_threadsafe(self._run(int(version), dict(urls), list(wake)),
                                                self._loop).result(timeout_s)

    async def _run(self, version: int, urls: dict[int, str], wake: list[int]) -> SyncReport:
        cache = self._cache()
        if self._sync is None or self._sync.cache is not cache:
            self._sync = WeightSync(cache, {}, self.transport, idle_timeout_s=self.idle_timeout_s,
                                    wake_tags=self.wake_tags)
        for rank, url in urls.items():
            known = self._sync.endpoints.get(rank)
            if not isinstance(known, self.endpoint) or known.url != url.rstrip("/"):
                self._sync.add_shard(rank, self.endpoint(url, self.api_key, f"shard {rank}"))
        return await self._sync.sync(version, sorted(urls), wake)

    def close(self) -> None:
        async def shutdown() -> None:
            if self._sync is not None:
                for ep in self._sync.endpoints.values():
                    if isinstance(ep, HttpShardEndpoint):
                        await ep.aclose()
        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
