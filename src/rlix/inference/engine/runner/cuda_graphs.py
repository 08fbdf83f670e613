"""CUDA graphs of the decode step: one replay instead of hundreds of kernel launches.

A forward launched op by op from Python is launch-bound on a GPU (a 24-layer decode step costs
about the same whatever the batch: docs/BENCHMARKS.md). So on CUDA the decode step
is captured once per (batch bucket, key-span bucket) over static input buffers and replayed.
The batch is padded to its bucket with dummy rows (token 0 at position 0 of cache rows no running
sequence owns, which prefill overwrites before use); keys are read over the span bucket
(128, 256, 512, ... positions: the power of two above the longest row, so attention reads about
the live tokens, not the whole capacity); the mask hides each row's positions past its own.
The graph also samples (temperature / greedy rows, `sampling.sample_plain`) and packs tokens and
logprobs into one small buffer, so a step costs one host->device copy of its inputs (tokens,
positions, uniforms, temperatures), one replay and one device->host read. Graphs hold raw
pointers, so they are dropped and lazily re-captured whenever the KV cache or the parameter
storage moves (sleep, wake, reload after a level-2 sleep); in-place weight updates keep them.
Where the KV cache and the weights live at fixed virtual addresses (vmm.py) a sleep frees
their memory without moving them, `storage_key` stays the same, and the graphs are kept.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from rlix.inference.engine.runner import vmm
from rlix.inference.engine.sampling import Sampled, sample_plain

if TYPE_CHECKING:
    from rlix.inference.engine.runner.model_runner import ModelRunner

#: smallest key span a graph reads (shorter spans would only add graphs, not speed)
MIN_KV_SPAN = 128


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, every 8 to 64, every 16 to 128, every 32 beyond, and max_rows: padding a
    batch costs little (a decode step reads the weights once whatever its size), graphs do."""
    sizes = {1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16), *range(160, max_rows + 1, 32),
             max_rows}
    return sorted(b for b in sizes if b <= max_rows)


def kv_span(length: int, capacity: int) -> int:
    """The key span a step whose longest row needs `length` positions reads."""
    span = MIN_KV_SPAN
    while span < length:
        span *= 2
    return min(span, capacity)


