"""CUDA IPC: sender and shard share one GPU. Each bucket is staged into one of two device
buffers and shared as ONE IPC handle (not one per tensor: rebuilding thousands of handles is
what makes per-tensor IPC slow); the receiver drops it as soon as the bucket is consumed.
Buckets that already live in one device allocation (the trainer's device copy) share one
handle of it, opened once per sync."""

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
        """Every bucket at once when all of them already live on the device (the trainer's
        device copy): nothing to stage, so a shard gets the whole update in one call. Buckets
        of one allocation share ONE handle of it (each message says where its bucket starts):
        exporting and opening a handle is the cost here, not the bytes."""
        if not all(b.is_cuda for b in buckets):
            return None
        from torch.multiprocessing.reductions import reduce_tensor  # deferred: CUDA buffers only

        shared: dict[int, tuple] = {}  # storage address -> the handle of the whole storage
        out: list[Message] = []
        for i, b in enumerate(buckets):
            storage = b.untyped_storage()
            args = shared.get(storage.data_ptr())
            if args is None:
                whole = torch.empty(0, dtype=torch.uint8, device=b.device).set_(storage, 0, (storage.nbytes(),), (1,))
                args = shared[storage.data_ptr()] = reduce_tensor(whole)[1]
            out.append({**header(version, i, b.numel(), None if checksums is None else checksums[i]),
                        "ipc": args, "at": b.data_ptr() - storage.data_ptr(), "lasting": True})
        return out

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

    def receive(self, message: Message, out: torch.Tensor | None = None) -> torch.Tensor:
        args = tuple(message["ipc"])
        if "at" in message:  # a bucket of a shared allocation, whose handle is opened once
            whole = self._open.get(bytes(args[7]))
            if whole is None:
                whole = self._open[bytes(args[7])] = open_cuda_ipc(args)
            at, nbytes = int(message["at"]), int(message["nbytes"])
            if at < 0 or at + nbytes > whole.numel():
                raise ValueError(f"bucket [{at}, {at + nbytes}) is outside the shared allocation "
                                 f"of {whole.numel()} bytes")
            tensor = whole[at: at + nbytes]
        else:
            tensor = open_cuda_ipc(args)
            self._open.setdefault(bytes(args[7]), tensor)  # the storage's IPC handle
        self._held[int(message["bucket"])] = tensor
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
