"""Engine sleep / wake time against the host<->device copy bound, measured in the same run.

Level 1 moves the weights to (pinned) host memory and frees the KV cache; wake_up brings them
back. The bound is the time to copy the same bytes at the bandwidth measured here with one
large pinned copy each way (GPU), so `*_vs_bound` = bound time / measured time (1.0 = at the
bound). On CPU there is no copy to bound against: the script reports the times and the memory
really freed (RSS) for levels 1 and 2.

On GPU the weights first come back once through a level-2 reload into the sender's bucket
layout (the shard's real path; with virtual memory, runner/vmm.py, that store keeps its device
addresses across sleeps), so the level-1 rounds run the way a shard's do. Each round also
reports what the wake costs later: the CUDA graphs the first generation after it captures
(`graph_captures_after_wake`: 0 when the sleep kept them) and its first step (prefill and the
first decode launch, where captures land) and first decode-only step against the same steps of
the generation right before the sleep. `--no-vmm` measures the path without virtual memory.

    .venv/bin/python bench/sleep_wake.py            # CPU, preset `small`
    python bench/sleep_wake.py --gpu                # CUDA, preset qwen2-0.5b-shape, bf16
    python bench/sleep_wake.py --gpu --no-vmm       # the same, graphs dropped by every sleep
Ends by printing one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync
from rlix.weights.buckets import named_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402


def copy_bandwidth(nbytes: int, device: torch.device) -> tuple[float, float]:
    """(host->device, device->host) bytes/s for one pinned copy of nbytes, best of 3."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = d2h = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d = min(h2d, time.perf_counter() - t0)
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h = min(d2h, time.perf_counter() - t0)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / h2d, nbytes / d2h


async def reload_into_layout(engine: TorchEngine) -> None:
    """A level-2 sleep and the reload a shard gets: the weights land in the sender's layout."""
    state = {n: t.detach().cpu() for n, t in named_weights(engine.model).items()}
    with BucketCache.for_model(state) as cache:
        cache.build_latest(1, state)
        await engine.sleep(2)
        await engine.wake_up(["weights"])
        sync = WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(engine, device=engine.device))}, "shm")
        report = await sync.sync(1, [0])
        assert not report.failed, report
        await engine.wake_up(["kv_cache"])


def first_steps_ms(engine: TorchEngine) -> tuple[float, float]:
    """(first step, first decode-only step) of the generation just run, in ms."""
    steps = list(engine.profile.steps)
    first = steps[0][0] if steps else 0.0
    decode = next((s[0] for s in steps if not s[2]), 0.0)
    return round(first * 1000, 3), round(decode * 1000, 3)


async def measure(engine: TorchEngine, rounds: int, bench: Bench) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 37))
    cuda = engine.model.device.type == "cuda"

    async def generate() -> list[int]:
        engine.profile.reset()
        last = None
        async for out in engine.generate(f"r{time.perf_counter_ns()}", prompt, params):
            last = out
        return last.token_ids

    if cuda:
        bench.phase("level-2 reload into the sender's layout")
        await reload_into_layout(engine)
    before = await generate()
    await generate()  # every graph this request needs is captured now
    sleeps, wakes, freed, captures_after, kept, resident = [], [], [], [], [], []
    steps_before, steps_after = [], []
    for i in range(rounds):
        bench.phase(f"round {i + 1}: sleep level 1, wake")
        await generate()
        steps_before.append(first_steps_ms(engine))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        await engine.sleep(1)
        sleeps.append(time.perf_counter() - t0)
        freed.append(engine.last_sleep_freed_bytes)
        report = engine.sleep_report()
        kept.append(report["graphs_kept"])
        resident.append(report["resident_bytes"])
        captures = report["graph_captures"]
        t0 = time.perf_counter()
        await engine.wake_up()
        if cuda:
            torch.cuda.synchronize()
        wakes.append(time.perf_counter() - t0)
        await generate()
        steps_after.append(first_steps_ms(engine))
        captures_after.append(engine.sleep_report()["graph_captures"] - captures)
        bench.advance()
    bench.phase("sleep level 2")
    same = await generate() == before
    t0 = time.perf_counter()
    await engine.sleep(2)
    sleep2 = time.perf_counter() - t0
    median = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    return {"sleep1_s": min(sleeps), "wake1_s": min(wakes), "freed_l1_bytes": max(freed),
            "sleep2_s": sleep2, "freed_l2_bytes": engine.last_sleep_freed_bytes,
            "same_output_after_wake": same,
            "virtual_memory": engine.sleep_report()["virtual_memory"],
            "graphs_kept": all(kept), "resident_bytes_asleep": max((r or 0) for r in resident),
            "graph_captures_after_wake": max(captures_after),
            "first_step_ms_before_sleep": median([s[0] for s in steps_before]),
            "first_step_ms_after_wake": median([s[0] for s in steps_after]),
            "first_decode_step_ms_before_sleep": median([s[1] for s in steps_before]),
            "first_decode_step_ms_after_wake": median([s[1] for s in steps_after])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-vmm", action="store_true", help="no virtual memory (graphs dropped by sleeps)")
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    model = args.model or ("qwen2-0.5b-shape" if args.gpu else "small")
    dtype = "bfloat16" if args.gpu else "float32"
    with Bench("sleep_wake", total=args.rounds) as bench:
        bench.phase(f"loading {model} on {device}")
        # GPU: no prefix cache, else the generation before a sleep would reuse its predecessor's
        # keys (an eager prefill of one token) where the one after the wake prefills the prompt
        extra = {"prefix_cache_bytes": 0} if args.gpu else {}
        engine = TorchEngine.from_pretrained(model, device=device, dtype=dtype, max_num_seqs=8,
                                             max_model_len=1024,
                                             virtual_memory=False if args.no_vmm else None, **extra)
        try:
            weight_bytes = engine.weight_bytes()
            result = asyncio.run(measure(engine, args.rounds, bench))
        finally:
            engine.close()
        if args.gpu:
            bench.phase("pinned copy bandwidth")
            h2d, d2h = copy_bandwidth(weight_bytes, device)
    headline = {"bench": "sleep_wake", "model": model, "device": str(device), "dtype": dtype,
                "weight_bytes": weight_bytes, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                 for k, v in result.items()}}
    if args.gpu:
        headline.update({
            "pinned_h2d_GBps": round(h2d / 1e9, 1), "pinned_d2h_GBps": round(d2h / 1e9, 1),
            "sleep1_vs_bound": round((weight_bytes / d2h) / result["sleep1_s"], 3),
            "wake1_vs_bound": round((weight_bytes / h2d) / result["wake1_s"], 3),
        })
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
