"""Engine sleep / wake time against the host<->device copy bound, measured in the same run.

Level 1 moves the weights to (pinned) host memory and frees the KV cache; wake_up brings them
back. The bound is the time to copy the same bytes at the bandwidth measured here with one
large pinned copy each way (GPU), so `*_vs_bound` = bound time / measured time (1.0 = at the
bound). On CPU there is no copy to bound against: the script reports the times and the memory
really freed (RSS) for levels 1 and 2.

    .venv/bin/python bench/sleep_wake.py            # CPU, preset `small`
    python bench/sleep_wake.py --gpu                # CUDA, preset qwen2-0.5b-shape, bf16
Ends by printing one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine

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


async def measure(engine: TorchEngine, rounds: int, bench: Bench) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 37))

    async def generate() -> list[int]:
        last = None
        async for out in engine.generate(f"r{time.perf_counter_ns()}", prompt, params):
            last = out
        return last.token_ids

    before = await generate()
    sleeps, wakes, freed = [], [], []
    for i in range(rounds):
        bench.phase(f"round {i + 1}: sleep level 1, wake")
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        await engine.sleep(1)
        sleeps.append(time.perf_counter() - t0)
        freed.append(engine.last_sleep_freed_bytes)
        t0 = time.perf_counter()
        await engine.wake_up()
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        wakes.append(time.perf_counter() - t0)
        bench.advance()
    bench.phase("sleep level 2")
    same = await generate() == before
    t0 = time.perf_counter()
    await engine.sleep(2)
    sleep2 = time.perf_counter() - t0
    return {"sleep1_s": min(sleeps), "wake1_s": min(wakes), "freed_l1_bytes": max(freed),
            "sleep2_s": sleep2, "freed_l2_bytes": engine.last_sleep_freed_bytes,
            "same_output_after_wake": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    model = args.model or ("qwen2-0.5b-shape" if args.gpu else "small")
    dtype = "bfloat16" if args.gpu else "float32"
    with Bench("sleep_wake", total=args.rounds) as bench:
        bench.phase(f"loading {model} on {device}")
        engine = TorchEngine.from_pretrained(model, device=device, dtype=dtype, max_num_seqs=8,
                                             max_model_len=1024)
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
