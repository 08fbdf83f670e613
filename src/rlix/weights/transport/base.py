"""The transport interface: how one bucket's bytes get from the sender to a shard.

The sync driver (sync.py) owns the control flow: per bucket it asks the sender for a small
message, hands that message to every target shard's endpoint, and waits until they consumed
it. The bytes travel out of band, as the transport chooses (a shared-memory offset, a CUDA IPC
handle, an NCCL broadcast). A message is a dict: `version`, `bucket`, `nbytes`, optionally
`checksum`, plus the transport's own fields; it never grows with the number of tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Message = dict[str, Any]


def header(version: int, index: int, nbytes: int, checksum: int | None) -> Message:
    out: Message = {"version": int(version), "bucket": int(index), "nbytes": int(nbytes)}
    if checksum is not None:
        out["checksum"] = int(checksum)
    return out


@runtime_checkable
class TransportSender(Protocol):
    """Sender side of one sync (made fresh per sync; closed after it)."""

    kind: str

    def open(self, num_ranks: int) -> dict[str, Any]:
        """Prepare a sync to `num_ranks` receiving ranks; return what each of them needs to join
        (the driver adds each receiver's own `rank`). Cheap and non-blocking."""
        ...

    def connect(self) -> None:
        """Blocking part of joining (a collective rendezvous); run while receivers join."""
        ...

    def stream(self, version: int, buckets: Sequence[torch.Tensor],
               checksums: Sequence[int] | None) -> Iterator[Message]:
        """One message per bucket, in order. When a message is yielded its bytes are available to
        receivers; the generator is resumed only after every receiver consumed it, so a
        double-buffered sender may reuse the buffer of bucket i for bucket i + 2."""
        ...

    def references(self, version: int, buckets: Sequence[torch.Tensor],
                   checksums: Sequence[int] | None) -> list[Message] | None:
        """Every bucket's message at once, where the bytes need no staging and nothing to
        connect (a receiver may read them in place whenever it likes), so the driver can send
        start, all messages and finish to a shard in one call; None otherwise."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class TransportReceiver(Protocol):
    """Receiver side, one per shard rank, kept across syncs."""

    kind: str
    persistent: bool  # buckets stay at the same memory across syncs, so views may be cached
    receives_into: bool  # receive(message, out=...) lands the bytes in the caller's buffer

    def open(self, info: dict[str, Any]) -> None:
        """Join one sync (info from the sender's open(), with this receiver's `rank`)."""
        ...

    def receive(self, message: Message, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket as a flat uint8 tensor, a view of the transferred memory where possible;
        in `out` where `receives_into` (elsewhere `out` is not passed)."""
        ...

    def release(self, message: Message) -> None:
        """The bucket was consumed: drop any handle to it."""
        ...

    def end(self) -> None:
        """The sync is over (finished or aborted): tear down per-sync state."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """A transport kind: makes a sender per sync, and the receivers on the shard side."""

    kind: str

    def sender(self) -> TransportSender: ...

    def receiver(self, device: str | torch.device = "cpu") -> TransportReceiver: ...


class SenderBase:
    """Per-bucket sending without pipelining; GPU senders override stream() to double-buffer."""

    kind = "base"

    def open(self, num_ranks: int) -> dict[str, Any]:
        return {}

    def connect(self) -> None:
        return None

    def send(self, version: int, index: int, buffer: torch.Tensor, checksum: int | None = None) -> Message:
        raise NotImplementedError

    def stream(self, version: int, buckets: Sequence[torch.Tensor],
               checksums: Sequence[int] | None) -> Iterator[Message]:
        for i, buf in enumerate(buckets):
            yield self.send(version, i, buf, None if checksums is None else checksums[i])

    def references(self, version: int, buckets: Sequence[torch.Tensor],
                   checksums: Sequence[int] | None) -> list[Message] | None:
        return None  # staged or connected: bucket by bucket

    def close(self) -> None:
        return None


class StagedSender(SenderBase):
    """A sender whose GPU-side stream double-buffers host buckets onto `self.device`."""

    device: torch.device | None = None
    _stager: Any = None

    def stream_staged(self, version: int, buckets: Sequence[torch.Tensor],
                      checksums: Sequence[int] | None) -> Iterator[Message]:
        from rlix.weights.transport.staging import CudaStager  # deferred: staging imports this module

        if self._stager is None:
            self._stager = CudaStager(self.device, max((b.numel() for b in buckets), default=1))
        for i, view in self._stager.staged(buckets):
            yield self.send(version, i, view, None if checksums is None else checksums[i])

    def close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class ReceiverBase:
    kind = "base"
    persistent = False
    receives_into = False

    def open(self, info: dict[str, Any]) -> None:
        return None

    def release(self, message: Message) -> None:
        return None

    def end(self) -> None:
        return None

    def close(self) -> None:
        return None
