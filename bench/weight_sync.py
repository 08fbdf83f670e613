"""Weight sync against the bounds measured in the same run.

CPU (always):
  shm_sync_vs_memcpy   cache -> receiver PROCESS over shared memory, a ~1 GB bf16 model shaped
                       like a transformer, vs one plain copy of the same bytes (torch copy_,
                       best of N each); 1.0 = as fast as a memcpy. Goal >= 0.5.
  per_tensor_overhead  the same sync for 10,000 small tensors vs a few large ones of the same
                       total bytes: time(many) / time(few) - 1 (0.05 = 5% slower). Goal <= 0.05.
                       The receiver keeps its weights in the bucket layout (one copy per bucket);
                       per_tensor_overhead_copying_engine is the same with an engine that stages
                       tensor by tensor through update_weights, as engines commonly do.
--gpu adds (Qwen2-1.5B shapes, bf16; --vocab to shrink the 151,936 vocabulary):
  h2d_sync_vs_pinned_copy         pinned cache -> in-process shard on cuda:0 vs one pinned
                                  host->GPU copy of the same bytes. Goal >= 0.8.
  peak_extra_gpu_bytes_vs_bucket  GPU memory the sync adds at its peak, in buckets. Goal <= 2.
  nccl_sync_vs_broadcast          buckets on cuda:0 (the trainer's packed weights before it
                                  offloads) -> shard process on cuda:1 over a per-sync NCCL
                                  group, vs a raw NCCL broadcast of the same bytes (2 GPUs):
                                  what the transport and protocol cost. Group setup and
                                  teardown are reported apart.
  nccl_cache_sync_vs_h2d_bound    host cache (pinned) -> the same shard: staged to cuda:0 then
                                  broadcast, vs max(pinned H2D copy, raw broadcast); a cache in
                                  host memory cannot beat its own host->GPU copy.
The receiving engine (ModelEngine) stages each update into a second copy of its weights and
flips at finish, so the figures measure the sync (transfer, decode, staging copy), not an
engine's apply. All times are the best of --rounds warm syncs (the receiver has mapped the
cache's segment and allocated its staging); the first sync's time is reported apart.

    .venv/bin/python bench/weight_sync.py          # CPU, under 3 minutes on 2 cores
    python bench/weight_sync.py --gpu              # adds the GPU figures
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
import tempfile
import time
from datetime import timedelta

import torch

from rlix import env
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync, unpack

# the receiving side is test scaffolding (a minimal engine in a process of its own)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "weights"))
from model_engine import ModelEngine  # noqa: E402
from pipe_shard import PipeShard, write_spec  # noqa: E402

env.apply_nccl_defaults()  # this process and every process it starts


def transformer_specs(hidden: int, layers: int, inter: int, vocab: int, kv_dim: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Qwen2-like parameter shapes (tied embeddings), in checkpoint order."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((vocab, hidden), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm.weight", (hidden,)),
                            ("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.q_proj.bias", (hidden,)),
                            ("self_attn.k_proj.weight", (kv_dim, hidden)), ("self_attn.k_proj.bias", (kv_dim,)),
                            ("self_attn.v_proj.weight", (kv_dim, hidden)), ("self_attn.v_proj.bias", (kv_dim,)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("post_attention_layernorm.weight", (hidden,)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter))):
            out[p + name] = (shape, dtype)
    out["model.norm.weight"] = ((hidden,), dtype)
    return out


def nbytes(specs: dict) -> int:  # type: ignore[type-arg]
    total = 0
    for shape, dtype in specs.values():
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += n
    return total


def random_state(specs: dict, device: str = "cpu") -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    gen = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(shape, generator=gen, device=device).to(dtype) for n, (shape, dtype) in specs.items()}


def best(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_seconds(total: int, rounds: int) -> float:
    src = torch.empty(total, dtype=torch.uint8).fill_(1)
    dst = torch.empty(total, dtype=torch.uint8).fill_(0)
    t = best(lambda: dst.copy_(src), rounds)
    del src, dst
    return t


def shm_sync_seconds(state: dict[str, torch.Tensor], bucket: int, rounds: int, tmp: str,
                     adopt: bool = True) -> tuple[float, dict]:  # type: ignore[type-arg]
    """Best sync time of `state` from a shm cache into a receiver process (after a warm-up)."""
    spec = write_spec(os.path.join(tmp, "spec.json"), {n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    proc = PipeShard(spec, name="bench-shard", call_timeout=600, adopt_layouts=adopt)
    try:
        with BucketCache.for_model(state, bucket_bytes=bucket, host="shm") as cache:
            cache.build_latest(1, state)
            sync = WeightSync(cache, {0: proc.endpoint}, "shm")
            first = asyncio.run(sync.sync(1, [0]))  # maps the segment, allocates the staging
            times = [asyncio.run(sync.sync(1, [0])).seconds for _ in range(rounds)]
            info = {"buckets": cache.layout.num_buckets, "tensors": len(cache.layout.entries),
                    "first_sync_s": round(first.seconds + first.setup_seconds, 4)}
        return min(times), info
    finally:
        proc.close()


def cpu_figures(args: argparse.Namespace, tmp: str) -> dict:  # type: ignore[type-arg]
    specs = transformer_specs(2048, 9, 5632, 32000, 2048)
    state = random_state(specs)
    total = nbytes(specs)
    t_copy = memcpy_seconds(total, args.rounds)
    t_sync, info = shm_sync_seconds(state, args.bucket_mib << 20, args.rounds, tmp)
    del state
    gc.collect()
    # per-tensor overhead: 10,000 small tensors vs 8 big ones, same bytes, same path
    n_small, per = 10_000, args.small_kib * 1024 // 2
    many = {f"layers.{i}.weight": torch.randn(per).bfloat16() for i in range(n_small)}
    few = {f"block.{i}.weight": torch.randn(n_small * per // 8).bfloat16() for i in range(8)}
    bucket = args.bucket_mib << 20
    t_many, _ = shm_sync_seconds(many, bucket, args.rounds, tmp)
    t_few, _ = shm_sync_seconds(few, bucket, args.rounds, tmp)
    # the same with a receiving engine that stages tensor by tensor (as engines that do not keep
    # their weights in bucket layout do): what per-tensor work costs on this machine
    t_many_c, _ = shm_sync_seconds(many, bucket, args.rounds, tmp, adopt=False)
    t_few_c, _ = shm_sync_seconds(few, bucket, args.rounds, tmp, adopt=False)
    return {
        "shm_sync_vs_memcpy": round(t_copy / t_sync, 3),
        "per_tensor_overhead": round(t_many / t_few - 1, 3),
        "per_tensor_overhead_copying_engine": round(t_many_c / t_few_c - 1, 3),
        "many_tensors_copying_sync_s": round(t_many_c, 4), "few_tensors_copying_sync_s": round(t_few_c, 4),
        "cpu_model_bytes": total, "cpu_sync_s": round(t_sync, 4), "memcpy_s": round(t_copy, 4),
        "cpu_sync_gbps": round(total / t_sync / 1e9, 2), "cpu_buckets": info["buckets"],
        "cpu_tensors": info["tensors"], "cpu_first_sync_s": info["first_sync_s"],
        "small_tensors": n_small, "small_model_bytes": n_small * per * 2,
        "many_tensors_sync_s": round(t_many, 4), "few_tensors_sync_s": round(t_few, 4),
    }


def h2d_seconds(total: int, rounds: int) -> float:
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda:0")

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    t = best(copy, rounds)
    del host, dev
    torch.cuda.empty_cache()
    return t


def gpu_local(cache: BucketCache, specs: dict, rounds: int) -> tuple[float, float]:  # type: ignore[type-arg]
    """(best sync seconds, peak extra bytes) cache -> in-process shard on cuda:0."""
    engine = ModelEngine({n: torch.zeros(s, dtype=d, device="cuda:0") for n, (s, d) in specs.items()})
    sync = WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(engine, "cuda:0"))}, "local",
                      transport_options={"device": "cuda:0"})
    asyncio.run(sync.sync(1, [0]))  # warm-up: engine staging allocated once
    times, peaks = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        times.append(asyncio.run(sync.sync(1, [0])).seconds)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(0) - base)
    want = unpack(cache.layout, cache.buckets(1))
    for name in (next(iter(specs)), "model.norm.weight"):  # spot check: bit-identical
        if not torch.equal(engine.served()[name].cpu(), want[name]):
            raise SystemExit(f"GPU sync delivered wrong bytes for {name}")
    del engine, sync, want
    gc.collect()
    torch.cuda.empty_cache()
    return min(times), max(peaks)


def raw_broadcast_seconds(total: int, rounds: int) -> float:
    """Rank 0 here on cuda:0, rank 1 a helper process on cuda:1: broadcast `total` GPU bytes."""
    from rlix.weights.transport import nccl as nccl_mod

    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=120),
                                       wait_for_workers=False)
    helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "bcast-peer",
                               "--port", str(store.port), "--bytes", str(total), "--rounds", str(rounds)],
                              env=env.nccl_child_env())
    try:
        torch.cuda.set_device(0)
        group = nccl_mod._make_group("nccl", torch.distributed.PrefixStore("raw", store), 0, 2, 120)
        buf = torch.empty(total, dtype=torch.uint8, device="cuda:0")
        nccl_mod._warm_up(group, torch.device("cuda:0"))

        def once() -> None:
            nccl_mod._broadcast(group, buf).wait()
            torch.cuda.synchronize()
        t = best(once, rounds)
        nccl_mod._destroy(group)
        del buf
        torch.cuda.empty_cache()
        helper.wait(120)
        return t
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()


def bcast_peer(args: argparse.Namespace) -> None:
    from rlix.weights.transport import nccl as nccl_mod

    torch.cuda.set_device(1)
    store = torch.distributed.TCPStore("127.0.0.1", args.port, 2, is_master=False, timeout=timedelta(seconds=120))
    group = nccl_mod._make_group("nccl", torch.distributed.PrefixStore("raw", store), 1, 2, 120)
    buf = torch.empty(args.bytes, dtype=torch.uint8, device="cuda:1")
    nccl_mod._warm_up(group, torch.device("cuda:1"))
    for _ in range(args.rounds):
        nccl_mod._broadcast(group, buf).wait()
        torch.cuda.synchronize()
    nccl_mod._destroy(group)


class DeviceBuckets:
    """The cache's buckets copied onto a GPU, offered to WeightSync like a cache."""

    def __init__(self, cache: BucketCache, version: int, device: str) -> None:
        self.layout = cache.layout
        self.shm_segments = None
        self._buckets = [b.to(device) for b in cache.buckets(version)]

    @contextlib.contextmanager
    def lease(self, version: int):  # type: ignore[no-untyped-def]
        yield self._buckets


