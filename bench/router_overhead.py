"""Router overhead per request vs calling a shard directly, measured in the same run.

One `rlix serve` shard (tiny preset, CPU) and one router process (`python -m
rlix.inference.router`) in front of it. The client sends the same request alternately to the
shard and to the router, one at a time over keep-alive connections, so drift and noise hit both
paths alike; overhead = p50(routed) - p50(direct), and also the median of the paired
differences. Requests: /v1/completions and /inference/v1/generate with max_tokens 1 (the engine's
share is small, so the router's is visible), and a streamed completion of 8 tokens.
Every process started is ended by its PID. Ends by printing one JSON line of headline figures.

    .venv/bin/python bench/router_overhead.py [--n 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.httpkit import free_port
from rlix.inference.fleet.shard_process import ShardProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

KEY = "bench-token"
CASES = {
    "completion": ("/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 1,
                                       "temperature": 0, "ignore_eos": True}),
    "generate": ("/inference/v1/generate", {"token_ids": [5, 6, 7, 8], "sampling_params": {
        "max_tokens": 1, "temperature": 0, "ignore_eos": True}}),
    "completion_stream8": ("/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True, "stream": True}),
}


def start_router(shard_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlix.inference.router", "--port", str(port),
                             "--api-key", KEY, "--shard", f"0={shard_url}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("router did not start")


def timed(http: httpx.Client, url: str, path: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = http.post(url + path, json=body)
    r.read()
    assert r.status_code == 200, r.text
    return (time.perf_counter() - t0) * 1000


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="requests per path per case")
    args = ap.parse_args()
    shard = ShardProcess(make_backend(EngineBackendConfig(model="tiny", served_model_name="tiny",
                                                         max_model_len=512)), KEY)
    router = None
    results = {}
    try:
        with Bench("router_overhead", total=len(CASES)) as bench, \
                httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            bench.phase("starting the shard and the router")
            shard.start()
            shard.wait_ready()
            router, router_url = start_router(shard.url)
            for name, (path, body) in CASES.items():
                # updated once a case, never per request: beside the timed requests runs only
                # rich's refresh on a terminal (4 a second), on both paths alike
                bench.phase(f"{name}: {args.n} requests each way")
                for _ in range(30):  # warm-up both paths
                    timed(http, shard.url, path, body)
                    timed(http, router_url, path, body)
                direct, routed = [], []
                for i in range(args.n):
                    pair = [(shard.url, direct), (router_url, routed)]
                    for url, out in pair if i % 2 else pair[::-1]:
                        out.append(timed(http, url, path, body))
                diffs = [r - d for r, d in zip(routed, direct)]
                results[name] = {
                    "direct_p50_ms": round(pct(direct, 0.5), 3), "routed_p50_ms": round(pct(routed, 0.5), 3),
                    "direct_p90_ms": round(pct(direct, 0.9), 3), "routed_p90_ms": round(pct(routed, 0.9), 3),
                    "added_p50_ms": round(pct(routed, 0.5) - pct(direct, 0.5), 3),
                    "paired_diff_median_ms": round(statistics.median(diffs), 3),
                }
                bench.log(f"{name} {results[name]}")
                bench.advance()
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        shard.stop()
    headline = {"bench": "router_overhead", "n": args.n, "goal_added_p50_ms": 2.0,
                # the headline: a plain (non-streamed) completion, routed vs direct
                "router_added_ms_p50": results["completion"]["added_p50_ms"],
                "added_p50_ms_generate": results["generate"]["added_p50_ms"],
                "added_p50_ms_stream8": results["completion_stream8"]["added_p50_ms"],
                "direct_p50_ms_completion": results["completion"]["direct_p50_ms"],
                "routed_p50_ms_completion": results["completion"]["routed_p50_ms"],
                "cases": results}
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
