"""A node's replica of the trainer's bucket cache, and the weight route through it.

Shards map the trainer's cache through /dev/shm, which only works on the trainer's host. A
pipeline with shards on another node puts one NodeCacheActor there: `ensure(version, trainer)`
copies the version once over TCP (relay.py) into a replica in this node's /dev/shm, and
`refs(version)` says where its buckets lie there. `NodeReplicaRoute` is the pipeline's side
(a `WeightRoute` of rlix.weights.refit): it fills the replica and hands the pipeline's
WeightPath those references, with which it refits the node's shards exactly as it does on the
trainer's host. One copy per node that has shards, not one per shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlix.errors import WeightCacheError, WeightTransferError, one_line
from rlix.weights.api import ShardTarget, VersionRefs
from rlix.weights.cache import BucketCache, HostMemory
from rlix.weights.nodes.relay import DEFAULT_TIMEOUT_S, RelayReceiver
from rlix.weights.wire import Layout

log = logging.getLogger("rlix.weights")


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
    """The replica of one pipeline's weights on this node.

    Place it on the node (NodeAffinitySchedulingStrategy). `io_timeout_s` bounds every socket
    operation of a relay (a stalled trainer is detected within it); `host` is the replica's
    host memory kind."""

    def __init__(self, *, io_timeout_s: float = DEFAULT_TIMEOUT_S, host: HostMemory = "auto") -> None:
        self.io_timeout_s = io_timeout_s
        self.host_memory = host
        self._cache: BucketCache | None = None
        # one relay at a time: a second ensure of the same version waits and then finds it held,
        # so a version crosses the network once per node
        self._lock = asyncio.Lock()

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

    def refs(self, version: int) -> VersionRefs:
        """Where replica `version`'s buckets lie in this node's shared memory."""
        if self._cache is None:
            raise WeightCacheError("no replica on this node yet: ensure a version first")
        refs = self._cache.refs(int(version))
        if refs is None:
            raise WeightCacheError(f"the replica on this node is not in shared memory (/dev/shm could not hold "
                                   f"two versions, {2 * self._cache.layout.total_bytes / 2**20:.0f} MiB)")
        return refs

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
        if self._cache is not None:
            self._cache.close()
            self._cache = None


async def _await_ref(ref: Any) -> Any:
    return await ref


class NodeReplicaRoute:
    """The weight route to the shards of one node other than the trainer's: `lease(version)`
    fills the node's replica from the trainer (`trainer`: its rank-0 actor) unless it holds the
    version already, and keeps it held (no other fill of this node) while the shards read it.
    The replica actor is started on first use, and again after it died."""

    name = "node"
    wake_tags: list[str] | None = None

    def __init__(self, node: str, trainer: Any, *, host: HostMemory = "auto") -> None:
        self.node, self.trainer, self.host = node, trainer, host
        self.replications: list[dict] = []  # every fill: node, version, bytes, seconds, at
        self._actor: Any = None
        self._lock = asyncio.Lock()

    def reaches(self, target: ShardTarget, version: int) -> bool:
        return target.node == self.node

    def _replica(self) -> Any:
        if self._actor is None:
            self._actor = NodeCacheActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False)).remote(host=self.host)
        return self._actor

    @contextlib.asynccontextmanager
    async def lease(self, version: int) -> AsyncIterator[VersionRefs]:
        async with self._lock:
            replica = self._replica()
            try:
                filled = await replica.ensure.remote(int(version), self.trainer)
                refs = await replica.refs.remote(int(version))
            except ray.exceptions.RayActorError:
                self._actor = None  # its node is gone, or it was killed: a new one next time
                raise
            if filled.transferred:
                self.replications.append({"node": self.node, "version": int(version), "bytes": filled.bytes,
                                          "seconds": round(filled.seconds, 4), "at": time.time()})
            yield refs

    async def close(self) -> None:
        """End the replica (it unlinks its shared memory first)."""
        actor, self._actor = self._actor, None
        if actor is None:
            return
        try:
            await asyncio.wait_for(actor.close.remote(), 10.0)
        except Exception as exc:  # noqa: BLE001 - its node may be gone: nothing left to free
            log.debug("closing a weight replica: %s", one_line(exc))
        ray.kill(actor)
