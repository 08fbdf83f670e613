"""CUDA IPC: sender and shard share one GPU. Each bucket is staged into one of two device
buffers and shared as ONE IPC handle (not one per tensor: rebuilding thousands of handles is
what makes per-tensor IPC slow); the receiver drops it as soon as the bucket is consumed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlix.weights.wire import open_cuda_ipc
from rlix.weights.transport.base import Message, ReceiverBase, StagedSender, header
from rlix.weights.transport.staging import CudaStager


class CudaIpcSender(StagedSender):
    kind = "cuda_ipc"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        self._stager: CudaStager | None = None

    def send(self, version: int, index: int, buffer: torch.Tensor, checksum: int | None = None) -> Message:
        if not buffer.is_cuda:
            raise ValueError("cuda_ipc sends device buffers; use stream() to stage host buckets")
        from torch.multiprocessing.reductions import reduce_tensor  # deferred: CUDA buffers only

        _, args = reduce_tensor(buffer)
        return {**header(version, index, buffer.numel(), checksum), "ipc": args}

    def stream(self, version: int, buckets: Sequence[torch.Tensor],
               checksums: Sequence[int] | None) -> Iterator[Message]:
        yield from self.stream_staged(version, buckets, checksums)

    def references(self, version: int, buckets: Sequence[torch.Tensor],
                   checksums: Sequence[int] | None) -> list[Message] | None:
        """Every bucket's handle at once when all of them already live on the device (the
        trainer's device copy): nothing to stage, so a shard gets the whole update in one call."""
        if not all(b.is_cuda for b in buckets):
            return None
        return [self.send(version, i, b, None if checksums is None else checksums[i])
                for i, b in enumerate(buckets)]

    def close(self) -> None:
        self.close_stager()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


class CudaIpcReceiver(ReceiverBase):
    kind = "cuda_ipc"
    persistent = False

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        self._held: dict[int, torch.Tensor] = {}
        # one bucket per sender allocation kept open until the sync ends: buckets that are views
        # of one buffer (the trainer's device copy) then open its handle once, not once each
        self._open: dict[bytes, torch.Tensor] = {}

    def receive(self, message: Message) -> torch.Tensor:
        args = tuple(message["ipc"])
        tensor = open_cuda_ipc(args)
        self._held[int(message["bucket"])] = tensor
        self._open.setdefault(bytes(args[7]), tensor)  # the storage's IPC handle
        return tensor

    def release(self, message: Message) -> None:
        self._held.pop(int(message["bucket"]), None)

    def end(self) -> None:
        self._held.clear()
        self._open.clear()


class CudaIpcTransport:
    kind = "cuda_ipc"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = device

    def sender(self) -> CudaIpcSender:
        return CudaIpcSender(self.device)

    def receiver(self, device: str | torch.device = "cuda", **_: Any) -> CudaIpcReceiver:
        return CudaIpcReceiver(device)
