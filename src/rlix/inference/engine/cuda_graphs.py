"""CUDA graphs of the decode step: one replay instead of hundreds of kernel launches.

A transformers forward launches every kernel from Python; on a GPU a 24-layer decode step then
costs ~28 ms whatever the batch (measured on an H100 for the 0.5B shape, 5 ms as a graph). So on
CUDA the decode forward is captured once per batch-size bucket over static input buffers: the
batch is padded to its bucket with dummy rows (token 0 at position 0 of cache rows no running
sequence owns, which prefill overwrites before use), keys are read over the cache's whole
capacity (the mask hides the rest), and the logits of the real rows are sliced out. Graphs hold
raw pointers, so they are dropped and lazily re-captured whenever the KV cache or the parameter
storage moves (sleep, wake, reload after a level-2 sleep); in-place weight updates keep them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlix.inference.engine.model_runner import ModelRunner


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_rows (always included)."""
    sizes = {1, 2, 4, 8, *range(16, max_rows + 1, 8), max_rows}
    return sorted(b for b in sizes if b <= max_rows)


class DecodeGraphs:
    """Captured decode forwards of one ModelRunner, keyed by padded batch size."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.buckets = batch_buckets(runner.cache.num_rows)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._key: tuple[int, int, int] | None = None
        self._pool = None
        self._ids = self._pos = self._rows = self._span = None
        self.capture_s = 0.0  # every capture so far (each wake recaptures the sizes it uses)
        self.captures = 0

    def release(self) -> None:
        """Drop every graph and its memory pool (before sleeping)."""
        self._graphs.clear()
        self._pool = None
        self._key = None

    def _refresh(self) -> None:
        cache = self.runner.cache
        key = (cache.storage_version, self.runner.weights.storage_version, cache.capacity)
        if key == self._key:
            return
        self.release()
        device, rows = self.runner.device, cache.num_rows
        self._ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._pos = torch.zeros(rows, dtype=torch.long, device=device)
        self._rows = torch.arange(rows, device=device)
        self._span = torch.arange(cache.capacity, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._key = key

    def _forward(self, size: int) -> torch.Tensor:
        runner, cache = self.runner, self.runner.cache
        pos = self._pos[:size]
        keep = self._span[None, :] <= pos[:, None]
        mask = torch.zeros(keep.shape, dtype=runner.dtype, device=runner.device)
        mask = mask.masked_fill(~keep, runner.mask_min)[:, None, None, :]
        cache.set_decode(pos, cache.capacity, row_index=self._rows[:size])
        hidden = runner.hidden(self._ids[:size], pos[:, None], mask)
        return runner.lm_head(hidden[:, 0])

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):  # warm-up outside the graph, as capture requires
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size)
        self._graphs[size] = (graph, logits)
        torch.cuda.current_stream(self.runner.device).synchronize()
        self.capture_s += time.perf_counter() - t0
        self.captures += 1
        return graph, logits

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [n, V] for one token per running row, through the bucket's graph."""
        self._refresh()
        n = len(tokens)
        size = next(b for b in self.buckets if b >= n)
        self._ids[:size].zero_()
        self._pos[:size].zero_()
        self._ids[:n, 0].copy_(torch.tensor(tokens, dtype=torch.long))
        self._pos[:n].copy_(torch.tensor(positions, dtype=torch.long))
        graph, logits = self._graphs.get(size) or self._capture(size)
        graph.replay()
        return logits[:n]
