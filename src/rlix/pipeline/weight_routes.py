"""Weight sync for a pipeline whose shards run on several nodes.

The trainer's cache lives in shared memory on the trainer's node, so shards there map it
directly (the trainer syncs them). Shards on any other node are synced from that node's replica
of the cache (rlix.weights.nodes.node_cache): filled once per version over the network from the
trainer, then read through shared memory by every shard of that node. One copy per node that
has shards, not one per shard; each node's group of shards moves concurrently with the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlix.errors import WeightSyncError, one_line
from rlix.weights.api import SyncReport

log = logging.getLogger("rlix.pipeline")

LocalSync = Callable[[int, Mapping[int, str], list[int]], Awaitable[SyncReport]]


class WeightRoutes:
    """`sync(version, {rank: url}, wake)` for the coordinator, routed by each shard's node.
    `node_of(rank)` says where a rank's process runs (None: the trainer's node)."""

    def __init__(self, local_sync: LocalSync, trainer: Any, trainer_node: str,
                 node_of: Callable[[int], str | None], *, api_key: str, engine: str = "embedded",
                 idle_timeout_s: float = 60.0) -> None:
        self.local_sync = local_sync
        self.trainer = trainer  # the actor holding the cache (rank 0): replicas are filled from it
        self.trainer_node = trainer_node
        self.node_of = node_of
        self.api_key, self.engine, self.idle_timeout_s = api_key, engine, idle_timeout_s
        self.replicas: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.replications: list[dict] = []  # every fill of a replica: node, version, bytes, seconds

    async def __call__(self, version: int, urls: Mapping[int, str], wake: Iterable[int] = ()) -> SyncReport:
        by_node: dict[str, dict[int, str]] = {}
        for rank, url in urls.items():
            by_node.setdefault(self.node_of(rank) or self.trainer_node, {})[int(rank)] = url
        wake = {int(r) for r in wake}
        nodes = sorted(by_node)
        results = await asyncio.gather(
            *(self._sync_node(node, version, by_node[node], sorted(wake & set(by_node[node]))) for node in nodes),
            return_exceptions=True)
        if len(nodes) == 1 and isinstance(results[0], BaseException):
            raise results[0]
        return _merge(version, [(by_node[n], r) for n, r in zip(nodes, results)])

    async def _sync_node(self, node: str, version: int, urls: dict[int, str], wake: list[int]) -> SyncReport:
        if node == self.trainer_node:
            return await self.local_sync(version, urls, wake)
        replica = self._replica(node)
        try:
            async with self._locks.setdefault(node, asyncio.Lock()):
                filled = await replica.ensure.remote(version, self.trainer)
            if filled.transferred:
                self.replications.append({"node": node, "version": version, "bytes": filled.bytes,
                                          "seconds": round(filled.seconds, 4), "at": time.time()})
            return await replica.sync_weights.remote(version, urls, wake)
        except ray.exceptions.RayActorError:
            self.replicas.pop(node, None)  # its node is gone, or it was killed: a new one next time
            raise

    def _replica(self, node: str) -> Any:
        from rlix.weights.nodes.node_cache import NodeCacheActor  # a Ray actor class: imported where used

        replica = self.replicas.get(node)
        if replica is None:
            replica = NodeCacheActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(self.api_key, engine=self.engine, idle_timeout_s=self.idle_timeout_s)
            self.replicas[node] = replica
        return replica

    async def close(self) -> None:
        """End every replica (each unlinks its shared memory first)."""
        replicas, self.replicas = list(self.replicas.values()), {}
        for replica in replicas:
            try:
                await asyncio.wait_for(replica.close.remote(), 10.0)
            except Exception as exc:  # noqa: BLE001 - its node may be gone: nothing left to free
                log.debug("closing a weight replica: %s", one_line(exc))
            ray.kill(replica)


def _merge(version: int, parts: list[tuple[dict[int, str], SyncReport | BaseException]]) -> SyncReport:
    """One report for the whole sync; WeightSyncError naming every failed shard (with the ones
    that moved) if any group failed."""
    failed: dict[int, str] = {}
    reports: list[SyncReport] = []
    for urls, result in parts:
        if isinstance(result, WeightSyncError):
            failed.update(result.failed)
            reports.append(SyncReport(version, list(result.succeeded), 0, 0, 0.0, 0.0))
        elif isinstance(result, BaseException):
            failed.update({r: one_line(result) for r in urls})
        else:
            reports.append(result)
    ok = sorted(r for rep in reports for r in rep.ranks)
    if failed:
        detail = "; ".join(f"shard {r}: {why}" for r, why in sorted(failed.items()))
        raise WeightSyncError(f"sync of version {version} failed on {len(failed)} of {len(failed) + len(ok)} "
                              f"shard(s) (they keep their old weights): {detail}", failed, ok)
    return SyncReport(version, ok, max((r.buckets for r in reports), default=0), sum(r.bytes for r in reports),
                      max((r.seconds for r in reports), default=0.0),
                      max((r.setup_seconds for r in reports), default=0.0),
                      max((r.teardown_seconds for r in reports), default=0.0),
                      bundled=all(r.bundled for r in reports),
                      reported={k: v for r in reports for k, v in r.reported.items()})