def nccl_syncs(source, proc: PipeShard, rounds: int) -> tuple[list, int]:  # type: ignore[no-untyped-def]
    """Warm syncs' reports, and the receiver's peak extra GPU bytes over them."""
    sync = WeightSync(source, {0: proc.endpoint}, "nccl", transport_options={"device": "cuda:0"})
    asyncio.run(sync.sync(1, [0]))  # warm-up: layout adopted, staging allocated
    proc.call("cuda_memory", reset=True)
    base = proc.call("cuda_memory")[0]
    reports = [asyncio.run(sync.sync(1, [0])) for _ in range(rounds)]
    return reports, proc.call("cuda_memory")[1] - base


def gpu_figures(args: argparse.Namespace, tmp: str) -> dict:  # type: ignore[type-arg]
    specs = transformer_specs(1536, 28, 8960, args.vocab, 256)
    total, bucket = nbytes(specs), args.gpu_bucket_mib << 20
    state = random_state(specs, "cuda:0")  # the trainer's weights, on its GPU
    cache = BucketCache.for_model(state, bucket_bytes=bucket, host="pinned")
    cache.build_latest(1, state)
    del state
    torch.cuda.empty_cache()
    out: dict = {"gpu_model_bytes": total, "gpu_params": total // 2, "gpu_bucket_bytes": bucket,
                 "gpu_buckets": cache.layout.num_buckets, "vocab": args.vocab}
    t_h2d = h2d_seconds(total, args.rounds)
    t_sync, peak = gpu_local(cache, specs, args.rounds)
    out.update(h2d_sync_vs_pinned_copy=round(t_h2d / t_sync, 3),
               peak_extra_gpu_bytes_vs_bucket=round(peak / bucket, 3), h2d_copy_s=round(t_h2d, 4),
               h2d_sync_s=round(t_sync, 4), h2d_gbps=round(total / t_h2d / 1e9, 1),
               h2d_sync_gbps=round(total / t_sync / 1e9, 1))
    print(f"h2d: {json.dumps(out)}", file=sys.stderr, flush=True)
    if torch.cuda.device_count() >= 2:
        t_bcast = raw_broadcast_seconds(total, args.rounds)
        spec = write_spec(os.path.join(tmp, "gpu_spec.json"), specs)
        proc = PipeShard(spec, device="cuda:1", name="nccl-shard", call_timeout=600)
        try:
            from_cache, peak_cache = nccl_syncs(cache, proc, args.rounds)
            on_gpu = DeviceBuckets(cache, 1, "cuda:0")
            from_gpu, peak_gpu = nccl_syncs(on_gpu, proc, args.rounds)
            recv_peak = max(peak_cache, peak_gpu)
            del on_gpu
            torch.cuda.empty_cache()
        finally:
            proc.close()
        t_nccl = min(r.seconds for r in from_gpu)
        t_cache = min(r.seconds for r in from_cache)
        out.update(nccl_sync_vs_broadcast=round(t_bcast / t_nccl, 3),
                   nccl_cache_sync_vs_h2d_bound=round(max(t_bcast, t_h2d) / t_cache, 3),
                   nccl_sync_s=round(t_nccl, 4), nccl_cache_sync_s=round(t_cache, 4),
                   nccl_broadcast_s=round(t_bcast, 4),
                   nccl_group_setup_s=round(min(r.setup_seconds for r in from_gpu), 3),
                   nccl_sender_teardown_s=round(min(r.teardown_seconds for r in from_gpu), 3),
                   nccl_receiver_peak_extra_vs_bucket=round(recv_peak / bucket, 3))
    else:
        out["nccl_sync_vs_broadcast"] = None
        out["nccl_note"] = "needs 2 GPUs"
    cache.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--gpu-bucket-mib", type=int, default=256)
    p.add_argument("--small-kib", type=int, default=100, help="size of each of the 10,000 small tensors")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "bcast-peer":
        bcast_peer(args)
        return
    t0 = time.perf_counter()
    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="rlix-bench-") as tmp:
        if not args.skip_cpu:
            figures.update(cpu_figures(args, tmp))
        if args.gpu:
            figures.update(gpu_figures(args, tmp))
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    for k, v in figures.items():
        print(f"{k:34s} {v}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
