"""The sync of a shard asleep beside the trainer, in isolation, against its bounds (one GPU).

A PolicyTrainer on cuda:0 (the model of --model, 0.5B shape by default) packs each version on
its GPU (DeviceCopy) and fills its host cache from it; an engine server process on the same GPU,
put to sleep at level 2 before each round, is synced in one /sync_weights call by CUDA IPC
waking its weights only (what the pipeline does before the trainer offloads). Per round: the
sender-timed call, the server's own phases (wake, start, buckets, finish; buckets split into
receive, unpack, stage, wait) and the trainer's device-copy build. Bounds measured in the same
run: one device-to-device copy of the same bytes, allocating them (what a shard woken from a
level-2 sleep must do first) in one piece and in 11, a pinned host-to-device copy of them (the
path from the host cache), and with two GPUs an NCCL broadcast of them (issue 21's gate 3
bound). Medians over --rounds after one warm-up round.

    python3 bench/refit_beside.py [--model qwen2-0.5b-shape] [--rounds 8] [--bucket-mb 64]
Ends by printing one JSON line of the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import best, h2d_seconds, raw_broadcast_seconds  # noqa: E402

from rlix.inference.fleet.backends import EmbeddedBackend, EngineBackendConfig  # noqa: E402
from rlix.inference.fleet.shard_process import ShardProcess  # noqa: E402
from rlix.models.presets import resolve_model  # noqa: E402
from rlix.training.trainer import PolicyTrainer  # noqa: E402
from rlix.weights.api import ShardTarget  # noqa: E402
from rlix.weights.refit import WeightPath  # noqa: E402

KEY = "refit-bench"


def d2d_seconds(total: int, rounds: int) -> float:
    src = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()
    t = best(copy, rounds)
    del src, dst
    torch.cuda.empty_cache()
    return t


def alloc_seconds(total: int, pieces: int, rounds: int) -> float:
    """Allocating `total` bytes in `pieces` on a GPU the caching allocator gave back (as after
    a level-2 sleep): each piece a fresh cudaMalloc."""
    def alloc() -> None:
        held = [torch.empty(total // pieces, dtype=torch.uint8, device="cuda:0") for _ in range(pieces)]
        torch.cuda.synchronize()
        del held

    def timed() -> float:
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        alloc()
        return time.perf_counter() - t0
    return min(timed() for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-0.5b-shape")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=64, help="the trainer's bucket size (the pipeline's default: 64)")
    args = ap.parse_args()
    path = resolve_model(args.model)
    trainer = PolicyTrainer(str(path), device="cuda:0", dtype="bfloat16", cache_bucket_bytes=args.bucket_mb << 20)
    shard = ShardProcess(EmbeddedBackend(EngineBackendConfig(
        backend="embedded", model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8,
        max_model_len=256)), KEY)

    class Here:  # the trainer's side of the weight path, in this process
        async def publish(self, version, audit=False, on_device=False):  # noqa: ANN001, ANN202
            return trainer.publish(version, on_device)

    loop = asyncio.new_event_loop()
    weights = WeightPath(Here(), api_key=KEY)
    http = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    rows = []
    try:
        shard.start()
        shard.wait_ready()
        for version in range(1, args.rounds + 2):
            http.post(f"{shard.url}/sleep", params={"level": 2}).raise_for_status()
            t0 = time.perf_counter()
            loop.run_until_complete(weights.publish(version, on_device=True))
            built = time.perf_counter() - t0
            t0 = time.perf_counter()
            report = loop.run_until_complete(weights.refit(version, {0: ShardTarget(shard.url, beside=trainer.rank)},
                                                           wake=[0]))
            wall = time.perf_counter() - t0
            status = http.get(f"{shard.url}/weight_transfer_status").json()
            assert report.reported == {0: version} and report.route == "device", report
            rows.append({"call_ms": 1000 * report.seconds, "setup_ms": 1000 * report.setup_seconds,
                         "wall_ms": 1000 * wall, "build_ms": 1000 * built,
                         **{f"server_{k}_ms": v for k, v in status["last_sync_ms"].items()},
                         **{f"bucket_{k}_ms": v for k, v in status["last_buckets_ms"].items()}})
            trainer.device_copy.free()  # as the offload does: a new allocation every version
        total = trainer.cache.layout.total_bytes
        buckets = trainer.cache.layout.num_buckets
    finally:
        loop.run_until_complete(weights.close())
        loop.close()
        http.close()
        shard.stop()
    warm = rows[1:]
    med = {k: round(statistics.median(r[k] for r in warm), 3) for k in warm[0]}
    d2d = 1000 * d2d_seconds(total, 5)
    h2d = 1000 * h2d_seconds(total, 5)
    fig = {"refit_bytes": total, "refit_buckets": buckets, **{f"refit_{k}": v for k, v in med.items()},
           "refit_first_call_ms": round(rows[0]["call_ms"], 3),
           "d2d_copy_ms": round(d2d, 3), "h2d_copy_ms": round(h2d, 3),
           "alloc_1_ms": round(1000 * alloc_seconds(total, 1, 5), 3),
           "alloc_11_ms": round(1000 * alloc_seconds(total, 11, 5), 3),
           "refit_call_vs_d2d": round(d2d / med["call_ms"], 3),
           "refit_call_vs_h2d": round(h2d / med["call_ms"], 3)}
    if torch.cuda.device_count() >= 2:
        bcast = 1000 * raw_broadcast_seconds(total, 5)
        fig["broadcast_ms"] = round(bcast, 3)
        fig["refit_call_vs_broadcast"] = round(bcast / med["call_ms"], 3)
    fig["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
