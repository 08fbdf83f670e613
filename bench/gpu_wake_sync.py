"""Wake from a level-2 sleep and sync, in one call, against the pinned host->GPU copy bound.

The real path: an embedded engine server process on CUDA (ShardProcess + EmbeddedBackend) is
put to sleep at level 2 (`POST /sleep?level=2`: weights and KV cache dropped), then woken and
synced from the weight cache in ONE `/sync_weights` call by `WeightPath.refit(version,
{0: url}, wake=[0])`. The cache is a BucketCache built here, as a trainer builds it, from the
model's bf16 state dict on the GPU (host memory "auto": page-locked shared memory on CUDA).

    wake_sync_vs_h2d = h2d_bound_s / wake_sync_s     (1.0 = at the bound; goal >= 0.7)

h2d_bound_s is one host->GPU copy of the same number of bytes from pinned memory, measured in
this run (the faster of a torch-pinned buffer and the cache's own page-locked segment). A new
version is built before every repetition (the cache alternates its two slots, as in a run); two
warm-up repetitions let the shard page-lock both slots' mappings (paid once per shard process,
reported as first_sync_s). Every figure is the median of --reps repetitions. wake_s / sync_s
are the same two steps as separate calls (/wake_up, then a one-call sync), for a breakdown.

    python bench/gpu_wake_sync.py [--model qwen2-1.5b-shape] [--reps 7]
    python bench/gpu_wake_sync.py --model qwen2.5-7b-shape   # issue 37's wake_sync_8b_vs_h2d
Ends by printing one JSON line of headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from rlix.inference.fleet.backends import EmbeddedBackend, EngineBackendConfig
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.models.init import is_seeded, load_causal_lm
from rlix.models.presets import resolve_model
from rlix.weights.cache import BucketCache
from rlix.weights.api import ShardTarget
from rlix.weights.refit import WeightPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import benchkit  # noqa: E402

GiB = 1 << 30
PROMPT = [5, 17, 42, 99, 7, 3, 11, 64]


def log(msg: str) -> None:
    """A figures line, above the progress bar."""
    benchkit.log(f"gpu_wake_sync: {msg}")


def free_gpu() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def h2d_seconds(src: torch.Tensor, dst: torch.Tensor, rounds: int = 5) -> float:
    """Median time of one host->GPU copy of src into dst (after one warm-up copy)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def greedy(http: httpx.Client, url: str) -> list[int]:
    r = http.post(f"{url}/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2-1.5b-shape")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_wake_sync needs CUDA")
    # rounds: the warm-ups, the timed repetitions, the 3 of the breakdown
    with benchkit.Bench("gpu_wake_sync", total=2 + args.reps + 3) as bench:
        out = measure(args, bench)
    print(json.dumps(out))


def trainer_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a trainer would publish, on the GPU: the checkpoint's tensors, or for a seeded
    preset (the 7B and 14B shapes: no files) the drawn model's parameters, tied ones once."""
    if not is_seeded(model_dir):
        return load_file(str(model_dir / "model.safetensors"), device="cuda")
    model = load_causal_lm(model_dir, None, "cuda")
    return {name: param.detach() for name, param in model.named_parameters()}


