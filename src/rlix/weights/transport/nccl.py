"""NCCL broadcast to shards on other GPUs (or hosts): a temporary process group per sync.

Each sync makes a fresh TCPStore rendezvous on a new port (a destroyed NCCL group cannot be
re-created on the same address), builds a private group of the sender (rank 0) and every rank
of the target shards, broadcasts bucket after bucket from double-buffered staging, and destroys
the group afterwards so no communicator memory stays behind on the shards' GPUs. The group is
built with the backend class directly, never as torch.distributed's default group, so the
trainer's or the engine's own groups are untouched. backend="gloo" runs the same code on CPU.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlix import env
from rlix.tcp_store import join_store, serve_store
from rlix.weights.transport.base import Message, ReceiverBase, SenderBase, header
from rlix.weights.transport.staging import CudaStager


def _make_group(backend: str, store: Any, rank: int, size: int, timeout: float) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    if backend != "nccl":
        raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
    env.apply_nccl_defaults()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def _destroy(group: Any) -> None:
    """Tear the group down locally. abort() first: a graceful shutdown() can wait for the peers
    to shut down too, which deadlocks a receiver that tears down before it answers `finish`
    while the sender tears down only after that answer. Callers finish their work first."""
    for teardown in (group.abort, group.shutdown):
        try:
            teardown()
            return
        except Exception:  # noqa: BLE001 - best effort teardown; try the next way
            continue


def _warm_up(group: Any, device: torch.device) -> None:
    """One tiny broadcast: every rank has joined and NCCL's communicator exists afterwards,
    so bucket broadcasts are not charged for the lazy initialisation."""
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    _broadcast(group, probe).wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class NcclSender(SenderBase):
    kind = "nccl"

    def __init__(self, device: str | torch.device = "cuda", backend: str = "nccl",
                 host: str = "127.0.0.1", timeout: float = 120.0) -> None:
        self.device = torch.device(device)
        self.backend, self.host, self.timeout = backend, host, timeout
        self._store: Any = None
        self._info: dict[str, Any] = {}
        self._group: Any = None
        self._stager: CudaStager | None = None

    def open(self, num_ranks: int) -> dict[str, Any]:
        self._store = serve_store(self.host, 0, num_ranks + 1, self.timeout, wait_for_workers=False)
        self._info = {"host": self.host, "port": int(self._store.port), "world_size": num_ranks + 1,
                      "prefix": f"rlix-sync-{secrets.token_hex(6)}", "backend": self.backend,
                      "timeout": self.timeout}
        return dict(self._info)

    def connect(self) -> None:
        store = dist.PrefixStore(self._info["prefix"], self._store)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._group = _make_group(self.backend, store, 0, self._info["world_size"], self.timeout)
        _warm_up(self._group, self.device)

    def stream(self, version: int, buckets: Sequence[torch.Tensor],
               checksums: Sequence[int] | None) -> Iterator[Message]:
        if self._group is None:
            raise RuntimeError("connect() first")
        if self.device.type == "cuda":
            if self._stager is None:
                self._stager = CudaStager(self.device, max((b.numel() for b in buckets), default=1))
            staged: Iterator[tuple[int, torch.Tensor]] = self._stager.staged(buckets)
        else:
            staged = enumerate(buckets)
        for i, view in staged:
            work = _broadcast(self._group, view)  # receivers post theirs once they get the message
            yield header(version, i, view.numel(), None if checksums is None else checksums[i])
            work.wait()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every broadcast done before the abort
            _destroy(self._group)
            self._group = None
        self._store = None


class NcclReceiver(ReceiverBase):
    kind = "nccl"
    persistent = False  # the receive buffer is freed after each sync
    receives_into = True  # receive(message, out=...) lands the bytes in the caller's buffer

    def __init__(self, device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        self._group: Any = None
        self._buffer: torch.Tensor | None = None

    def open(self, info: dict[str, Any]) -> None:
        timeout = float(info.get("timeout", 120.0))
        store = join_store(info["host"], int(info["port"]), int(info["world_size"]), timeout)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._group = _make_group(info["backend"], dist.PrefixStore(info["prefix"], store),
                                  int(info["rank"]), int(info["world_size"]), timeout)
        self._store = store
        _warm_up(self._group, self.device)

    def receive(self, message: Message, out: torch.Tensor | None = None) -> torch.Tensor:
        """The broadcast lands in `out` when given (an engine's staging, same size, on this
        device: no second copy), else in a reusable receive buffer."""
        if self._group is None:
            raise RuntimeError("no NCCL group: open() was not called for this sync")
        n = int(message["nbytes"])
        if (out is not None and out.numel() == n and out.dtype == torch.uint8 and out.device == self.device
                and out.is_contiguous()):
            _broadcast(self._group, out).wait()
            return out
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = None
            self._buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
        view = self._buffer[:n]
        _broadcast(self._group, view).wait()
        return view

    def end(self) -> None:
        if self._group is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            _destroy(self._group)
            self._group = None
        self._store = None
        self._buffer = None


class NcclTransport:
    kind = "nccl"

    def __init__(self, device: str | torch.device = "cuda", backend: str = "nccl",
                 host: str = "127.0.0.1", timeout: float = 120.0) -> None:
        self.device, self.backend, self.host, self.timeout = device, backend, host, timeout

    def sender(self) -> NcclSender:
        return NcclSender(self.device, self.backend, self.host, self.timeout)

    def receiver(self, device: str | torch.device = "cuda", **_: Any) -> NcclReceiver:
        return NcclReceiver(device)
