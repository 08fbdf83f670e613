"""In-process transport: the shard lives in the sender's process, so a bucket is handed over as
the tensor itself (the cache's host buffer, or a double-buffered GPU staging view)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlix.weights.transport.base import Message, ReceiverBase, StagedSender, header
from rlix.weights.transport.staging import CudaStager


class LocalSender(StagedSender):
    kind = "local"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._stager: CudaStager | None = None

    def send(self, version: int, index: int, buffer: torch.Tensor, checksum: int | None = None) -> Message:
        return {**header(version, index, buffer.numel(), checksum), "tensor": buffer}

    def stream(self, version: int, buckets: Sequence[torch.Tensor],
               checksums: Sequence[int] | None) -> Iterator[Message]:
        if self.device is None or self.device.type != "cuda":
            yield from super().stream(version, buckets, checksums)
            return
        yield from self.stream_staged(version, buckets, checksums)

    def close(self) -> None:
        self.close_stager()


class LocalReceiver(ReceiverBase):
    kind = "local"

    def __init__(self, persistent: bool = True) -> None:
        # host cache buffers stay put across syncs; GPU staging views do not
        self.persistent = persistent

    def receive(self, message: Message, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = message.get("tensor")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("local transport message carries no tensor")
        if tensor.is_cuda:
            self.persistent = False
        return tensor


class LocalTransport:
    kind = "local"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = device

    def sender(self) -> LocalSender:
        return LocalSender(self.device)

    def receiver(self, device: str | torch.device = "cpu", **_: Any) -> LocalReceiver:
        return LocalReceiver()