_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream that captures warm up on, per device. cuBLAS keeps a workspace per
    stream it ran on: a new stream per capture left one per capture, which a sleep that keeps
    the graphs (and so the workspaces, `release_memory`) would keep too."""
    key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if key not in _warmup_streams:
        _warmup_streams[key] = torch.cuda.Stream(key)
    return _warmup_streams[key]


def storage_key(runner: ModelRunner) -> tuple[int, int, int]:
    """What a captured graph's raw pointers depend on: the KV cache's and the parameters'
    storage. Each version moves whenever an address moves (a virtual cache or weight store
    unmapped and mapped again at its addresses does not move them)."""
    cache = runner.cache
    return cache.storage_version, runner.weights.storage_version, cache.capacity


class DecodeGraphs:
    """Captured decode steps of one ModelRunner, keyed by (padded batch, key span)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.buckets = batch_buckets(runner.cache.num_rows)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._key: tuple[int, int, int] | None = None
        self._pool = None
        self._inputs: torch.Tensor | None = None  # [4, rows] float64: ids, positions, u, temp
        self._host: torch.Tensor | None = None  # its pinned host twin
        self._rows: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host
        self._outs: list[torch.Tensor] | None = None  # two pinned [2, rows] buffers for launches' picks
        self._next_out = 0
        self.capture_s = 0.0  # every capture so far (a wake that moved storage recaptures)
        self.captures = 0

    def release(self) -> None:
        """Drop every graph and its memory pool (before sleeping)."""
        self._graphs.clear()
        self._pool = None
        self._key = None

    def release_if_moved(self) -> None:
        """Drop the graphs if the storage moved since they were captured."""
        if self._key is not None and self._key != storage_key(self.runner):
            self.release()

    def _refresh(self) -> None:
        key = storage_key(self.runner)
        if key == self._key:
            return
        self.release()
        device, rows = self.runner.device, self.runner.cache.num_rows
        self._inputs = torch.zeros(4, rows, dtype=torch.float64, device=device)
        if self._host is None:
            self._host = torch.zeros(4, rows, dtype=torch.float64, pin_memory=True)
        self._rows = torch.arange(rows, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._key = key

    def _span(self, length: int) -> int:
        capacity = self.runner.cache.capacity
        return capacity if self.runner.reads_live_keys else kv_span(length, capacity)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (batch bucket, key span) now. Only while no row is running: the
        capture's warm-up forwards write position 0 of rows 0..bucket-1."""
        self._refresh()
        spans = sorted({self._span(n) for n in range(1, self.runner.cache.capacity + 1, 64)}
                       | {self._span(self.runner.cache.capacity)})
        assert self._inputs is not None
        self._inputs.zero_()
        for size in self.buckets:
            for span in spans:
                if (size, span) not in self._graphs:
                    self._capture(size, span)

    def _forward(self, size: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._inputs is not None and self._rows is not None
        inputs = self._inputs[:, :size]
        ids, pos = inputs[0].long(), inputs[1].long()
        logits = self.runner.decode_logits(ids, pos, span, self._rows[:size])
        tokens, logprobs = sample_plain(logits, inputs[2].float(), inputs[3].float())
        return logits, torch.stack((tokens.double(), logprobs.double()))

    def _capture(self, size: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        device = self.runner.device
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph, as capture requires
            for _ in range(2):
                self._forward(size, span)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with vmm.capturing(), torch.cuda.graph(graph, pool=self._pool):
            logits, picks = self._forward(size, span)
        self._graphs[(size, span)] = (graph, logits, picks)
        torch.cuda.current_stream(device).synchronize()
        self.capture_s += time.perf_counter() - t0
        self.captures += 1
        return graph, logits, picks

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int],
               uniforms: list[float] | None = None, temperatures: list[float] | None = None,
               after: DecodeLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for rows 0..n-1: (logits [n, V], picks [2, n] = tokens and raw
        logprobs sampled in the graph from `uniforms` / `temperatures`; greedy when not given).
        With `after`, a negative tokens[i] = -(r + 1) stands for the token `after` sampled for its
        row r, gathered on the device (the host never saw it).
        Nothing is synchronised: read the picks (one device->host copy) or the logits."""
        logits, picks = self._replay(tokens, positions, uniforms, temperatures, after)
        return logits[:len(tokens)], picks[:, :len(tokens)]

    def _replay(self, tokens: list[int], positions: list[int], uniforms: list[float] | None,
                temperatures: list[float] | None, after: DecodeLaunch | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode`, returning the graph's whole (bucket-sized) outputs."""
        self._refresh()
        assert self._host is not None and self._inputs is not None
        n = len(tokens)
        size = next(b for b in self.buckets if b >= n)
        span = self._span(max(positions) + 1)
        host = self._host
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        host[:, :n] = torch.tensor([tokens, positions, uniforms or [0.5] * n,
                                    temperatures or [0.0] * n], dtype=torch.float64)
        if size > n:  # dummy rows: token 0 at position 0, greedy
            host[:, n:size] = torch.tensor([[0.0], [0.0], [0.5], [0.0]], dtype=torch.float64)
        # the whole pinned buffer (a few KB): a strided slice would be staged through pageable
        # memory, and such a copy first waits for everything queued on the stream
        self._inputs.copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if after is not None:  # queued before this replay, which may overwrite after's picks
            self._inputs[0, :n] = gather_inputs(self._inputs[0, :n], after.picks[0])
        graph, logits, picks = self._graphs.get((size, span)) or self._capture(size, span)
        graph.replay()
        return logits, picks

    @torch.inference_mode()
    def launch(self, tokens: list[int], positions: list[int], uniforms: list[float],
               temperatures: list[float], after: DecodeLaunch | None = None) -> DecodeLaunch:
        """`decode`, with its picks queued for a copy into pinned memory: read them later with
        `DecodeLaunch.result()` while the device runs on (the next step can be launched first)."""
        _, picks = self._replay(tokens, positions, uniforms, temperatures, after)
        if self._outs is None:
            self._outs = [torch.zeros(2 * self.runner.cache.num_rows, dtype=torch.float64, pin_memory=True)
                          for _ in range(2)]
        size, n = picks.shape[1], len(tokens)
        out = self._outs[self._next_out][:2 * size].view(2, size)  # contiguous, as picks: no staging
        self._next_out ^= 1  # two launches are unread at most: the one read next, and the newest
        out.copy_(picks, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return DecodeLaunch(picks[:, :n], out[:, :n], done)


def gather_inputs(inputs: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """`inputs` with each entry -(r + 1) replaced by picks[r] (the step before's token for row r);
    entries >= 0 are token ids already."""
    rows = (-inputs - 1).clamp(min=0).long()
    return torch.where(inputs < 0, picks.index_select(0, rows), inputs)


class DecodeLaunch:
    """A plain decode step started on the device: its picks [2, n] there (to gather the next
    step's inputs from) and, once `done`, in `out` on the host. Eager steps (no graphs) are
    done at once: `out` is `picks` and `done` None."""

    def __init__(self, picks: torch.Tensor, out: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        self.picks, self.out, self.done = picks, out, done

    def result(self) -> Sampled:
        """The step's tokens and raw logprobs (waiting for this step only, not the ones after)."""
        if self.done is not None:
            self.done.synchronize()
        tokens, logprobs = self.out.tolist()
        return Sampled([int(t) for t in tokens], logprobs)


#: a prefill larger than this many padded tokens runs eagerly (compute-bound: a graph saves
#: little and would hold large activations)
MAX_GRAPHED_PREFILL_TOKENS = 4096
#: on CUDA the engine cuts prefills into groups of at most this many padded tokens, so that
#: each fits a graph after rounding up to its buckets (at most 1.5x per dimension)
PREFILL_GROUP_TOKENS = 1536
#: the prefill graphs `capture_all` makes up front: up to this many prompts, this width
CAPTURE_PROMPTS, CAPTURE_WIDTH = 64, 128


def prefill_bucket(n: int, floor: int) -> int:
    """The smallest of floor * (1, 1.5, 2, 3, 4, 6, 8, ...) that holds n."""
    size = floor
    while True:
        if size >= n:
            return size
        if size * 3 // 2 >= n and (size * 3) % 2 == 0:
            return size * 3 // 2
        size *= 2


class PrefillGraphs:
    """Captured fused prefills, keyed by (padded prompts, padded width): an eager prefill of
    the 0.5B shape launches ~400 kernels from Python (2-3 ms) for a few dozen tokens. Inputs:
    token ids [P, W] (right-padded with 0), each prompt's cache row and length; output: each
    prompt's last-position logits. Padding prompts write row `num_rows` - 1... no: they write
    the rows after the real ones, which no running sequence owns (see `fits`)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._key: tuple[int, int, int] | None = None
        self._pool = None
        self._ids: torch.Tensor | None = None  # [rows, W max] long
        self._meta: torch.Tensor | None = None  # [2, rows] long: cache row, length
        self.captures = 0
        self.capture_s = 0.0

    def release(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._key = None

    def release_if_moved(self) -> None:
        """Drop the graphs if the storage moved since they were captured."""
        if self._key is not None and self._key != storage_key(self.runner):
            self.release()

    def shape(self, prompts: int, width: int, first_row: int) -> tuple[int, int] | None:
        """The graph (P, W) that serves this prefill, or None to run it eagerly (too large,
        or its padding prompts would reach past the cache's rows)."""
        size = prefill_bucket(prompts, 1)
        span = prefill_bucket(width, 16)
        if (size * span > MAX_GRAPHED_PREFILL_TOKENS or first_row + size > self.runner.cache.num_rows
                or span > self.runner.cache.capacity):
            return None
        return size, span

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture the common shapes now (up to CAPTURE_PROMPTS x CAPTURE_WIDTH); only while no
        row is running: the captures write garbage into rows from 0."""
        self._refresh()
        assert self._ids is not None and self._meta is not None
        self._ids.zero_()
        self._meta.zero_()
        self._meta[1].fill_(1)
        shapes = {self.shape(p, w, 0) for p in range(1, CAPTURE_PROMPTS + 1)
                  for w in range(1, CAPTURE_WIDTH + 1)}
        for shape in sorted(s for s in shapes if s is not None):
            if shape not in self._graphs:
                self._capture(*shape)

    def _refresh(self) -> None:
        key = storage_key(self.runner)
        if key == self._key:
            return
        self.release()
        cache, device = self.runner.cache, self.runner.device
        self._ids = torch.zeros(cache.num_rows, MAX_GRAPHED_PREFILL_TOKENS, dtype=torch.long,
                                device=device)
        self._meta = torch.zeros(2, cache.num_rows, dtype=torch.long, device=device)
        self._pool = torch.cuda.graph_pool_handle()
        self._key = key

    def _forward(self, size: int, span: int) -> torch.Tensor:
        assert self._ids is not None and self._meta is not None
        fused = self.runner.fused
        assert fused is not None
        rows, lengths = self._meta[0, :size], self._meta[1, :size]
        hidden = fused.prefill(self._ids[:size, :span], rows)
        last = hidden[torch.arange(size, device=hidden.device), lengths - 1]
        return fused.logits(last)

    def _capture(self, size: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        device = self.runner.device
        side = warmup_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(size, span)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with vmm.capturing(), torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size, span)
        self._graphs[(size, span)] = (graph, logits)
        torch.cuda.current_stream(device).synchronize()
        self.capture_s += time.perf_counter() - t0
        self.captures += 1
        return graph, logits

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], first_row: int, shape: tuple[int, int]
                ) -> torch.Tensor:
        """Last-position logits [P, V] of `prompts`, run into rows first_row.. (shape from
        `shape()`)."""
        self._refresh()
        assert self._ids is not None and self._meta is not None
        size, span = shape
        n = len(prompts)
        ids = torch.zeros(size, span, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        lengths = [len(p) for p in prompts] + [1] * (size - n)
        meta = torch.tensor([list(range(first_row, first_row + size)), lengths], dtype=torch.long)
        self._ids[:size, :span].copy_(ids)
        self._meta[:, :size].copy_(meta)
        graph, logits = self._graphs.get((size, span)) or self._capture(size, span)
        graph.replay()
        return logits[:n]
