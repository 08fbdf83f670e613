"""Double-buffered host-to-GPU staging of buckets.

Two device buffers of one bucket each: while bucket i is being consumed (sent over NCCL, read
through an IPC handle, copied into an engine), bucket i + 1 is already being copied in on a
separate stream. Extra GPU memory at the peak is therefore two buckets, whatever the model size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


class CudaStager:
    def __init__(self, device: str | torch.device, capacity: int) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaStager needs a CUDA device, got {self.device}")
        self.capacity = int(capacity)
        self._buffers: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None

    def staged(self, buckets: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (index, device view) per bucket, copying the next one in meanwhile. Resuming the
        generator means the consumer is done with the yielded view (its work is on the current
        stream or already finished)."""
        n = len(buckets)
        if n == 0:
            return
        if all(b.device == self.device for b in buckets):  # already there: nothing to stage
            yield from enumerate(buckets)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        ready = [torch.cuda.Event(), torch.cuda.Event()]
        free: list[torch.cuda.Event | None] = [None, None]

        def issue(i: int) -> torch.Tensor:
            slot = i % 2
            while len(self._buffers) <= slot:
                self._buffers.append(torch.empty(self.capacity, dtype=torch.uint8, device=self.device))
            src = buckets[i]
            if src.numel() > self.capacity:
                raise ValueError(f"bucket {i} has {src.numel()} bytes, staging holds {self.capacity}")
            dst = self._buffers[slot][: src.numel()]
            with torch.cuda.stream(self._stream):
                if free[slot] is not None:
                    self._stream.wait_event(free[slot])
                dst.copy_(src, non_blocking=True)
                ready[slot].record(self._stream)
            return dst

        views: list[torch.Tensor | None] = [issue(0), None]
        with torch.cuda.device(self.device):
            for i in range(n):
                if i + 1 < n:
                    views[(i + 1) % 2] = issue(i + 1)
                slot = i % 2
                ready[slot].synchronize()
                view = views[slot]
                assert view is not None  # issued for i at i - 1 (or before the loop)
                yield i, view
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                free[slot] = ev

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._buffers.clear()
        self._stream = None
