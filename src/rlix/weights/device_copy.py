"""The newest weights packed on the trainer's GPU, for the shards that share that GPU.

A shard that slept on the trainer's GPU can take the new version straight from the trainer's
device memory (CUDA IPC, one device-to-device copy) while the trainer is still there, instead
of from the host cache after the trainer offloaded (a host-to-device copy, an order of magnitude
slower: docs/BENCHMARKS.md). This is that copy: one flat device buffer in the host cache's layout (same layout id, so
a shard initialised for one accepts the other), one version at a time, freed before the
trainer's memory is measured free. `refs(version)` gives the shards one CUDA IPC handle of
the whole buffer (rlix.weights.refit's device route); `lease` and `checksums` are what the
in-process driver (sync.py) reads of a cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from rlix.errors import WeightCacheError
from rlix.weights.api import VersionRefs
from rlix.weights.buckets import bucket_views, pack
from rlix.weights.wire import Layout, bucket_checksum

#: room left beside the copy and the receiving shard's staging of it (allocator slack, kernels)
HEADROOM_BYTES = 512 << 20


class DeviceCopy:
    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout, self.device = layout, torch.device(device)
        self.version: int | None = None
        self._flat: torch.Tensor | None = None
        self._buckets: list[torch.Tensor] = []
        self._checksums: list[int] | None = None
        self._leases = 0
        self._lock = threading.Lock()

    @staticmethod
    def fits(layout: Layout, device: torch.device) -> bool:
        """Whether the device has room for the copy and, beside it, a shard's staging of it."""
        free, _ = torch.cuda.mem_get_info(device)
        return free >= 2 * layout.total_bytes + HEADROOM_BYTES

    def build(self, version: int, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Pack `tensors` (on this device) as `version`; returns the device buckets (which the
        host cache can be filled from: one copy per bucket instead of one per tensor)."""
        with self._lock:
            if self._leases:
                raise WeightCacheError(f"the device copy of version {self.version} is being synced")
            if self._flat is None:
                self._flat = torch.empty(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
                self._buckets = bucket_views(self.layout, self._flat)
            self.version, self._checksums = None, None
        pack(self.layout, tensors, self._buckets)
        self.version = int(version)
        return list(self._buckets)

    @contextmanager
    def lease(self, version: int) -> Iterator[list[torch.Tensor]]:
        with self._lock:
            if self.version != int(version) or self._flat is None:
                raise WeightCacheError(f"the device copy holds version {self.version}, not {version}")
            self._leases += 1
        try:
            yield list(self._buckets)
        finally:
            with self._lock:
                self._leases -= 1

    def refs(self, version: int) -> VersionRefs:
        """The buckets of `version` as CUDA IPC references (one handle of the whole buffer),
        valid until `free`: a shard on this GPU opens it and copies each bucket device to device."""
        from rlix.weights.transport.cuda_ipc import CudaIpcSender  # CUDA only

        with self.lease(version) as buckets:
            messages = CudaIpcSender(self.device).references(int(version), buckets, None)
        if messages is None:
            raise WeightCacheError("the device copy is not on a CUDA device")
        return VersionRefs(int(version), self.layout.to_json(), self.layout.layout_id, "cuda_ipc", tuple(messages))

    def checksums(self, version: int) -> list[int]:
        with self.lease(version) as buckets:
            if self._checksums is None:
                self._checksums = [bucket_checksum(b) for b in buckets]
            return list(self._checksums)

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def free(self) -> None:
        """Let go of the device memory (the receivers dropped their handles after each sync)."""
        with self._lock:
            if self._leases:
                raise WeightCacheError("the device copy is being synced; it cannot be freed now")
            self._flat, self._buckets, self.version, self._checksums = None, [], None, None
        torch.cuda.ipc_collect()


def copy_to_host(device: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    """A device copy's buckets into the host cache's (`BucketCache.write_version`'s fill): one
    copy per bucket instead of one per tensor, waited for once."""
    for d, h in zip(device, host):
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
