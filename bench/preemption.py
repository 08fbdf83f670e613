"""Preemption latency under load: from the shrink call to the shard asleep.

Two `rlix serve` shards (tiny preset, CPU) behind an in-process router; a load generator keeps
16 streamed generate requests of 64 tokens in flight through the router. Then, `--rounds` times:
shrink shard 0 (ShardFleet.sleep_partial: mark preempted -> abort -> drain -> sleep level 1),
record each phase, expand it again (wake + activate), let load settle. Reported in two parts, as
the goal is stated: the preemption itself (mark + abort + drain: the shard holds no request and
nothing new reaches it; goal <= 200 ms) and the sleep call (freeing the KV cache and offloading
weights; engine-bound). Every load request must still finish with all its tokens (re-dispatched).
Every process started is ended by its PID. Ends by printing one JSON line of headline figures.

    .venv/bin/python bench/preemption.py [--rounds 8] [--concurrency 16]
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

from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

KEY = "bench-token"
TOKENS = 64


async def load(url: str, stop: asyncio.Event, concurrency: int, stats: dict) -> None:
    async def worker(w: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            i = 0
            while not stop.is_set():
                body = {"token_ids": [5 + w, 6, 7 + i % 50], "stream": True,
                        "sampling_params": {"max_tokens": TOKENS, "ignore_eos": True, "seed": i}}
                n = 0
                async with http.stream("POST", url + "/inference/v1/generate", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk["choices"]:
                                n += len(chunk["choices"][0]["token_ids"])
                stats["done"] += 1
                stats["bad"] += n != TOKENS
                i += 1
    await asyncio.gather(*(worker(w) for w in range(concurrency)))


async def main(rounds: int, concurrency: int) -> dict:
    cfg = EngineBackendConfig(model="tiny", served_model_name="tiny", max_model_len=512)
    router = Router(KEY)
    server = RouterServer(router)
    await server.start()
    client = RemoteInferenceClient(server.url, {}, KEY, "tiny")
    fleet = ShardFleet(LocalLauncher(make_backend(cfg), KEY), router, client, drain_timeout_s=2.0)
    reports = []
    stats = {"done": 0, "bad": 0}
    try:
        with Bench("preemption", total=rounds) as bench:
            bench.phase("starting 2 shards")
            await fleet.start([0, 1])
            stop = asyncio.Event()
            loader = asyncio.create_task(load(server.url, stop, concurrency, stats))
            bench.phase(f"load: {concurrency} streams in flight")
            await asyncio.sleep(2.0)
            for i in range(rounds):
                bench.phase(f"round {i + 1}: shrink shard 0, expand it")
                running = (await client.load([0]))[0]["running"]
                t0 = time.perf_counter()
                report = (await fleet.sleep_partial([0]))[0]
                report["wall_ms"] = round((time.perf_counter() - t0) * 1000, 3)
                report["running_at_shrink"] = running
                reports.append(report)
                bench.log(str(report))
                await asyncio.sleep(0.5)
                await fleet.expand([0])
                await asyncio.sleep(1.5)
                bench.advance()
            bench.phase("load: the last requests finishing")
            stop.set()
            await loader
    finally:
        await fleet.shutdown()
        await server.stop()
        await client.aclose()
    med = lambda k: round(statistics.median(r[k] for r in reports), 3)  # noqa: E731
    mx = lambda k: round(max(r[k] for r in reports), 3)  # noqa: E731
    return {"bench": "preemption", "rounds": rounds, "concurrency": concurrency,
            "goal_preempt_ms": 200,
            "preempt_ms_p50": med("before_sleep_ms"), "preempt_ms_max": mx("before_sleep_ms"),
            "sleep_ms_p50": med("sleep_ms"), "sleep_ms_max": mx("sleep_ms"),
            "to_asleep_ms_p50": med("to_asleep_ms"), "to_asleep_ms_max": mx("to_asleep_ms"),
            "mark_ms_p50": med("mark_ms"), "abort_ms_p50": med("abort_ms"), "drain_ms_p50": med("drain_ms"),
            "forced_sleeps": sum(r["forced"] for r in reports),
            "running_at_shrink_p50": med("running_at_shrink"),
            "load_requests_done": stats["done"], "load_requests_short": stats["bad"],
            "redispatched": router.relay.redispatched}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(main(a.rounds, a.concurrency))))
