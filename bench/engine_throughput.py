"""Embedded engine throughput vs transformers `generate`, measured in the same run.

Workload: requests with prompts of 8-64 random tokens and max_tokens 32-128, end-of-sequence
ignored, sampling at temperature 1. For each concurrency c in (1, 8, 32; and 256 with --gpu) the
engine serves a queue of requests with at most c in flight (a finished request's slot is
refilled at once), each asked for its final output only (`final_only`, as the server asks for
non-streamed requests; `tok_s_c32_streamed` is c=32 with every token streamed), and the same
requests run through two transformers baselines:
  - one at a time: `model.generate` per request;
  - static batches: the queue cut into batches of c, each left-padded to its longest prompt and
    generating until its longest max_tokens (only each request's own max_tokens count as output;
    on GPU only the first two batches run: they are slow and their rate is what counts).
Throughput = generated tokens / wall time (prefill included). At c=1 the engine and the
one-at-a-time baseline alternate request by request, so load drifting on a shared machine
(other people's jobs) hits both alike.

With --gpu the run also measures (gpu_bounds.py) the device's memory bandwidth and transformers'
StaticCache + torch.compile(mode="reduce-overhead") decode of the same model at batch 32 and
256, and reports: `decode_step_vs_bound_c32`, the engine's median decode step at 32 rows (steps
without a prefill) over the time to read the weights and those rows' live KV cache once at the
measured bandwidth (the larger of copy and read); `engine_vs_compiled_static_c32` and `_c256`,
the engine's throughput at that concurrency (prefill and scheduling included) over the compiled
decode's tokens per second at that batch (decode steps only); the engine's per-step profile by phase at c=32 and c=256, and the GPU
time of one graphed decode step at 32 rows split into attention, MLP and LM head + sampling.

CPU default: the `small` preset (24M params, fp32, one torch thread): on `tiny` per-step Python
overhead dominates and every engine looks alike (VLLM_NOTES.md), larger shapes blow the 3-minute
budget on a shared 2-core machine, and bf16 matmuls are slower than fp32 on this CPU.
`--gpu`: the `qwen2-0.5b-shape` preset in bf16 on CUDA (decode through CUDA graphs unless
`--no-cuda-graphs`). Ends by printing one JSON line of headline figures.

Constrained decoding (`tok_s_c32_json_schema`): the same c=32 queue, each request's output
constrained to a JSON schema (a list of 4-16 small objects: `CONSTRAINED_SCHEMA`), so every row
of every step pays its grammar's bitmask and the batch samples on the host. A constrained
output ends when its JSON does (or at max_tokens): tok/s counts the tokens generated. The
unconstrained figures above are measured without any constrained request in the engine.

    .venv/bin/python bench/engine_throughput.py [--gpu] [--model NAME] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlix.inference.engine.api import OutputConstraint, SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner.profile import gpu_breakdown

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench, log  # noqa: E402


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))],
                    rng.randint(32, 128)) for _ in range(n)]


#: the constrained run's schema: enough structure that each output runs for tens of tokens
CONSTRAINED_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 4, "maxItems": 16, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "kind": {"enum": ["alpha", "beta", "gamma"]},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "kind", "ok"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


async def engine_run(engine: TorchEngine, requests: list[Request], concurrency: int,
                     stream: bool = False, constraint: OutputConstraint | None = None) -> float:
    """Generated tokens per second with at most `concurrency` requests in flight (each output
    constrained to `constraint` when given: it then ends where its grammar does)."""
    gate = asyncio.Semaphore(concurrency)
    generated = 0

    async def one(i: int, req: Request) -> None:
        nonlocal generated
        params = SamplingParams(max_tokens=req.max_tokens, temperature=1.0, seed=i,
                                ignore_eos=True, constraint=constraint)
        async with gate:
            last = None
            async for last in engine.generate(f"bench-{concurrency}-{i}", req.prompt, params,
                                              final_only=not stream):
                pass
            assert last is not None and (len(last.token_ids) == req.max_tokens or constraint is not None)
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


def kv_bytes_per_token(model) -> int:  # type: ignore[no-untyped-def]
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def decode_steps_at(engine: TorchEngine, batch: int) -> tuple[float, float] | None:
    """(median ms, median live KV tokens) of the decode-only steps at `batch` rows."""
    steps = [(s, live) for s, b, prefilled, live in engine.profile.steps
             if b == batch and not prefilled]
    if not steps:
        return None
    steps.sort()
    seconds, live = steps[len(steps) // 2]
    return seconds * 1000, live


def gpu_extras(engine: TorchEngine, model, profiles: dict) -> dict:  # type: ignore[no-untyped-def]
    """Bandwidth bound, compiled transformers baseline and GPU breakdown (see docstring)."""
    from benchlib.gpu_bounds import compiled_static_decode, memory_bandwidth

    device = engine.device
    out: dict = {"profile_c32": profiles.get(32), "profile_c256": profiles.get(256)}
    try:
        bw = memory_bandwidth(device)
    except Exception as exc:
        log(f"bandwidth failed: {exc!r}")
        bw = {"copy_GBps": 0.0, "read_GBps": 0.0}
    out["bandwidth"] = bw
    gbps = max(bw["copy_GBps"], bw["read_GBps"]) or float("nan")
    step = profiles.get("decode_step_c32")
    if step is not None:
        ms, live = step
        bound_bytes = engine.weight_bytes() + live * kv_bytes_per_token(model)
        bound_ms = bound_bytes / (gbps * 1e9) * 1000
        out.update(decode_step_ms_c32=round(ms, 4), decode_live_tokens_c32=live,
                   decode_bound_ms_c32=round(bound_ms, 4),
                   decode_step_vs_bound_c32=round(ms / bound_ms, 2))
    log(json.dumps(out))  # what is known so far, should the rest fail
    try:
        out["gpu_breakdown_c32"] = gpu_breakdown(engine._core.runner, 32, 256)
    except Exception as exc:  # a figure missing, not the run lost
        out["gpu_breakdown_c32"] = f"failed: {exc!r}"[:300]
    for c in (32, 256):
        try:
            out[f"compiled_static_c{c}"] = compiled_static_decode(model, c)
        except Exception as exc:
            out[f"compiled_static_c{c}"] = f"failed: {exc!r}"[:300]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="qwen2-0.5b-shape on CUDA, bf16")
    parser.add_argument("--model", help="preset or checkpoint (default: small, or the 0.5B shape)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads on CPU (default 1: steadiest on shared cores)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="decode eagerly on CUDA (to see what the graphs are worth)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="read each decode step before launching the next (to see what overlap is worth)")
    parser.add_argument("--no-fused", action="store_true",
                        help="run transformers' modules instead of the fused decoder")
    parser.add_argument("--no-baselines", action="store_true",
                        help="engine figures only (skip generate and the compiled baseline)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if args.gpu else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    model_name = args.model or ("qwen2-0.5b-shape" if args.gpu else "small")
    dtype = "bfloat16" if args.gpu else "float32"
    # Request counts per concurrency: one-at-a-time is the slow path, so it gets fewer requests.
    counts = {1: 4, 8: 32, 32: 128, 256: 768} if args.gpu else {1: 6, 8: 16, 32: 64}
    static_batches = 2 if args.gpu else None  # generate's static batches: only the first two

    with Bench("engine_throughput", total=len(counts) + 2) as bench:
        bench.phase(f"loading {model_name}")
        headline = _measure(args, bench, device, model_name, dtype, counts, static_batches)
        bench.advance()
    print(json.dumps(headline))


def _measure(args, bench, device, model_name, dtype, counts, static_batches) -> dict:  # type: ignore[no-untyped-def]
    """The runs, one round per concurrency, then the streamed run and the bounds."""
    engine = TorchEngine.from_pretrained(model_name, device=device, dtype=dtype,
                                         max_num_seqs=max(counts), max_model_len=512,
                                         cuda_graphs=not args.no_cuda_graphs,
                                         fused=False if args.no_fused else None,
                                         overlap_steps=False if args.no_overlap else None)
    model = engine.model  # the same weights serve the baselines
    pad_id = engine.tokenizer.pad_token_id or 0
    vocab = engine.vocab_size
    capture_s = 0.0
    if device.type == "cuda" and not args.no_cuda_graphs:
        started = time.perf_counter()  # as a server would at start, not inside the timed runs
        bench.phase("capturing CUDA graphs")
        asyncio.run(engine.capture_graphs())
        capture_s = time.perf_counter() - started

    bench.phase("warming up")
    warm = make_requests(64, vocab, seed=999)
    asyncio.run(engine_run(engine, warm, 64))
    asyncio.run(engine_run(engine, warm[:4], 4))
    if not args.no_baselines:
        baseline_run(model, warm[:2], 2, pad_id, device)

    rows = []
    profiles: dict = {}
    one_at_a_time = None
    bench.advance()
    for c, n in counts.items():
        bench.phase(f"{n} requests at concurrency {c}")
        requests = make_requests(n, vocab, seed=args.seed + c)
        engine.profile.reset()
        if c == 1:
            # Alternate the two per request, so load drifting on a shared machine hits both alike.
            eng_time = base_time = 0.0
            for req in requests:
                eng_time += req.max_tokens / asyncio.run(engine_run(engine, [req], 1))
                if not args.no_baselines:
                    base_time += req.max_tokens / baseline_run(model, [req], 1, pad_id, device)
            tokens = sum(r.max_tokens for r in requests)
            eng = tokens / eng_time
            static = tokens / base_time if base_time else float("nan")
            one_at_a_time = static
        else:
            overlapped = engine.overlapped_steps
            eng = asyncio.run(engine_run(engine, requests, c))
            if c in (32, 256):
                profiles[c] = engine.profile.summary()
                profiles[c]["overlapped_steps"] = engine.overlapped_steps - overlapped
                if c == 32:
                    profiles["decode_step_c32"] = decode_steps_at(engine, 32)
            if args.no_baselines or c > 32:
                static = float("nan")
            else:
                subset = requests[: static_batches * c] if static_batches else requests
                static = baseline_run(model, subset, c, pad_id, device)
        assert one_at_a_time is not None
        rows.append((c, n, eng, static))
        bench.log(f"c={c:>3} ({n:>3} requests): engine {eng:8.1f} tok/s | generate static batch "
                  f"of {c}: {static:8.1f} tok/s | engine / static {eng / static:5.2f}x | "
                  f"engine / one-at-a-time {eng / one_at_a_time:5.2f}x")
        bench.advance()
    bench.phase("streamed run at concurrency 32, then the bounds")
    streamed = asyncio.run(engine_run(engine, make_requests(128, vocab, seed=args.seed + 33), 32,
                                      stream=True))
    bench.log(f"c= 32 streamed: engine {streamed:8.1f} tok/s")
    schema = OutputConstraint("json", json.dumps(CONSTRAINED_SCHEMA))
    asyncio.run(engine_run(engine, warm[:4], 4, constraint=schema))  # compiles it, loads xgrammar
    constrained = asyncio.run(engine_run(engine, make_requests(counts[32], vocab, seed=args.seed + 32),
                                         32, constraint=schema))
    bench.log(f"c= 32 json_schema: engine {constrained:8.1f} tok/s (unconstrained {by_c_32(rows):8.1f})")
    extras = {}
    if args.gpu:
        extras = gpu_extras(engine, model, profiles) if not args.no_baselines else {
            "profile_c32": profiles.get(32), "profile_c256": profiles.get(256)}
    else:
        extras = {"profile_c32": profiles.get(32)}
    engine.close()

    def r1(x: float) -> float | None:
        return None if x != x else round(x, 1)

    by_c = {c: (eng, static) for c, _, eng, static in rows}
    headline = {
        "bench": "engine_throughput",
        "model": model_name,
        "device": torch.cuda.get_device_name(device) if args.gpu else platform.processor() or "cpu",
        "dtype": dtype,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "cuda_graphs": device.type == "cuda" and not args.no_cuda_graphs,
        "fused": not args.no_fused,
        "overlap": not args.no_overlap,
        "graph_capture_s": round(capture_s, 2),
        "tok_s_c1": r1(by_c[1][0]),
        "tok_s_c8": r1(by_c[8][0]),
        "tok_s_c32": r1(by_c[32][0]),
        "tok_s_c256": r1(by_c[256][0]) if 256 in by_c else None,
        "tok_s_c32_streamed": r1(streamed),
        "tok_s_c32_json_schema": r1(constrained),
        "one_at_a_time_tok_s": r1(one_at_a_time or float("nan")),
        "static_batch_tok_s_c8": r1(by_c[8][1]),
        "static_batch_tok_s_c32": r1(by_c[32][1]),
        "speedup_vs_sequential_at_32": r1(by_c[32][0] / (one_at_a_time or float("nan"))),
        "speedup_vs_static_batch_at_32": r1(by_c[32][0] / by_c[32][1]),
        # decode steps launched before the one before them was read (host work overlapped)
        "overlapped_share_c32": round(profiles[32]["overlapped_steps"] / max(1, profiles[32]["steps"]), 3),
    }
    for c in (32, 256):
        compiled = extras.get(f"compiled_static_c{c}")
        if isinstance(compiled, dict) and c in by_c:
            headline[f"compiled_static_tok_s_c{c}"] = compiled["tok_s"]
            headline[f"engine_vs_compiled_static_c{c}"] = round(by_c[c][0] / compiled["tok_s"], 2)
    for key in ("decode_step_ms_c32", "decode_bound_ms_c32", "decode_step_vs_bound_c32"):
        if key in extras:
            headline[key] = extras[key]
    headline.update({k: v for k, v in extras.items() if k not in headline})
    return headline


def by_c_32(rows: list[tuple[int, int, float, float]]) -> float:
    return next(eng for c, _, eng, _ in rows if c == 32)


if __name__ == "__main__":
    main()
