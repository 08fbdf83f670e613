"""FSDP2 trainer ranks (training/fsdp.py) through the time-sharing cycle, whole runs per rank:
build, then per step reload, train, publish (every rank's rows into rank 0's cache), offload.

What a pipeline with `train.fsdp: true` pays per step, and the bounds it is measured against in
the same run, on the same GPUs:

  build_s              building a rank (its rows read or drawn, nothing whole), rank 0's
  step_s               median train_step (the model wrapped over the step's group, forward,
                       backward, AdamW on the shards), rank 0's
  tokens_per_s         response tokens trained per second of step_s (all ranks' batches)
  publish_s            median publish of a version (open on rank 0, every rank writes, close)
  offload_s, reload_s  median offload and reload of a rank's shards and AdamW state
  h2d_s                copying the same bytes from page-locked host memory to the GPU once
  fsdp_reload_vs_h2d   h2d_s / reload_s (goal >= 0.6, issue 37)
  state_gib            a rank's state between steps (shards + moments), the most of any rank
  peak_gib             the most GPU memory a rank allocated during a step (CUDA only)

    python3 bench/fsdp_step.py [--model qwen2.5-7b-shape] [--ranks 4] [--device cuda]
                               [--samples 64] [--response 512] [--steps 3]
(`--device cpu --model tiny --ranks 2` checks the script itself.) Ends by printing one JSON
line of the figures.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlix.httpkit import free_port
from rlix.training.fsdp import ShardedPolicyTrainer
from rlix.training.types import GroupSpec, TrainSample


def samples(n: int, prompt: int, response: int, vocab: int, seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    return [TrainSample([rng.randrange(1, vocab) for _ in range(prompt)],
                        [rng.randrange(1, vocab) for _ in range(response)],
                        [-2.0] * response, rng.uniform(-1, 1), 0) for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_main(rank: int, args: argparse.Namespace, ports: list[int], out: str) -> None:
    world = args.ranks
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=timedelta(seconds=600))
    t0 = time.perf_counter()
    trainer = ShardedPolicyTrainer(args.model, rank=rank, world_size=world, device=str(device),
                                   micro_batch_size=args.micro, offloaded=device.type == "cuda",
                                   activation_checkpointing=args.activation_checkpointing)
    build_s = time.perf_counter() - t0
    batch = samples(args.samples, args.prompt, args.response, trainer.vocab_size, seed=rank)
    figures: dict[str, list[float]] = {"step_s": [], "publish_s": [], "offload_s": [], "reload_s": []}
    peak = 0
    for step in range(args.steps + 1):  # the first step is not timed (allocator and kernels warm)
        t = time.perf_counter()
        trainer.reload()
        sync(device)
        reload_s = time.perf_counter() - t
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        trainer.train_step(batch, GroupSpec("127.0.0.1", ports[1 + step], rank, world, timeout_s=600))
        sync(device)
        step_s = time.perf_counter() - t
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        t = time.perf_counter()
        if rank == 0:
            store.set(f"refs{step}", pickle.dumps(trainer.open_version(step)))
        trainer.write_shard(pickle.loads(store.get(f"refs{step}")))
        store.add(f"written{step}", 1)
        if rank == 0:
            while int(store.add(f"written{step}", 0)) < world:
                time.sleep(0.001)
            trainer.close_version(step)
        publish_s = time.perf_counter() - t
        t = time.perf_counter()
        trainer.offload()
        offload_s = time.perf_counter() - t
        if step:
            for key, value in (("step_s", step_s), ("publish_s", publish_s), ("offload_s", offload_s),
                               ("reload_s", reload_s)):
                figures[key].append(value)
    state = trainer.state_bytes()
    h2d_s = 0.0
    if device.type == "cuda":  # the bound: the same bytes, page-locked host to this GPU, once
        host = torch.empty(state, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(state, dtype=torch.uint8, device=device)
        for _ in range(2):
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            sync(device)
            h2d_s = time.perf_counter() - t
        del host, dev
    tokens = args.samples * args.response * world
    result = {"rank": rank, "build_s": build_s, "state_bytes": state, "peak_bytes": peak, "h2d_s": h2d_s,
              "tokens": tokens, **{k: statistics.median(v) for k, v in figures.items()}}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0 and trainer.cache is not None:
        trainer.cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b-shape")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--samples", type=int, default=64, help="samples per rank and step")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=2,
                    help="samples per forward (default 2: 8 of 640 tokens at the 7.6B shape took 135 GiB "
                         "of an H200 without activation checkpointing)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--activation-checkpointing", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"fsdp_step: {args.ranks} ranks need {args.ranks} GPUs; this machine has {torch.cuda.device_count()}")
    ports = [free_port() for _ in range(args.steps + 2)]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(args, ports, out), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    first = ranks[0]
    reload_s = max(r["reload_s"] for r in ranks)
    figures = {
        "model": args.model, "ranks": args.ranks, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "build_s": round(first["build_s"], 2), "step_s": round(first["step_s"], 3),
        "tokens_per_s": round(first["tokens"] / first["step_s"], 1),
        "publish_s": round(first["publish_s"], 3),
        "offload_s": round(max(r["offload_s"] for r in ranks), 3), "reload_s": round(reload_s, 3),
        "h2d_s": round(max(r["h2d_s"] for r in ranks), 3),
        "fsdp_reload_vs_h2d": round(max(r["h2d_s"] for r in ranks) / reload_s, 3) if reload_s else None,
        "state_gib": round(max(r["state_bytes"] for r in ranks) / 2**30, 2),
        "peak_gib": round(max(r["peak_bytes"] for r in ranks) / 2**30, 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
