"""Selective sync: push one cached version to a chosen set of a pipeline's shards.

Only the named shards are touched; the others keep generating. Each pipeline has its own
WeightSync over its own cache, and nothing here is global, so syncs of different pipelines run
independently. Per shard the engine's protocol is followed (start, update per bucket, finish),
so a shard applies the version only at finish and any failure leaves its old weights serving.
With handle-based transports (local, shm, cuda_ipc) a failing shard is dropped and the others
complete; with a collective one (nccl) a failure aborts every target, since the group is shared.

When the transport's messages are references a shard can read at any time (a cache in shared
memory) and the endpoints are `OneCallEndpoint`s, each shard gets the whole update in one call, woken
first if asked: the sync of a waking shard is then one round trip, not wake + 2 + buckets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

from rlix.errors import WeightSyncError, WeightUpdateError
from rlix.weights.cache import BucketCache
from rlix.weights.api import OneCallEndpoint, ShardEndpoint, SyncReport
from rlix.weights.refit import send_layout, sync_in_one_call
from rlix.weights.transport import Transport, make_transport

COLLECTIVE = ("nccl",)


class WeightSync:
    """One pipeline's sync driver: its cache, its shards' endpoints, one transport kind."""

    def __init__(self, cache: BucketCache, endpoints: Mapping[int, ShardEndpoint] | None = None,
                 transport: Transport | str = "shm", *, verify: bool = False, partial: bool = False,
                 transport_options: Mapping[str, Any] | None = None, idle_timeout_s: float = 60.0,
                 one_call: bool = True, wake_tags: list[str] | None = None) -> None:
        self.cache = cache
        self.endpoints: dict[int, ShardEndpoint] = dict(endpoints or {})
        if isinstance(transport, str):
            opts = dict(transport_options or {})
            if transport == "shm":
                opts.setdefault("segments", cache.shm_segments)
            transport = make_transport(transport, **opts)
        self.transport = transport
        self.verify, self.partial = verify, partial
        self.idle_timeout_s = idle_timeout_s  # a shard aborts an update whose sender went quiet
        self.one_call = one_call  # whole update in one call per shard where the transport allows
        # what a wake inside the sync brings back (None: everything; ["weights"]: the weights
        # only, the KV cache staying asleep, for a shard synced beside the trainer)
        self.wake_tags = wake_tags
        self._initialised: dict[int, str] = {}  # rank -> layout id it accepted
        self._busy: set[int] = set()

    def add_shard(self, rank: int, endpoint: ShardEndpoint) -> None:
        self.endpoints[rank] = endpoint
        self._initialised.pop(rank, None)

    def remove_shard(self, rank: int) -> None:
        self.endpoints.pop(rank, None)
        self._initialised.pop(rank, None)

    def init_info(self) -> dict[str, Any]:
        """What /init_weight_transfer_engine carries: sent once per shard and layout."""
        return {"layout": self.cache.layout.to_json(), "transport": self.transport.kind,
                "verify": self.verify, "partial": self.partial, "idle_timeout_s": self.idle_timeout_s}

    async def sync(self, version: int, dp_ranks: Iterable[int], wake: Iterable[int] = ()) -> SyncReport:
        """Move the shards `dp_ranks` to cached `version`, waking those in `wake` first (they
        sleep at level 1). Raises WeightSyncError naming the shards that failed (each keeps its
        old weights) and those that succeeded."""
        ranks = sorted(set(int(r) for r in dp_ranks))
        wake = {int(r) for r in wake}
        unknown = [r for r in ranks if r not in self.endpoints]
        if unknown:
            raise WeightUpdateError(f"no endpoint for shard(s) {unknown}; known: {sorted(self.endpoints)}")
        clash = [r for r in ranks if r in self._busy]
        if clash:
            raise WeightUpdateError(f"shard(s) {clash} are already being synced")
        self._busy.update(ranks)
        try:
            with self.cache.lease(version) as buckets:
                return await self._sync(int(version), ranks, buckets, wake & set(ranks))
        finally:
            self._busy.difference_update(ranks)

    async def _sync(self, version: int, ranks: list[int], buckets: list, wake: set[int]) -> SyncReport:
        layout = self.cache.layout
        failed: dict[int, str] = {}
        collective = self.transport.kind in COLLECTIVE
        t0 = time.perf_counter()
        checksums = await asyncio.to_thread(self.cache.checksums, version) if self.verify else None
        await send_layout(self.endpoints, ranks, layout.layout_id, self.init_info(), self._initialised, failed)
        live = [r for r in ranks if r not in failed]
        if collective and failed:
            live, failed = [], {**failed, **{r: "not synced: another target refused the layout"
                                             for r in ranks if r not in failed}}
        sender = self.transport.sender()
        started: list[int] = []
        bundle = None
        if self.one_call and live and not collective and all(self.endpoints[r].one_call for r in live):
            bundle = sender.references(version, buckets, checksums)
        if bundle is not None:
            try:
                return await self._sync_bundled(version, ranks, live, failed, sender, bundle, wake, t0)
            finally:
                sender.close()  # nothing staged, nothing to tear down
        if live and wake:
            live = await self._wake(live, wake, failed)
        try:
            if live:
                offsets, total = {}, 0
                for r in live:
                    offsets[r] = 1 + total
                    total += self.endpoints[r].transport_ranks
                info = {**sender.open(total), "transport": self.transport.kind}
                jobs = [self.endpoints[r].start(version, layout.layout_id, {**info, "rank": offsets[r]})
                        for r in live]
                results = await asyncio.gather(asyncio.to_thread(sender.connect), *jobs,
                                               return_exceptions=True)
                if isinstance(results[0], BaseException):
                    failed.update({r: f"transport setup failed: {results[0]}" for r in live})
                for r, res in zip(live, results[1:]):
                    if isinstance(res, BaseException):
                        failed.setdefault(r, f"start refused: {res}")
                    else:
                        started.append(r)
                live = self._survivors(started, failed, collective)
            t_setup = time.perf_counter() - t0
            t1 = time.perf_counter()
            if live:
                for message in sender.stream(version, buckets, checksums):
                    results = await asyncio.gather(*(self.endpoints[r].push(message) for r in live),
                                                   return_exceptions=True)
                    for r, res in zip(live, results):
                        if isinstance(res, BaseException):
                            failed[r] = f"bucket {message['bucket']}: {res}"
                    live = self._survivors(live, failed, collective)
                    if not live:
                        break
            if live:
                results = await asyncio.gather(*(self.endpoints[r].finish(version) for r in live),
                                               return_exceptions=True)
                for r, res in zip(live, results):
                    if isinstance(res, BaseException):
                        failed[r] = f"finish: {res}"
                    elif res != version:
                        failed[r] = f"finish applied version {res}, expected {version}"
            seconds = time.perf_counter() - t1
        finally:
            t_close = time.perf_counter()
            await asyncio.to_thread(sender.close)
            t_teardown = time.perf_counter() - t_close
            aborting = [r for r in started if r in failed]
            await asyncio.gather(*(self._quiet_abort(r, failed[r]) for r in aborting))
        ok = _succeeded(version, ranks, failed)
        return SyncReport(version, ok, layout.num_buckets, layout.total_bytes * len(ok), seconds,
                          t_setup, t_teardown)

    async def _sync_bundled(self, version: int, ranks: list[int], live: list[int], failed: dict[int, str],
                            sender: Any, bundle: list, wake: set[int], t0: float) -> SyncReport:
        """Each live shard: [wake,] start, every message, finish, in one call. A shard aborts a
        failed update itself, so there is nothing to clean up here."""
        layout = self.cache.layout
        info = {**sender.open(len(live)), "transport": self.transport.kind}
        t1 = time.perf_counter()
        one_call = {r: cast(OneCallEndpoint, self.endpoints[r]) for r in live}  # all say one_call
        reported = await sync_in_one_call(one_call, version, layout.layout_id, info, bundle, wake,
                                          self.wake_tags, failed)
        seconds = time.perf_counter() - t1
        ok = _succeeded(version, ranks, failed)
        phases = {r: dict(p) for r in reported if (p := one_call[r].last_phases_ms)}
        return SyncReport(version, ok, layout.num_buckets, layout.total_bytes * len(ok), seconds,
                          t1 - t0, bundled=True, reported=reported, shard_phases_ms=phases)

    async def _wake(self, live: list[int], wake: set[int], failed: dict[int, str]) -> list[int]:
        """Wake these shards before a step-by-step sync (the bundled one wakes in its call)."""
        targets = [r for r in live if r in wake]
        for r in targets:
            if not self.endpoints[r].one_call:
                failed[r] = "cannot wake: its endpoint has no wake_up"
        targets = [r for r in targets if r not in failed]
        results = await asyncio.gather(*(cast(OneCallEndpoint, self.endpoints[r]).wake_up() for r in targets),
                                       return_exceptions=True)
        for r, res in zip(targets, results):
            if isinstance(res, BaseException):
                failed[r] = f"wake up: {res}"
        return [r for r in live if r not in failed]

    @staticmethod
    def _survivors(live: list[int], failed: dict[int, str], collective: bool) -> list[int]:
        if collective and any(r in failed for r in live):
            for r in live:
                failed.setdefault(r, "aborted: another shard of the same broadcast failed")
            return []
        return [r for r in live if r not in failed]

    async def _quiet_abort(self, rank: int, reason: str) -> None:
        try:
            await self.endpoints[rank].abort(reason)
        except Exception:  # noqa: BLE001 - the shard already aborted itself or is gone
            pass


def _succeeded(version: int, ranks: list[int], failed: dict[int, str]) -> list[int]:
    """The ranks that got `version`; raises WeightSyncError naming both sides if any failed."""
    ok = [r for r in ranks if r not in failed]
    if failed:
        detail = "; ".join(f"shard {r}: {why}" for r, why in sorted(failed.items()))
        raise WeightSyncError(f"sync of version {version} failed on {len(failed)} of {len(ranks)} "
                              f"shard(s) (they keep their old weights): {detail}", failed, ok)
    return ok