def measure(args: argparse.Namespace, bench: benchkit.Bench) -> dict:
    """The whole bench; apart from main so that the progress bar is closed before the JSON."""
    bench.phase(f"building {args.model}")
    t0 = time.perf_counter()
    model_dir = resolve_model(args.model)  # builds the preset once (bf16 on disk)
    log(f"model {model_dir} ready in {time.perf_counter() - t0:.1f}s")
    state = trainer_weights(model_dir)
    dtypes = sorted({str(t.dtype) for t in state.values()})

    bench.phase("packing the cache, starting the shard")
    t0 = time.perf_counter()
    cache = BucketCache.for_model(state)
    cache.build_latest(1, state)  # allocates (and page-locks) the first slot
    first_build_s = time.perf_counter() - t0
    cache.promote_active(1)
    layout = cache.layout
    nbytes = layout.total_bytes

    key = secrets.token_urlsafe(16)
    cfg = EngineBackendConfig(backend="embedded", model=str(model_dir), device="cuda",
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              startup_timeout_s=300)
    shard = ShardProcess(EmbeddedBackend(cfg), key)

    class Built:  # the bench builds each version itself (timed apart): publishing only answers it
        async def publish(self, version, audit=False, on_device=False):  # noqa: ANN001, ANN202
            return cache.published(version)

    loop = asyncio.new_event_loop()
    weights = WeightPath(Built(), api_key=key)
    http = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"})
    out: dict = {"model": args.model, "dtypes": dtypes, "cache_host": cache.host,
                 "bytes": nbytes, "buckets": layout.num_buckets, "tensors": len(layout.entries),
                 "device": torch.cuda.get_device_name(), "first_build_s": round(first_build_s, 3)}
    try:
        shard.start()
        shard.wait_ready()
        url = shard.url
        log(f"cache {cache.host} built in {first_build_s:.2f}s; shard ready")
        before = greedy(http, url)  # also captures the decode graphs

        version = 1
        rows: list[dict] = []
        for rep in range(2 + args.reps):  # two warm-ups: the shard page-locks both cache slots
            bench.phase(f"rep {rep}: sleep level 2, wake+sync" + (" (warm-up)" if rep < 2 else ""))
            version += 1
            t0 = time.perf_counter()
            cache.build_latest(version, state)
            pack_s = time.perf_counter() - t0
            cache.promote_active(version)
            loop.run_until_complete(weights.publish(version))
            greedy(http, url)  # serving, graphs captured, KV in use: a real preemption point
            free_awake = free_gpu()
            t0 = time.perf_counter()
            r = http.post(f"{url}/sleep", params={"level": 2})
            r.raise_for_status()
            sleep_s = time.perf_counter() - t0
            free_asleep = free_gpu()
            t0 = time.perf_counter()
            report = loop.run_until_complete(weights.refit(version, {0: ShardTarget(url)}, wake=[0]))
            wake_sync_s = time.perf_counter() - t0
            assert report.bundled and report.reported == {0: version}, report
            log(f"rep {rep}: sleep {sleep_s * 1e3:.1f} ms, wake+sync {wake_sync_s * 1e3:.1f} ms")
            rows.append({"pack_s": pack_s, "sleep_s": sleep_s, "wake_sync_s": wake_sync_s,
                         "free_awake": free_awake, "free_asleep": free_asleep,
                         "free_synced": free_gpu()})
            bench.advance()
        warm, timed = rows[:2], rows[2:]
        same = greedy(http, url) == before

        # Breakdown: the same two steps as separate calls.
        wakes, syncs = [], []
        for i in range(3):
            bench.phase(f"breakdown {i + 1}: /wake_up, then sync")
            version += 1
            cache.build_latest(version, state)
            cache.promote_active(version)
            loop.run_until_complete(weights.publish(version))
            http.post(f"{url}/sleep", params={"level": 2}).raise_for_status()
            free_gpu()
            t0 = time.perf_counter()
            http.post(f"{url}/wake_up").raise_for_status()
            wakes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            report = loop.run_until_complete(weights.refit(version, {0: ShardTarget(url)}))
            syncs.append(time.perf_counter() - t0)
            assert report.bundled, report
            bench.advance()
        same_after_split = greedy(http, url) == before
    finally:
        loop.run_until_complete(weights.close())
        loop.close()
        http.close()
        shard.stop()

    # The bound, in the same run: the same number of bytes from pinned memory to the GPU.
    bench.phase("the pinned host->GPU copy bound")
    del state
    torch.cuda.empty_cache()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    t_pinned = h2d_seconds(pinned, dst)
    slot = cache.buckets(cache.active_version)
    flat = torch.empty(0, dtype=torch.uint8).set_(slot[0].untyped_storage(), 0, (nbytes,))
    t_cache = h2d_seconds(flat, dst)
    slot_pinned = bool(flat.is_pinned())
    del dst, pinned, flat, slot
    cache.close()
    bound = min(t_pinned, t_cache)

    med = lambda key, rs=timed: statistics.median(r[key] for r in rs)  # noqa: E731
    wake_sync = med("wake_sync_s")
    out.update({
        "wake_sync_s": round(wake_sync, 4),
        "wake_sync_all_s": [round(r["wake_sync_s"], 4) for r in timed],
        "h2d_bound_s": round(bound, 4),
        "wake_sync_vs_h2d": round(bound / wake_sync, 3),
        "h2d_pinned_GBps": round(nbytes / t_pinned / 1e9, 1),
        "h2d_cache_slot_GBps": round(nbytes / t_cache / 1e9, 1), "cache_slot_pinned": slot_pinned,
        "wake_sync_GBps": round(nbytes / wake_sync / 1e9, 1),
        "first_sync_s": [round(r["wake_sync_s"], 3) for r in warm],
        "sleep_s": round(med("sleep_s"), 4),
        "free_gib_awake": round(med("free_awake") / GiB, 2),
        "free_gib_asleep": round(med("free_asleep") / GiB, 2),
        "freed_by_sleep_gib": round((med("free_asleep") - med("free_awake")) / GiB, 2),
        "free_gib_after_sync": round(med("free_synced") / GiB, 2),
        "weights_gib": round(nbytes / GiB, 2),
        "pack_s": round(med("pack_s"), 4),
        "wake_s": round(statistics.median(wakes), 4), "sync_s": round(statistics.median(syncs), 4),
        "same_output_after_sync": same and same_after_split, "reps": len(timed),
    })
    return out


if __name__ == "__main__":
    main()
