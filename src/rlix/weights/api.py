"""What the weight layer offers and needs: the driver's view of a shard, the shard side's
view of an engine, a route's view of where a version's bytes are, and the typed report of a
refit.

Two verbs cross this layer: a trainer *publishes* a version into its cache (cache.py), which
answers the version's references (`VersionRefs`: where every bucket lies); the pipeline's
`WeightPath` (refit.py) *refits* chosen shards to it, each through the `WeightRoute` that
reaches it, one call per shard (`OneCallEndpoint`). The transport's own Protocols (how a
bucket's bytes travel) are in transport/base.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from rlix.weights.transport.base import Message

if TYPE_CHECKING:
    from rlix.weights.wire import Layout


@runtime_checkable
class WeightTarget(Protocol):
    """The part of EngineAPI a shard needs to receive weights (EngineAPI satisfies it). Besides
    the update protocol, every engine says what it can do, so the receiver never probes:
    `weight_specs()` (name -> (shape, dtype), to refuse a mismatched layout up front; None: it
    cannot say, and its own update_weights must refuse), `weight_destination(name)` (a staging
    tensor to assemble a split tensor into, or None), and `adopt_layout(layout) -> bool` with
    `weight_bucket(index) -> (bytes, named) | None`: an engine that keeps (some of) its updates
    in the sender's bucket layout takes each bucket with one copy into `bytes`, then gets `named`
    (its own views) through update_weights; one that does not answers False."""

    weight_version: int

    def weight_specs(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None: ...

    def weight_destination(self, name: str) -> torch.Tensor | None: ...

    def adopt_layout(self, layout: Layout) -> bool: ...

    def weight_bucket(self, index: int) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None: ...

    async def start_weight_update(self, version: int) -> None: ...

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None: ...

    async def finish_weight_update(self) -> int: ...

    async def abort_weight_update(self, reason: str) -> None: ...


@runtime_checkable
class ShardEndpoint(Protocol):
    """What the sync driver calls on one shard, in this order: init_transfer once per layout,
    then per update start, push (once per bucket), finish; abort on any failure.

    `one_call` says the endpoint is a `OneCallEndpoint` too (declared, never probed): the whole
    update in one call, a wake on request, its shard's own timing of the last call."""

    name: str
    transport_ranks: int  # ranks this shard adds to a collective transport (its TP size)
    one_call: bool

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]: ...

    async def start(self, version: int, layout_id: str, transfer: dict[str, Any]) -> None: ...

    async def push(self, message: Message) -> None: ...

    async def finish(self, version: int) -> int: ...

    async def abort(self, reason: str) -> None: ...


@runtime_checkable
class OneCallEndpoint(ShardEndpoint, Protocol):
    """An endpoint whose shard takes start, every message and finish in one call (answering the
    version it serves afterwards), woken first when asked (True: everything; a list: those
    wake-up tags), and reports where that call's time went (`last_phases_ms`)."""

    last_phases_ms: dict[str, float]

    async def sync(self, version: int, layout_id: str, transfer: dict[str, Any],
                   messages: list[Message], wake_up: bool | list[str] = False) -> int: ...

    async def wake_up(self) -> None: ...


@dataclass
class SyncReport:
    """What one sync did; crosses process boundaries (trainer actor -> pipeline) as is."""

    version: int
    ranks: list[int]
    buckets: int
    bytes: int
    seconds: float  # start of the first start() to the last finish()
    setup_seconds: float  # layout init (first time only) and transport rendezvous
    teardown_seconds: float = 0.0  # the sender's transport teardown, after the last finish
    failed: dict[int, str] = field(default_factory=dict)
    bundled: bool = False  # each shard got the whole update in one call
    reported: dict[int, int] = field(default_factory=dict)  # rank -> version it answered serving
    #: rank -> where its one-call sync's time went, as the shard timed it (wake, start, buckets,
    #: finish, ms); bundled syncs to servers that report it
    shard_phases_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    route: str = ""  # the route(s) the version took ("host", "device", "node"; "+"-joined)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class VersionRefs:
    """Where one published version's buckets lie, as a shard on the same host reads them: one
    message per bucket (a shared-memory segment and offset, or a CUDA IPC handle and offset).
    Small and picklable: it crosses Ray from the trainer to the pipeline, then HTTP to each
    shard, and no byte of the weights moves with it. Valid while the holder keeps the version
    (the refit's lease, see `WeightRoute.lease`)."""

    version: int
    layout_json: str  # the bucket layout (sent to a shard once, before its first refit)
    layout_id: str
    transport: str  # the shard's receiver for these messages: "shm" or "cuda_ipc"
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class PublishedVersion:
    """A version the trainer put in its weight cache, ready for shards to be refitted to: the
    references of its buckets in the host cache (None when the cache is not in shared memory,
    so no shard can read it) and in the device copy of each trainer rank that kept one."""

    version: int
    num_buckets: int
    bytes: int
    seconds: float
    versions: list[int]  # every version the cache holds now
    refs: VersionRefs | None
    audit_s: float = 0.0  # checksumming it for the weight audit (not part of `seconds`)
    #: trainer rank -> its GPU copy's references (kept until that rank's offload)
    device_refs: dict[int, VersionRefs] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardTarget:
    """One shard a refit moves: its server, the Ray node its process runs on (None: the
    trainer's), and the trainer rank whose GPU it sleeps on when it is synced from that rank's
    device copy (None: it is not)."""

    url: str
    node: str | None = None
    beside: int | None = None


@runtime_checkable
class WeightRoute(Protocol):
    """One way a published version reaches shards: the trainer's host cache (shared memory on
    its node), a trainer rank's device copy (CUDA IPC on its GPU), or a node's replica of the
    cache (shared memory on another node). A route declares which shards it reaches and what a
    wake inside its refit brings back; `lease(version)` holds the version where the route keeps
    it (filling it first if it must) and gives its references, for as long as the shards read."""

    name: str
    #: what a wake inside a refit brings back (None: everything; ["weights"]: the weights only)
    wake_tags: list[str] | None

    def reaches(self, target: ShardTarget, version: int) -> bool: ...

    def lease(self, version: int) -> AbstractAsyncContextManager[VersionRefs]: ...

    async def close(self) -> None: ...
