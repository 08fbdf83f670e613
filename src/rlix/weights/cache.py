"""Versioned CPU bucket cache: the trainer's weights, snapshotted after a step, served to shards.

The trainer snapshots into host memory and gives its GPUs back; shards are synced from here
later, on their own schedule. Two slots at most (the version being built or just built, and the
version shards are being moved to), allocated once and reused, because pinning host memory
is slow (docs/BENCHMARKS.md): building a third version overwrites the slot not holding the active one.
Slots live in POSIX shared memory, so a receiving process on this host maps them with no copy at
all (and a sync can hand every shard all its bucket references in one call). With CUDA present
the segments are also page-locked ("pinned_shm"): the trainer's GPU->cache copies and a shard's
cache->GPU copies then run at pinned speed. Without room in /dev/shm for both versions the
slots fall back to private pinned memory, which no shard can read: `refs` then answers None
and publishing refuses (rlix.weights.refit), naming the room /dev/shm needs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from rlix.errors import HostMemoryError, WeightCacheError
from rlix.weights.api import PublishedVersion, VersionRefs
from rlix.weights.buckets import (DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES, bucket_views, fusion_order,
                                  named_weights, pack, plan_layout)
from rlix.weights.transport.pinning import PinnedRange, page_lock_tensor
from rlix.weights.transport.base import Message, header
from rlix.weights.wire import SHM_DIR, Layout, ShmSegment, bucket_checksum

HostMemory = Literal["auto", "pinned_shm", "pinned", "shm", "pageable"]
HOST_MEMORY = ("auto", "pinned_shm", "pinned", "shm", "pageable")
MAX_VERSIONS = 2
GiB = 1 << 30


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes: what the kernel says can be allocated without swapping."""
    with open(meminfo) as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise WeightCacheError(f"{meminfo} has no MemAvailable line")


def _size(n: int) -> str:
    unit, div = ("GiB", GiB) if n >= GiB else ("MiB", 1 << 20)
    return f"{n / div:.2f} {unit} ({n} bytes)"


def shm_available() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


@dataclass
class _Slot:
    flat: torch.Tensor
    buckets: list[torch.Tensor]
    segment: ShmSegment | None
    version: int | None = None
    building: bool = False
    leases: int = 0
    checksums: list[int] | None = field(default=None)
    pinned: PinnedRange | None = None  # the segment's page-locking (pinned_shm)


