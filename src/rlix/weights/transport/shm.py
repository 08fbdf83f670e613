"""POSIX shared memory between processes of one host: the receiver maps the sender's buffer
and reads the bucket in place; no byte goes through a socket.

When the cache itself lives in shared memory (its default) a message is just (segment name,
offset); any other buffer is first copied into one of two staging segments. A receiver on a
CUDA device page-locks each cache segment it maps, once (the cache reuses its segments across
versions; messages mark them `lasting`), so the engine's host->GPU copies from it run at pinned
speed. Staging segments are made per sync: locking one would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlix.weights.wire import ShmMapper, ShmSegment
from rlix.weights.transport.base import Message, ReceiverBase, SenderBase, header
from rlix.weights.transport.pinning import PinnedRange, page_lock_tensor


class ShmSender(SenderBase):
    kind = "shm"

    def __init__(self, segments: Callable[[], Iterable[ShmSegment]] | None = None) -> None:
        self._segments = segments
        self._staging: list[ShmSegment] = []
        self._turn = 0

    def _locate(self, buffer: torch.Tensor) -> tuple[str, int] | None:
        if buffer.device.type != "cpu" or self._segments is None:
            return None
        ptr, n = buffer.data_ptr(), buffer.numel()
        for seg in self._segments():
            base = seg.tensor.data_ptr()
            if base <= ptr and ptr + n <= base + seg.nbytes:
                return seg.name, ptr - base
        return None

    def send(self, version: int, index: int, buffer: torch.Tensor, checksum: int | None = None) -> Message:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("shm transport sends flat contiguous uint8 buckets")
        where = self._locate(buffer)
        if where is None:  # not in shared memory yet: stage it (two segments, alternating)
            slot = self._turn % 2
            self._turn += 1
            if len(self._staging) <= slot or self._staging[slot].nbytes < buffer.numel():
                if len(self._staging) > slot:
                    self._staging[slot].close()
                    self._staging[slot] = ShmSegment.create(buffer.numel(), prefix="rlix-s")
                else:
                    self._staging.append(ShmSegment.create(buffer.numel(), prefix="rlix-s"))
            seg = self._staging[slot]
            seg.tensor[: buffer.numel()].copy_(buffer)
            return {**header(version, index, buffer.numel(), checksum), "shm": seg.name, "offset": 0}
        # the cache's own segment: it outlives this sync (worth page-locking on the other side)
        return {**header(version, index, buffer.numel(), checksum), "shm": where[0], "offset": where[1],
                "lasting": True}

    def references(self, version: int, buckets: list[torch.Tensor],
                   checksums: list[int] | None) -> list[Message] | None:
        """All messages at once when every bucket already lives in shared memory (the cache's
        own segments): nothing is staged, so they stay valid until the cache slot is reused."""
        out: list[Message] = []
        for i, buf in enumerate(buckets):
            flat = buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            where = self._locate(buf) if flat else None
            if where is None:
                return None
            out.append({**header(version, i, buf.numel(), None if checksums is None else checksums[i]),
                        "shm": where[0], "offset": where[1], "lasting": True})
        return out

    def close(self) -> None:
        for seg in self._staging:
            seg.close()
        self._staging.clear()


class ShmReceiver(ReceiverBase):
    kind = "shm"
    persistent = True  # segments stay mapped; the cache reuses its slots across versions

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self._mapper = ShmMapper()
        self.pin = torch.device(device).type == "cuda"
        self._pinned: dict[str, PinnedRange | None] = {}  # segment name -> its page-locking

    def receive(self, message: Message, out: torch.Tensor | None = None) -> torch.Tensor:
        name = str(message["shm"])
        bucket = self._mapper.bucket(name, int(message["offset"]), int(message["nbytes"]))
        if self.pin and message.get("lasting") and name not in self._pinned:
            self._pinned[name] = page_lock_tensor(bucket)  # the whole mapping, once
        return bucket

    def close(self) -> None:
        for pinned in self._pinned.values():
            if pinned is not None:
                pinned.release()  # before the mapping goes
        self._pinned.clear()
        self._mapper.close()


class ShmTransport:
    kind = "shm"

    def __init__(self, segments: Callable[[], Iterable[ShmSegment]] | None = None) -> None:
        self.segments = segments

    def sender(self) -> ShmSender:
        return ShmSender(self.segments)

    def receiver(self, device: str | torch.device = "cpu", **_: Any) -> ShmReceiver:
        return ShmReceiver(device)
