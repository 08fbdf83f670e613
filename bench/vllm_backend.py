"""A real vLLM CPU server as an rlix shard: start time, weight-sync speed, rollout throughput.

  vllm_start_s            launch to healthy (and told its version) of one vLLM shard, tiny model
  vllm_sync_<m>_s         one sync of model m (tiny, qwen2-0.5b-shape) from rlix's shared-memory
                          cache into the running server (worker extension + reload_weights), median
  memcpy_<m>_s            a memcpy of the same bytes (the cache's buckets into buffers already
                          touched, so no page faults are timed), median
  vllm_sync_vs_memcpy_<m> memcpy / sync (goal >= 0.3: sync within ~3x of copying the bytes once)
  vllm_reload_weights_<m>_s  of the sync, vLLM's own reload_weights in the worker, median (on CPU
                          it re-packs every linear weight for oneDNN: most of the sync)
  rlix_part_vs_memcpy_<m> memcpy / (sync - reload_weights): what rlix's side of the sync costs
  rollout_tok_s_<engine>  generated tokens/s of one pipeline's rollout load (64 requests in flight:
                          8 groups x 8 samples, 16 new tokens, temperature 1) on one shard of each
                          engine, same model, same run; `vllm_vs_embedded_rollout` is their ratio

    .venv/bin/python bench/vllm_backend.py [--rounds N]    (needs scripts/setup-vllm.sh)
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from rlix import env
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.models.presets import build_preset
from rlix.weights.cache import BucketCache
from rlix.weights.sync import WeightSync
from rlix.weights.vllm.endpoint import VllmShardEndpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import benchkit  # noqa: E402

KEY = "bench-token"


def say(msg: str) -> None:
    """A figures line, above the progress bar."""
    benchkit.log(f"[vllm_backend] {msg}")


def start(backend: str, model: Path, **kw: object) -> tuple[ShardProcess, float]:
    cfg = EngineBackendConfig(backend=backend, model=str(model), served_model_name="m", max_model_len=256,
                              max_num_seqs=64, startup_timeout_s=900, **kw)
    proc = ShardProcess(make_backend(cfg), KEY)
    t0 = time.perf_counter()
    proc.start()
    proc.wait_ready()
    return proc, time.perf_counter() - t0


def sync_figures(url: str, model: Path, rounds: int) -> tuple[float, float, int, float]:
    """Median sync and memcpy seconds of this model's weights, the bytes moved, and the median
    time of vLLM's own reload_weights inside the sync."""
    sd = {n: t.detach() for n, t in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}

    async def go() -> tuple[list[float], list[float], int]:
        ep = VllmShardEndpoint(url, KEY, "bench", timeout_s=600)
        syncs, copies, reloads, reads = [], [], [], []
        dst: list[torch.Tensor] = []
        with BucketCache.for_model(sd, host="shm") as cache:
            driver = WeightSync(cache, {0: ep}, "shm")
            for v in range(1, rounds + 2):
                cache.build_latest(v, sd)
                t0 = time.perf_counter()
                await driver.sync(v, [0])
                if v > 1:  # the first also sends the layout
                    syncs.append(time.perf_counter() - t0)
                    reloads.append(float(ep.last_update["reload_s"]))
                    reads.append(float(ep.last_update["read_s"]))
                buckets = cache.buckets(v)
                if not dst:  # touched once, reused: the copy is timed without page faults
                    dst = [torch.zeros_like(b) for b in buckets]
                t0 = time.perf_counter()
                for d, b in zip(dst, buckets):
                    d.copy_(b)
                copies.append(time.perf_counter() - t0)
            nbytes = cache.layout.total_bytes
        await ep.aclose()
        say(f"in the worker: read {statistics.median(reads):.4f} s, vLLM reload_weights "
            f"{statistics.median(reloads):.4f} s (medians)")
        return syncs, copies, nbytes, statistics.median(reloads)

    syncs, copies, nbytes, reload_s = asyncio.run(go())
    return statistics.median(syncs), statistics.median(copies), nbytes, reload_s


def rollout_tok_s(url: str, seconds: float = 20.0) -> float:
    """Tokens/s under a pipeline's rollout load: 64 token-level requests always in flight."""
    body = {"token_ids": [5, 6, 7, 8, 9, 10, 11, 12],
            "sampling_params": {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}}

    async def go() -> float:
        tokens = errors = 0
        deadline = time.perf_counter() + seconds
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as http:
            async def worker() -> None:
                nonlocal tokens, errors
                while time.perf_counter() < deadline:
                    try:
                        r = await http.post("/inference/v1/generate", json=body)
                    except httpx.TransportError:  # a keep-alive connection the server just closed
                        errors += 1
                        if errors > 1000:
                            raise
                        continue
                    tokens += len(r.json()["choices"][0]["token_ids"])
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(64)))
            if errors:
                say(f"{errors} request(s) retried after a transport error")
            return tokens / (time.perf_counter() - t0)

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not env.vllm_python():
        sys.exit("bench/vllm_backend.py: no Python with vLLM (run scripts/setup-vllm.sh)")
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, benchkit.Bench("vllm_backend", total=3) as bench:
        bench.phase("building the tiny and qwen2-0.5b-shape models")
        models = {"tiny": build_preset("tiny", Path(tmp) / "tiny"),
                  "0.5b": build_preset("qwen2-0.5b-shape", Path(tmp) / "half")}
        bench.phase("embedded engine on tiny: rollout load")
        proc, _ = start("embedded", models["tiny"])
        try:
            out["rollout_tok_s_embedded"] = round(rollout_tok_s(proc.url), 1)
        finally:
            proc.stop()
        say(f"so far {out}")
        bench.advance()
        for name, path in models.items():
            bench.phase(f"starting a vLLM shard on {name}")
            proc, start_s = start("vllm", path, dtype="bfloat16", cpu_kvcache_gib=1)
            try:
                if name == "tiny":
                    out["vllm_start_s"] = round(start_s, 2)
                    bench.phase(f"vLLM on {name}: rollout load")
                    out["rollout_tok_s_vllm"] = round(rollout_tok_s(proc.url), 1)
                else:
                    out["vllm_start_0.5b_s"] = round(start_s, 2)
                bench.phase(f"vLLM on {name}: syncing x{args.rounds}")
                sync_s, copy_s, nbytes, reload_s = sync_figures(proc.url, path, args.rounds)
            finally:
                proc.stop()
            out[f"vllm_sync_{name}_s"] = round(sync_s, 4)
            out[f"memcpy_{name}_s"] = round(copy_s, 5)
            out[f"sync_{name}_mib"] = round(nbytes / 2**20, 1)
            out[f"vllm_sync_vs_memcpy_{name}"] = round(copy_s / sync_s, 3)
            out[f"vllm_reload_weights_{name}_s"] = round(reload_s, 4)
            # rlix's own part of the sync (everything but vLLM's reload) against the same memcpy
            out[f"rlix_part_vs_memcpy_{name}"] = round(copy_s / max(sync_s - reload_s, 1e-6), 2)
            say(f"so far {out}")
            bench.advance()
    out["vllm_vs_embedded_rollout"] = round(out["rollout_tok_s_vllm"] / out["rollout_tok_s_embedded"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