class BucketCache:
    """At most two versions of one model's buckets in host memory: `latest` and `active`."""

    def __init__(self, layout: Layout, *, host: HostMemory = "auto", reserve_bytes: int = 0,
                 meminfo: str = "/proc/meminfo") -> None:
        self.layout = layout
        self.host = _resolve_host(host, MAX_VERSIONS * layout.total_bytes)
        self.meminfo = meminfo
        self.reserve_bytes = reserve_bytes
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self.latest_version: int | None = None
        self.active_version: int | None = None
        self._check_fits(MAX_VERSIONS, "up front")

    @classmethod
    def for_model(cls, source: torch.nn.Module | Mapping[str, torch.Tensor], *,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, alignment: int = DEFAULT_ALIGNMENT,
                  host: HostMemory = "auto", reserve_bytes: int = 0,
                  meminfo: str = "/proc/meminfo") -> BucketCache:
        """Plan the layout from the model's tensors (the trainer side does this once)."""
        layout = plan_layout(fusion_order(named_weights(source)), bucket_bytes, alignment)
        return cls(layout, host=host, reserve_bytes=reserve_bytes, meminfo=meminfo)

    # -- memory -----------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return self.layout.total_bytes

    def host_bytes(self) -> int:
        """Host memory this cache holds now."""
        return sum(s.flat.numel() for s in self._slots)

    def _check_fits(self, slots: int, when: str) -> None:
        need = slots * self.slot_bytes
        if need == 0:
            return
        avail = mem_available(self.meminfo) - self.reserve_bytes
        where = "MemAvailable in " + self.meminfo
        if self.host in ("shm", "pinned_shm"):
            shm = shm_available()
            if shm < avail:
                avail, where = shm, f"free space in {SHM_DIR}"
        if need > avail:
            reserve = f", minus a reserve of {_size(self.reserve_bytes)}" if self.reserve_bytes else ""
            raise HostMemoryError(
                f"weight cache refused {when}: {slots} version(s) of {_size(self.slot_bytes)} "
                f"({len(self.layout.entries)} tensors in {self.layout.num_buckets} buckets) need "
                f"{_size(need)} but only {_size(max(avail, 0))} is free ({where}{reserve})")

    def _new_slot(self) -> _Slot:
        self._check_fits(1, f"allocating version slot {len(self._slots) + 1}")
        n, segment, pinned = self.slot_bytes, None, None
        if self.host in ("shm", "pinned_shm"):
            segment = ShmSegment.create(n, prefix="rlix-w")
            flat = segment.tensor
            if self.host == "pinned_shm":
                pinned = page_lock_tensor(flat)
        elif self.host == "pinned":
            flat = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        else:
            flat = torch.empty(n, dtype=torch.uint8)
        return _Slot(flat, bucket_views(self.layout, flat), segment, pinned=pinned)

    # -- versions ---------------------------------------------------------------------------
    def versions(self) -> tuple[int, ...]:
        return tuple(sorted(s.version for s in self._slots if s.version is not None))

    def build_latest(self, version: int, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Snapshot `source` (a model, or its gathered state dict) as `version` and make it latest.
        Raises WeightCacheError if the slot it would overwrite is being synced."""
        tensors = named_weights(source)
        self.write_version(version, lambda buckets: pack(self.layout, tensors, buckets))

    def write_version(self, version: int, fill: Callable[[list[torch.Tensor]], None], *,
                      checksums: list[int] | None = None) -> None:
        """Fill `version`'s slot by calling `fill(buckets)` on its empty bucket views, then make it
        latest. What build_latest does with packing, for a fill from raw bytes (a node's replica
        filled from the network, rlix.weights.nodes.relay). The slot is picked exactly as a build picks
        it, so the active version and leased slots are never overwritten; if `fill` raises, the
        version is left absent and the other versions untouched. `checksums`: the buckets'
        checksums when the caller already verified them (kept, not recomputed)."""
        version = int(version)
        slot = self._begin(version)
        try:
            fill(list(slot.buckets))
        except BaseException:
            self._end(slot, version, ok=False)
            raise
        self._end(slot, version, ok=True, checksums=checksums)

    def begin_version(self, version: int) -> VersionRefs:
        """Open `version`'s slot to writers in other processes of this host (the ranks of a
        sharded trainer, each writing its shard: buckets.pack_rows) and answer where its
        buckets lie; `end_version` closes it. The slot is picked as a build picks it. Needs the
        cache in shared memory."""
        version = int(version)
        if self.host not in ("shm", "pinned_shm"):
            raise WeightCacheError(f"the weight cache is in {self.host} memory, which other processes "
                                   f"cannot write; a sharded trainer needs it in {SHM_DIR} (free room there)")
        slot = self._begin(version)
        return VersionRefs(version, self.layout.to_json(), self.layout.layout_id, "shm",
                           tuple(self._slot_messages(slot, version)))

    def end_version(self, version: int, ok: bool = True) -> None:
        """Close a slot `begin_version` opened: `ok` makes it the latest version; otherwise it
        is left absent (a writer failed), the other versions untouched."""
        version = int(version)
        slot = next((s for s in self._slots if s.building), None)
        if slot is None:
            raise WeightCacheError(f"no version is being written (end_version({version}))")
        self._end(slot, version, ok=ok)

    def _begin(self, version: int) -> _Slot:
        with self._lock:
            slot = self._pick_slot(version)
            slot.version, slot.building, slot.checksums = None, True, None
            return slot

    def _end(self, slot: _Slot, version: int, ok: bool, checksums: list[int] | None = None) -> None:
        with self._lock:
            slot.building = False
            if not ok:
                if self.latest_version == version:
                    self.latest_version = None
                return
            slot.version = version
            slot.checksums = list(checksums) if checksums is not None else None
            self.latest_version = version

    def _pick_slot(self, version: int) -> _Slot:
        same = [s for s in self._slots if s.version == version]
        if same:
            slot = same[0]
        elif len(self._slots) < MAX_VERSIONS:
            slot = self._new_slot()
            self._slots.append(slot)
            return slot
        else:
            free = [s for s in self._slots if s.version != self.active_version or s.version is None]
            slot = min(free, key=lambda s: -1 if s.version is None else s.version)
        if slot.building:
            raise WeightCacheError(f"version {slot.version} is being built concurrently")
        if slot.leases:
            raise WeightCacheError(f"cannot build version {version}: the slot it must reuse holds "
                                   f"version {slot.version}, which {slot.leases} sync(s) are reading")
        if slot.version is not None and slot.version == self.active_version:
            raise WeightCacheError(f"version {version} is the active version; build under a new version")
        return slot

    def promote_active(self, version: int) -> None:
        """Make `version` the one served to shards; the other slot becomes reusable."""
        with self._lock:
            self._find(version)
            self.active_version = int(version)

    def _find(self, version: int) -> _Slot:
        for s in self._slots:
            if s.version == version and not s.building:
                return s
        raise WeightCacheError(f"weight version {version} is not in the cache (it holds {self.versions()})")

    def buckets(self, version: int) -> list[torch.Tensor]:
        return list(self._find(version).buckets)

    def checksums(self, version: int) -> list[int]:
        """Per-bucket checksums of `version`, computed once and kept with the slot."""
        slot = self._find(version)
        if slot.checksums is None:
            slot.checksums = [bucket_checksum(b) for b in slot.buckets]
        return list(slot.checksums)

    @contextmanager
    def lease(self, version: int) -> Iterator[list[torch.Tensor]]:
        """Hold `version` for a sync: building over its slot is refused until released."""
        with self._lock:
            slot = self._find(version)
            slot.leases += 1
        try:
            yield list(slot.buckets)
        finally:
            with self._lock:
                slot.leases -= 1

    def refs(self, version: int) -> VersionRefs | None:
        """Where `version`'s buckets lie in shared memory, for shards on this host to read
        (None when the slots are private memory)."""
        slot = self._find(version)
        if slot.segment is None:
            return None
        return VersionRefs(int(version), self.layout.to_json(), self.layout.layout_id, "shm",
                           tuple(self._slot_messages(slot, int(version))))

    def _slot_messages(self, slot: _Slot, version: int) -> list[Message]:
        """One shm message per bucket of `slot`: its segment, the bucket's offset there; `lasting`
        (the slot is reused across versions: worth page-locking on the reading side)."""
        if slot.segment is None:
            raise WeightCacheError("this cache slot is not in shared memory")
        return [{**header(version, i, size, None), "shm": slot.segment.name, "offset": offset, "lasting": True}
                for i, (offset, size) in enumerate(zip(self.layout.bucket_offsets(), self.layout.bucket_sizes))]

    def published(self, version: int, seconds: float = 0.0) -> PublishedVersion:
        """What publishing `version` (built, made active) answers: its size and references."""
        return PublishedVersion(int(version), self.layout.num_buckets, self.layout.total_bytes, seconds,
                                list(self.versions()), self.refs(version))

    def shm_segments(self) -> list[ShmSegment]:
        return [s.segment for s in self._slots if s.segment is not None]

    def close(self) -> None:
        with self._lock:
            for s in self._slots:
                s.buckets.clear()
                if s.pinned is not None:
                    s.pinned.release()
                if s.segment is not None:
                    s.segment.close()
            self._slots.clear()
            self.latest_version = self.active_version = None

    def __enter__(self) -> BucketCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_host(host: HostMemory, need: int) -> str:
    """auto: page-locked shared memory with CUDA (private pinned memory if /dev/shm cannot hold
    `need` bytes, both versions), plain shared memory without."""
    if host not in HOST_MEMORY:
        raise WeightCacheError(f"host memory must be one of {', '.join(HOST_MEMORY)}, got {host!r}")
    shm_ok = os.path.isdir(SHM_DIR)
    if host == "auto":
        if torch.cuda.is_available():
            return "pinned_shm" if shm_ok and shm_available() >= need else "pinned"
        return "shm" if shm_ok else "pageable"
    if host in ("pinned", "pinned_shm") and not torch.cuda.is_available():
        raise WeightCacheError(f"{host} host memory needs CUDA; use host='shm' or 'pageable'")
    return host
