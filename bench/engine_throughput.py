"""Embedded engine throughput vs transformers `generate`, measured in the same run.

Workload: requests with prompts of 8-64 random tokens and max_tokens 32-128, end-of-sequence
ignored, sampling at temperature 1. For each concurrency c in (1, 8, 32) the engine serves a
queue of requests with at most c in flight (a finished request's slot is refilled at once), and
the same requests run through two transformers baselines:
  - one at a time: `model.generate` per request;
  - static batches: the queue cut into batches of c, each left-padded to its longest prompt and
    generating until its longest max_tokens (only each request's own max_tokens count as output).
Throughput = generated tokens / wall time (prefill included). At c=1 the engine and the
one-at-a-time baseline alternate request by request, so load drifting on a shared machine
(other people's jobs) hits both alike.

CPU default: the `small` preset (24M params, fp32, one torch thread): on `tiny` per-step Python
overhead dominates and every engine looks alike (VLLM_NOTES.md), larger shapes blow the 3-minute
budget on a shared 2-core machine, and bf16 matmuls are slower than fp32 on this CPU.
`--gpu`: the `qwen2-0.5b-shape` preset in bf16 on CUDA (decode through CUDA graphs unless
`--no-cuda-graphs`). Ends by printing one JSON line of headline figures.

    .venv/bin/python bench/engine_throughput.py [--gpu] [--model NAME] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from dataclasses import dataclass

import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))],
                    rng.randint(32, 128)) for _ in range(n)]


async def engine_run(engine: TorchEngine, requests: list[Request], concurrency: int) -> float:
    """Generated tokens per second with at most `concurrency` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    generated = 0

    async def one(i: int, req: Request) -> None:
        nonlocal generated
        params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0, seed=i,
                                ignore_eos=True)
        async with gate:
            last = None
            async for last in engine.generate(f"bench-{concurrency}-{i}", req.prompt, params):
                pass
            assert last is not None and len(last.token_ids) == req.max_tokens
            generated += len(last.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return generated / (time.perf_counter() - start)


@torch.inference_mode()
def hf_generate(model, batch: list[Request], pad_id: int, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    width = max(len(r.prompt) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
        mask[i, width - len(r.prompt):] = 1
    new = max(r.max_tokens for r in batch)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=pad_id)
    assert out.shape[1] == width + new


def baseline_run(model, requests: list[Request], batch_size: int, pad_id: int,  # type: ignore[no-untyped-def]
                 device: torch.device) -> float:
    """Useful generated tokens per second of `generate` over batches of `batch_size`."""
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        hf_generate(model, requests[i:i + batch_size], pad_id, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="qwen2-0.5b-shape on CUDA, bf16")
    parser.add_argument("--model", help="preset or checkpoint (default: small, or the 0.5B shape)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads on CPU (default 1: steadiest on shared cores)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="decode eagerly on CUDA (to see what the graphs are worth)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if args.gpu else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    model_name = args.model or ("qwen2-0.5b-shape" if args.gpu else "small")
    dtype = "bfloat16" if args.gpu else "float32"
    # Request counts per concurrency: one-at-a-time is the slow path, so it gets fewer requests.
    counts = {1: 8, 8: 32, 32: 128} if args.gpu else {1: 6, 8: 16, 32: 64}

    engine = TorchEngine.from_pretrained(model_name, device=device, dtype=dtype,
                                         max_num_seqs=max(counts), max_model_len=512,
                                         cuda_graphs=not args.no_cuda_graphs)
    model = engine.model  # the same weights serve the baselines
    pad_id = engine.tokenizer.pad_token_id or 0
    vocab = engine.vocab_size

    warm = make_requests(4, vocab, seed=999)
    asyncio.run(engine_run(engine, warm, 4))
    baseline_run(model, warm[:2], 2, pad_id, device)

    rows = []
    one_at_a_time = None
    for c, n in counts.items():
        requests = make_requests(n, vocab, seed=args.seed + c)
        if c == 1:
            # Alternate the two per request, so load drifting on a shared machine hits both alike.
            eng_time = base_time = 0.0
            for req in requests:
                eng_time += req.max_tokens / asyncio.run(engine_run(engine, [req], 1))
                base_time += req.max_tokens / baseline_run(model, [req], 1, pad_id, device)
            tokens = sum(r.max_tokens for r in requests)
            eng, static = tokens / eng_time, tokens / base_time
            one_at_a_time = static
        else:
            eng = asyncio.run(engine_run(engine, requests, c))
            static = baseline_run(model, requests, c, pad_id, device)
        assert one_at_a_time is not None
        rows.append((c, n, eng, static))
        print(f"c={c:>2} ({n:>3} requests): engine {eng:8.1f} tok/s | generate static batch "
              f"of {c}: {static:8.1f} tok/s | engine / static {eng / static:5.2f}x | "
              f"engine / one-at-a-time {eng / one_at_a_time:5.2f}x", flush=True)
    engine.close()

    by_c = {c: (eng, static) for c, _, eng, static in rows}
    headline = {
        "bench": "engine_throughput",
        "model": model_name,
        "device": torch.cuda.get_device_name(device) if args.gpu else platform.processor() or "cpu",
        "dtype": dtype,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "cuda_graphs": device.type == "cuda" and not args.no_cuda_graphs,
        "tok_s_c1": round(by_c[1][0], 1),
        "tok_s_c8": round(by_c[8][0], 1),
        "tok_s_c32": round(by_c[32][0], 1),
        "one_at_a_time_tok_s": round(one_at_a_time or 0.0, 1),
        "static_batch_tok_s_c8": round(by_c[8][1], 1),
        "static_batch_tok_s_c32": round(by_c[32][1], 1),
        "speedup_vs_sequential_at_32": round(by_c[32][0] / (one_at_a_time or 1.0), 2),
        "speedup_vs_static_batch_at_32": round(by_c[32][0] / by_c[32][1], 2),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
