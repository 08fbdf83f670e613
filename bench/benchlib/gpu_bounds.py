"""What the engine's GPU figures are compared with, measured in the same run (engine_throughput).

- `memory_bandwidth`: the device's memory bandwidth, read+written bytes of a large device copy
  per second and bytes read per second by a reduction; a decode step cannot beat reading the
  weights and the live KV cache once at this rate.
- `compiled_static_decode`: transformers' own fastest single-batch decode, a StaticCache and
  `torch.compile(mode="reduce-overhead")` (CUDA graphs) over the same model: ms per decode step
  of a batch (one token per row, greedy argmax, prefill excluded).
"""

from __future__ import annotations

import time

import torch


@torch.inference_mode()
def memory_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> dict:
    """GB/s of a device copy (bytes read + written) and of a sum (bytes read)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    out = torch.empty((), dtype=torch.float32, device=device)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1000 / iters

    copy_s = timed(lambda: dst.copy_(src))
    read_s = timed(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out))
    del src, dst
    return {"copy_GBps": round(2 * nbytes / copy_s / 1e9, 1),
            "read_GBps": round(nbytes / read_s / 1e9, 1)}


def compiled_static_decode(model, batch: int, prompt_len: int = 32, steps: int = 64,  # type: ignore[no-untyped-def]
                           warmup: int = 8, mode: str = "reduce-overhead") -> dict:
    """ms per decode step of transformers' StaticCache + torch.compile at `batch` rows."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + warmup + steps + 1)

    def step(ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, past_key_values=cache, cache_position=position,
                    position_ids=position[None, :].expand(ids.shape[0], 1), use_cache=True)
        return out.logits[:, -1].argmax(dim=-1, keepdim=True)

    compiled = torch.compile(step, mode=mode, fullgraph=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
        positions = torch.arange(prompt_len, device=device)
        logits = model(input_ids=ids, past_key_values=cache, cache_position=positions,
                       use_cache=True).logits
        ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        position = prompt_len
        for _ in range(warmup):
            torch.compiler.cudagraph_mark_step_begin()
            ids = compiled(ids, torch.tensor([position], device=device)).clone()
            position += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
        start = time.perf_counter()
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            ids = compiled(ids, torch.tensor([position], device=device)).clone()
            position += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s = (time.perf_counter() - start) / steps
    return {"batch": batch, "step_ms": round(step_s * 1000, 4),
            "tok_s": round(batch / step_s, 1), "compile_s": round(compile_s, 1)}
