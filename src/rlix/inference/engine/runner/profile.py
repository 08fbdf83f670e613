"""Where an engine step's time goes: host-side phases always, GPU-side parts on request.

`StepProfile` (kept by EngineCore, a few perf_counter calls a step): seconds per phase of every
step (schedule: admission and planning; prefill: prefill forwards and their first tokens;
decode: preparing and launching the decode forward (and its sampling); wait: until its picks
are read back, i.e. the GPU time not hidden behind the host's;
append: the per-row Python that records tokens and checks stops; retire: compaction; deliver:
handing deltas to the callers' loops) and each step's duration with its batch size, so that a
benchmark can report a decode step's time at a given batch.

`gpu_breakdown` splits one decode step of the fused decoder into attention halves, MLP halves
and LM head + sampling, each captured as its own CUDA graph and replayed, so that the next
bottleneck is visible although a real step runs as a single graph.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from rlix.inference.engine.sampling import sample_plain

if TYPE_CHECKING:
    from rlix.inference.engine.runner.model_runner import ModelRunner

PHASES = ("schedule", "prefill", "decode", "wait", "append", "retire", "deliver")


class StepProfile:
    """Accumulated seconds per phase and the recent steps' durations."""

    def __init__(self, keep: int = 1 << 16) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        #: (seconds, rows decoded, whether it prefilled, live KV tokens read) per step
        self.steps: deque[tuple[float, int, bool, int]] = deque(maxlen=keep)
        self._start = self._last = 0.0
        self.batch = self.live = 0  # of the step in progress's decode (set by EngineCore)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps.clear()

    def begin(self) -> None:
        self._start = self._last = time.perf_counter()
        self.batch = self.live = 0

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def end(self, prefilled: bool) -> None:
        self.steps.append((time.perf_counter() - self._start, self.batch, prefilled, self.live))

    def summary(self, batches: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 192, 256)) -> dict:
        """ms per phase per step, and the median decode-only step at each of `batches`."""
        count = max(1, len(self.steps))
        by_batch: dict[int, list[float]] = {}
        for seconds, batch, prefilled, _ in self.steps:
            if not prefilled and batch in batches:
                by_batch.setdefault(batch, []).append(seconds)
        return {
            "steps": len(self.steps),
            "ms_per_step": {k: round(v * 1000 / count, 4) for k, v in self.seconds.items()},
            "decode_step_ms_by_batch": {b: round(statistics.median(v) * 1000, 4)
                                        for b, v in sorted(by_batch.items())},
        }


def _timed_graph(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    """ms per replay of fn captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


@torch.inference_mode()
def gpu_breakdown(runner: ModelRunner, batch: int, kv_len: int, iters: int = 200) -> dict:
    """ms of one fused decode step at `batch` rows reading `kv_len` keys, by part (each part
    graphed alone; their sum exceeds the whole by the graphs' own launch). Writes garbage into
    cache rows 0..batch-1: run it on an idle engine."""
    fused = runner.fused
    if fused is None or runner.device.type != "cuda":
        return {}
    fused.refresh()
    device = runner.device
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    pos = torch.full((batch,), kv_len - 1, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    uniforms = torch.full((batch,), 0.5, device=device)
    temps = torch.ones(batch, device=device)
    x0, step = fused.decode_context(ids, pos, kv_len, rows)
    layers = range(len(fused.layers))

    def whole() -> None:
        sample_plain(fused.decode(ids, pos, kv_len, rows), uniforms, temps)

    def attention() -> None:
        x = x0
        if fused.kernels:
            for i in layers:
                fused.kernel_attention(i, x, x, pos)
            return
        for i in layers:
            x = fused.decode_attention(i, x, step)

    def mlp() -> None:
        x = x0
        if fused.kernels:
            for i in layers:
                fused.kernel_mlp(i, x, x)
            return
        for i in layers:
            x = fused.decode_mlp(i, x)

    def head() -> None:
        sample_plain(fused.logits(fused.final(x0)), uniforms, temps)

    return {"batch": batch, "kv_len": kv_len, "kernels": fused.kernels,
            "step_ms": round(_timed_graph(whole, iters), 4),
            "attention_ms": round(_timed_graph(attention, iters), 4),
            "mlp_ms": round(_timed_graph(mlp, iters), 4),
            "lm_head_sampling_ms": round(_timed_graph(head, iters), 4)}
