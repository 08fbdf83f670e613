"""NodeCacheActor: one pipeline's replica of the trainer's bucket cache, on one Ray node.

Shards map the trainer's cache through /dev/shm, which only works on the trainer's host. A
pipeline with shards on another node puts one NodeCacheActor there: `ensure(version, trainer)`
copies the version once over TCP (relay.py) into a replica in this node's /dev/shm, and
`sync_weights` then moves this node's shards to it over shared memory, exactly as
TrainerActor.sync_weights does on the trainer's host. A thin Ray shell over relay.py,
BucketCache and ShardWeightPusher.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray

from rlix.errors import WeightCacheError, WeightTransferError
from rlix.weights.api import SyncReport
from rlix.weights.cache import BucketCache, HostMemory
from rlix.weights.http_endpoint import HttpShardEndpoint
from rlix.weights.push import ShardWeightPusher
from rlix.weights.nodes.relay import DEFAULT_TIMEOUT_S, RelayReceiver
from rlix.weights.vllm.endpoint import VllmShardEndpoint
from rlix.weights.wire import Layout


@dataclass(frozen=True)
class EnsureResult:
    """What `ensure` did: `transferred` False when the replica already held the version."""

    version: int
    transferred: bool
    bytes: int = 0
    seconds: float = 0.0  # asking the trainer to stored and promoted here
    send_seconds: float = 0.0  # the trainer's side of the stream (connect to confirmation)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@ray.remote(num_cpus=0)
class NodeCacheActor:
    """The replica of one pipeline's weights on this node, and the sync driver of its shards.

    Place it on the node (NodeAffinitySchedulingStrategy). `api_key` is the shards' token,
    `engine` their protocol ("embedded" or "vllm"), `idle_timeout_s` how long a shard waits on a
    quiet sender before aborting an update. `io_timeout_s` bounds every socket operation of a
    relay (a stalled trainer is detected within it); `host` is the replica's host memory kind."""

    def __init__(self, api_key: str, engine: str = "embedded", idle_timeout_s: float = 60.0, *,
                 io_timeout_s: float = DEFAULT_TIMEOUT_S, host: HostMemory = "auto") -> None:
        self.api_key, self.engine = api_key, engine
        self.idle_timeout_s, self.io_timeout_s = idle_timeout_s, io_timeout_s
        self.host_memory = host
        self._cache: BucketCache | None = None
        self._pusher: ShardWeightPusher | None = None
        # one relay at a time: a second ensure of the same version waits and then finds it held,
        # so a version crosses the network once per node
        self._lock = asyncio.Lock()

    def _held(self) -> BucketCache:
        """The replica a sync reads (the pusher asks at each sync: a relay may replace it)."""
        if self._cache is None:
            raise WeightCacheError("no replica on this node yet: ensure a version first")
        return self._cache

    def _replica(self, layout: Layout) -> BucketCache:
        if self._cache is None:
            self._cache = BucketCache(layout, host=self.host_memory)
        return self._cache

    async def ensure(self, version: int, trainer: Any, timeout_s: float = 600.0) -> EnsureResult:
        """Make the replica hold `version` (and serve it: it becomes the replica's active
        version), copying it from `trainer` (a TrainerActor handle, or anything offering
        `send_version.remote(version, host, port)`) unless it is here already. Raises the
        trainer's error if it cannot send (WeightCacheError: not in its cache), the receiver's
        (WeightTransferError, WeightLayoutError) if the stream fails; a version held before stays."""
        version = int(version)
        async with self._lock:
            if self._cache is not None and version in self._cache.versions():
                return EnsureResult(version, transferred=False)
            ip = ray.util.get_node_ip_address()
            with RelayReceiver(ip, 0, timeout_s=self.io_timeout_s) as receiver:
                t0 = time.perf_counter()
                sent = asyncio.ensure_future(_await_ref(trainer.send_version.remote(version, ip, receiver.port)))
                got = asyncio.ensure_future(asyncio.to_thread(
                    receiver.receive, self._cache if self._cache is not None else self._replica,
                    version=version, accept_timeout_s=timeout_s))
                done, _ = await asyncio.wait({sent, got}, timeout=timeout_s,
                                             return_when=asyncio.FIRST_EXCEPTION)
                if got in done and (failure := got.exception()) is not None:
                    sent.cancel()
                    raise failure
                if sent in done and (failure := sent.exception()) is not None:
                    receiver.cancel()  # the trainer will not connect (or stopped): stop waiting
                    with contextlib.suppress(Exception):
                        await got
                    raise failure
                if len(done) < 2:
                    receiver.cancel()
                    sent.cancel()
                    with contextlib.suppress(Exception):
                        await got
                    raise WeightTransferError(f"relay of version {version} to {receiver.address} did "
                                              f"not finish within {timeout_s:.0f} s")
                cache, received = got.result()
                self._cache = cache
                return EnsureResult(version, True, received.bytes, time.perf_counter() - t0, sent.result())

    async def sync_weights(self, version: int, shards: Mapping[int, str], wake: Iterable[int] = ()) -> SyncReport:
        """Move these engine servers on this node ({dp rank: url}) to replica `version` over
        shared memory, waking the ranks in `wake` first (TrainerActor.sync_weights, here)."""
        if self._cache is None:
            raise WeightCacheError("no replica on this node yet: ensure a version first")
        if self._pusher is None:
            endpoint = VllmShardEndpoint if self.engine == "vllm" else HttpShardEndpoint
            self._pusher = ShardWeightPusher(self._held, self.api_key,
                                             idle_timeout_s=self.idle_timeout_s, endpoint=endpoint)
        return await asyncio.to_thread(self._pusher.sync, int(version),
                                       {int(r): u for r, u in shards.items()}, list(wake))

    def versions(self) -> tuple[int, ...]:
        return self._cache.versions() if self._cache is not None else ()

    async def checksums(self, version: int) -> list[int]:
        """Per-bucket checksums of a replica version (to compare with the trainer's cache)."""
        if self._cache is None:
            raise WeightCacheError("no replica on this node yet: ensure a version first")
        return await asyncio.to_thread(self._cache.checksums, int(version))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Free the replica (its shared memory is unlinked); the actor can then be killed."""
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None


async def _await_ref(ref: Any) -> Any:
    return await ref
