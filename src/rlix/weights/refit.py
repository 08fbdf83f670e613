"""WeightPath: the one driver of a pipeline's weights, in the pipeline's process.

Two verbs:

    path = WeightPath(trainer, api_key=key, engine="embedded")
    published = await path.publish(7)                      # the trainer caches version 7
    report = await path.refit(7, {0: ShardTarget(url0)})   # shard 0 now serves version 7

`publish` asks the trainer (any `Publisher`: a TrainerGroup) to snapshot its weights into its
cache and keeps the answer: where every bucket of the version lies (`VersionRefs`), in the
trainer's shared memory and, when asked, in each trainer rank's device copy. `refit` picks, for
every target shard, the first `WeightRoute` that reaches it (a trainer rank's device copy for a
shard asleep on that rank's GPU, the host cache on the trainer's node, a node's replica
elsewhere), leases the version there, and moves each shard in one call of its own
(`OneCallEndpoint.sync`): the shard reads the buckets where they lie and answers the version it
serves. No byte of the weights passes through this process, and no other process drives a
refit: the trainer only publishes (and streams a version to a node's replica when asked).

A shard that refuses or fails keeps its old weights; `refit` then raises WeightSyncError naming
every failed shard and the ones that moved.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any, Protocol

from rlix.errors import WeightCacheError, WeightSyncError, one_line
from rlix.weights.api import (OneCallEndpoint, PublishedVersion, ShardEndpoint, ShardTarget, SyncReport, VersionRefs,
                             WeightRoute)
from rlix.weights.transport.base import Message
from rlix.weights.http_endpoint import HttpShardEndpoint
from rlix.weights.vllm.endpoint import VllmShardEndpoint

#: what an engine kind's shards speak (rlix's engine server, or vLLM with rlix's extension)
ENDPOINTS: dict[str, type[HttpShardEndpoint]] = {"embedded": HttpShardEndpoint, "vllm": VllmShardEndpoint}


class Publisher(Protocol):
    """The trainer side of the weight path (TrainerGroup satisfies it)."""

    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion: ...


class HostCacheRoute:
    """The trainer's host cache, in shared memory on its node: shards there map it. The cache
    keeps two versions and a build reuses the slot of the older one, so `vacate` (awaited
    before each build) waits until no refit reads any version but the newest."""

    name = "host"
    wake_tags: list[str] | None = None  # a wake inside the refit brings everything back

    def __init__(self, trainer_node: str | None = None) -> None:
        self.trainer_node = trainer_node
        self._refs: dict[int, VersionRefs] = {}
        self._reading: collections.Counter[int] = collections.Counter()
        self._changed = asyncio.Condition()

    def add(self, refs: VersionRefs) -> None:
        """A published version: the newest, beside the one before it (older ones are gone)."""
        newest = max(self._refs, default=None)
        self._refs = {v: r for v, r in self._refs.items() if v == newest}
        self._refs[refs.version] = refs

    def versions(self) -> list[int]:
        return sorted(self._refs)

    def reaches(self, target: ShardTarget, version: int) -> bool:
        return target.node is None or target.node == self.trainer_node

    @contextlib.asynccontextmanager
    async def lease(self, version: int) -> AsyncIterator[VersionRefs]:
        refs = self._refs.get(int(version))
        if refs is None:
            raise WeightCacheError(f"weight version {version} is not in the trainer's cache "
                                   f"(it holds {self.versions()})")
        self._reading[refs.version] += 1
        try:
            yield refs
        finally:
            async with self._changed:
                self._reading[refs.version] -= 1
                self._changed.notify_all()

    async def vacate(self) -> None:
        """Until no refit reads a version the next build may overwrite."""
        newest = max(self._refs, default=None)
        async with self._changed:
            await self._changed.wait_for(lambda: all(n == 0 or v == newest for v, n in self._reading.items()))

    async def close(self) -> None:
        self._refs.clear()


class DeviceCopyRoute:
    """One trainer rank's copy of a version on its GPU (CUDA IPC): it reaches the shards asleep
    on that GPU, until the trainer offloads. Their sync wakes their weights only; their KV cache
    stays asleep until the scheduler gives them the GPU."""

    name = "device"
    wake_tags: list[str] | None = ["weights"]

    def __init__(self, rank: int, refs: VersionRefs) -> None:
        self.rank, self.refs = rank, refs

    def reaches(self, target: ShardTarget, version: int) -> bool:
        return target.beside == self.rank and version == self.refs.version

    @contextlib.asynccontextmanager
    async def lease(self, version: int) -> AsyncIterator[VersionRefs]:
        if version != self.refs.version:
            raise WeightCacheError(f"trainer rank {self.rank}'s device copy holds version "
                                   f"{self.refs.version}, not {version}")
        yield self.refs

    async def close(self) -> None:
        return None


class WeightPath:
    """See module doc. `trainer_node`: the Ray node of the trainer's cache (None: one node);
    `replica_for(node)`: the route of a node's replica, made the first time a shard there is
    refitted (None: every shard must be on the trainer's node). `idle_timeout_s`: how long a
    shard waits on a quiet sender before aborting an update (sent with the layout)."""

    def __init__(self, trainer: Publisher, *, api_key: str, engine: str = "embedded",
                 trainer_node: str | None = None, replica_for: Callable[[str], WeightRoute] | None = None,
                 idle_timeout_s: float = 60.0) -> None:
        if engine not in ENDPOINTS:
            raise ValueError(f"engine must be one of {sorted(ENDPOINTS)}, got {engine!r}")
        self.trainer = trainer
        self.api_key, self.endpoint_type = api_key, ENDPOINTS[engine]
        self.idle_timeout_s = idle_timeout_s
        self.host = HostCacheRoute(trainer_node)
        self.devices: dict[int, DeviceCopyRoute] = {}  # trainer rank -> its copy of the newest version
        self.replicas: dict[str, WeightRoute] = {}  # node -> its replica's route
        self._replica_for = replica_for
        self._endpoints: dict[int, HttpShardEndpoint] = {}
        self._layouts: dict[int, str] = {}  # rank -> the layout id its endpoint accepted

    # -- publish -----------------------------------------------------------------------------
    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        """The trainer snapshots its weights as `version` (see TrainerActor.publish); from now
        on refits can move shards to it. `on_device`: the trainer ranks keep a GPU copy too, for
        the shards asleep on their GPUs (until their offload)."""
        await self.host.vacate()
        self.devices = {}
        published = await self.trainer.publish(int(version), audit, on_device)
        if published.refs is None:
            raise WeightCacheError("the trainer's weight cache is not in shared memory (/dev/shm could not hold "
                                   f"two versions, {2 * published.bytes / 2**20:.0f} MiB): shards cannot read it; "
                                   "give /dev/shm that much room (docker: --shm-size)")
        self.host.add(published.refs)
        self.devices = {r: DeviceCopyRoute(r, refs) for r, refs in published.device_refs.items()}
        return published

    @property
    def device_ranks(self) -> list[int]:
        """The trainer ranks holding a GPU copy of the newest version."""
        return sorted(self.devices)

    # -- refit -------------------------------------------------------------------------------
    async def refit(self, version: int, targets: Mapping[int, ShardTarget], wake: Collection[int] = ()) -> SyncReport:
        """Move these shards ({dp rank: target}), and only those, to published `version`,
        waking the ranks in `wake` inside their call (as the route's wake_tags say). Every route
        runs at once. Raises WeightSyncError naming the shards that failed (each keeps its old
        weights) and those that moved."""
        version = int(version)
        by_route: dict[int, tuple[WeightRoute, list[int]]] = {}
        unreached: dict[int, str] = {}
        for rank in sorted(targets):
            route = self._route(targets[rank], version)
            if route is None:
                unreached[rank] = "no weight route reaches it"
            else:
                by_route.setdefault(id(route), (route, []))[1].append(rank)
        parts = list(by_route.values())
        results = await asyncio.gather(
            *(self._refit_route(route, version, {r: targets[r] for r in ranks}, {int(w) for w in wake})
              for route, ranks in parts), return_exceptions=True)
        if len(parts) == 1 and not unreached and isinstance(results[0], BaseException) \
                and not isinstance(results[0], WeightSyncError):
            raise results[0]
        return merge_reports(version, [(ranks, res) for (_, ranks), res in zip(parts, results)], unreached)

    def _route(self, target: ShardTarget, version: int) -> WeightRoute | None:
        for route in (*self.devices.values(), self.host, *self.replicas.values()):
            if route.reaches(target, version):
                return route
        if target.node is not None and self._replica_for is not None:
            self.replicas[target.node] = route = self._replica_for(target.node)
            return route
        return None

    async def _endpoint(self, rank: int, url: str) -> HttpShardEndpoint:
        known = self._endpoints.get(rank)
        if known is None or known.url != url.rstrip("/"):  # a new process: its layout is sent again
            if known is not None:
                await known.aclose()  # the old process's connections
            known = self._endpoints[rank] = self.endpoint_type(url, self.api_key, f"shard {rank}")
            self._layouts.pop(rank, None)
        return known

    async def _refit_route(self, route: WeightRoute, version: int, targets: Mapping[int, ShardTarget],
                           wake: set[int]) -> SyncReport:
        ranks = sorted(targets)
        endpoints = {r: await self._endpoint(r, targets[r].url) for r in ranks}
        failed: dict[int, str] = {}
        t0 = time.perf_counter()
        async with route.lease(version) as refs:
            info = {"layout": refs.layout_json, "transport": refs.transport, "verify": False,
                    "partial": False, "idle_timeout_s": self.idle_timeout_s}
            await send_layout(endpoints, ranks, refs.layout_id, info, self._layouts, failed)
            live = [r for r in ranks if r not in failed]
            t1 = time.perf_counter()
            one_call: dict[int, OneCallEndpoint] = {r: endpoints[r] for r in live}
            reported = await sync_in_one_call(one_call, version, refs.layout_id, {"transport": refs.transport},
                                              list(refs.messages), wake, route.wake_tags, failed)
            seconds = time.perf_counter() - t1
        ok = [r for r in ranks if r not in failed]
        if failed:
            raise WeightSyncError(f"refit to version {version} failed on {len(failed)} of {len(ranks)} shard(s)",
                                  failed, ok)
        nbytes = sum(int(m["nbytes"]) for m in refs.messages)
        phases = {r: dict(p) for r in reported if (p := one_call[r].last_phases_ms)}
        return SyncReport(version, ok, len(refs.messages), nbytes * len(ok), seconds, t1 - t0,
                          bundled=True, reported=reported, shard_phases_ms=phases, route=route.name)

    async def close(self) -> None:
        """Close every shard connection and end every node's replica."""
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for ep in endpoints:
            await ep.aclose()
        replicas, self.replicas = list(self.replicas.values()), {}
        for route in (self.host, *self.devices.values(), *replicas):
            await route.close()


async def send_layout(endpoints: Mapping[int, ShardEndpoint], ranks: list[int], layout_id: str,
                      info: Mapping[str, Any], accepted: dict[int, str], failed: dict[int, str]) -> None:
    """The layout (in `info`) to each of `ranks` whose endpoint has not accepted `layout_id` yet
    (`accepted`: rank -> the layout id it took, updated here); a refusal goes into `failed`."""
    need = [r for r in ranks if accepted.get(r) != layout_id]
    answers = await asyncio.gather(*(endpoints[r].init_transfer(dict(info)) for r in need),
                                   return_exceptions=True)
    for r, res in zip(need, answers):
        if isinstance(res, BaseException):
            failed[r] = f"layout refused: {res}"
        else:
            accepted[r] = layout_id


async def sync_in_one_call(endpoints: Mapping[int, OneCallEndpoint], version: int, layout_id: str,
                           transfer: Mapping[str, Any], messages: list[Message], wake: Collection[int],
                           wake_tags: list[str] | None, failed: dict[int, str]) -> dict[int, int]:
    """Every endpoint's whole update in one call at once (each its own transfer `rank`, 1 up),
    waking those in `wake` first (`wake_tags`: what comes back; None: everything). Returns the
    version each shard that took it answered; records each failure, or a shard that answered
    another version, in `failed` (that shard keeps its old weights)."""
    ranks = list(endpoints)
    answers = await asyncio.gather(
        *(endpoints[r].sync(version, layout_id, {**transfer, "rank": 1 + i}, messages,
                            (wake_tags if wake_tags is not None else True) if r in wake else False)
          for i, r in enumerate(ranks)), return_exceptions=True)
    reported: dict[int, int] = {}
    for r, res in zip(ranks, answers):
        if isinstance(res, BaseException):
            failed[r] = f"update: {res}"
        elif res != version:
            failed[r] = f"applied version {res}, expected {version}"
        else:
            reported[r] = int(res)
    return reported


def merge_reports(version: int, parts: list[tuple[list[int], SyncReport | BaseException]],
                  unreached: Mapping[int, str] | None = None) -> SyncReport:
    """One report for a refit over several routes; WeightSyncError naming every failed shard
    (with the ones that moved) if any part failed."""
    failed: dict[int, str] = dict(unreached or {})
    reports: list[SyncReport] = []
    for ranks, result in parts:
        if isinstance(result, WeightSyncError):
            failed.update(result.failed)
            reports.append(SyncReport(version, list(result.succeeded), 0, 0, 0.0, 0.0))
        elif isinstance(result, BaseException):
            failed.update({r: one_line(result) for r in ranks})
        else:
            reports.append(result)
    ok = sorted(r for rep in reports for r in rep.ranks)
    if failed:
        detail = "; ".join(f"shard {r}: {why}" for r, why in sorted(failed.items()))
        raise WeightSyncError(f"refit to version {version} failed on {len(failed)} of {len(failed) + len(ok)} "
                              f"shard(s) (they keep their old weights): {detail}", failed, ok)
    return SyncReport(version, ok, max((r.buckets for r in reports), default=0), sum(r.bytes for r in reports),
                      max((r.seconds for r in reports), default=0.0),
                      max((r.setup_seconds for r in reports), default=0.0),
                      bundled=all(r.bundled for r in reports),
                      reported={k: v for r in reports for k, v in r.reported.items()},
                      shard_phases_ms={k: v for r in reports for k, v in r.shard_phases_ms.items()},
                      route="+".join(sorted({r.route for r in reports if r.route})))
