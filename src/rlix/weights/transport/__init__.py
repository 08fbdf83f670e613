"""Transports for weight buckets behind one interface; `make_transport` picks one by kind.

- local: the shard is in this process; the bucket tensor is handed over as is
- shm: another process on this host maps the sender's shared memory (CPU)
- cuda_ipc: another process on the same GPU opens one IPC handle per bucket
- nccl: other GPUs; a temporary process group per sync broadcasts each bucket
"""

from __future__ import annotations

from typing import Any

import torch

from rlix.errors import WeightUpdateError
from rlix.weights.transport.base import (Message, SenderBase, Transport, TransportReceiver,
                                         TransportSender, header)

KINDS = ("local", "shm", "cuda_ipc", "nccl")


def make_transport(kind: str, **options: Any) -> Transport:
    """The sending side's transport of `kind`; options go to its constructor (device, backend...)."""
    if kind == "local":
        from rlix.weights.transport.local import LocalTransport  # deferred: only the kind asked for

        return LocalTransport(**options)
    if kind == "shm":
        from rlix.weights.transport.shm import ShmTransport  # deferred: as above

        return ShmTransport(**options)
    if kind == "cuda_ipc":
        from rlix.weights.transport.cuda_ipc import CudaIpcTransport  # deferred: CUDA only

        return CudaIpcTransport(**options)
    if kind == "nccl":
        from rlix.weights.transport.nccl import NcclTransport  # deferred: torch.distributed

        return NcclTransport(**options)
    raise WeightUpdateError(f"unknown weight transport {kind!r}; expected one of {', '.join(KINDS)}")


def make_receiver(kind: str, device: str | torch.device = "cpu") -> TransportReceiver:
    """The receiving side of `kind`, as a shard builds it from /init_weight_transfer_engine."""
    return make_transport(kind).receiver(device)


__all__ = ["KINDS", "Message", "SenderBase", "Transport", "TransportReceiver", "TransportSender",
           "header", "make_receiver", "make_transport"]
