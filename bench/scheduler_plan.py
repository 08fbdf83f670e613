"""Planner latency at cluster scale: 1,024 GPUs (128 nodes x 8) and 128 pipelines.

Drives ledger + planner through a random but realistic event stream (progress reports,
training requests, releases) and times every `plan()` call. Goal: p99 < 10 ms.
Ends by printing one JSON line: plan_ms_p50, plan_ms_p99 (and more).

    .venv/bin/python bench/scheduler_plan.py [--events 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from rlix.scheduler.planner import PlannerParams, plan
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import GpuRequest, PipelineSpec, Progress, Role, Stage, Topology


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--pipelines", type=int, default=128)
    ap.add_argument("--events", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    led = Ledger(Topology.uniform(args.nodes, args.gpus_per_node))
    params = PlannerParams(dwell_s=30.0, aging_s=60.0)
    names = []
    for i in range(args.pipelines):
        tp = rng.choice([1, 1, 2, 4, 8])
        spec = PipelineSpec(f"p{i:03d}", priority=rng.choice([0, 0, 0, 1, 2]),
                            weight=rng.choice([0.5, 1.0, 2.0]), train_gpus=rng.choice([8, 16, 32]),
                            tp=tp, min_shards=1, max_shards=rng.choice([4, 8, 16, 32]),
                            partial_overlap=rng.random() < 0.9, seqs_per_shard=rng.choice([4, 8, 16]))
        led.register(spec)
        names.append(spec.name)

    now, rid = 0.0, 0
    pending: dict[str, GpuRequest] = {}
    progress: dict[str, Progress] = {}
    times: list[float] = []
    kinds: dict[str, int] = {}
    cold = time.perf_counter()
    led.apply(plan(led, [], progress, now, params), now)
    cold_ms = (time.perf_counter() - cold) * 1e3
    for _ in range(args.events):
        now += rng.expovariate(1 / 0.5)
        kind = rng.choices(["progress", "request", "release"], weights=[6, 2, 2])[0]
        name = rng.choice(names)
        spec = led.pipelines[name]
        if kind == "progress":
            shards = led.shards_of(name)
            progress[name] = Progress(name, remaining=rng.randint(0, 256), target=256,
                                      shard_load={r: rng.randint(0, 32) for r in shards}, reported_at=now)
        elif kind == "request":
            if name in pending or led.stage_holding(name, Stage.TRAIN) is not None:
                continue
            pending[name] = GpuRequest(rid, name, Stage.TRAIN, spec.train_gpus, now)
            rid += 1
        else:
            held = [h for h in led.holdings.values() if h.role is Role.TRAIN]
            if not held:
                continue
            h = rng.choice(held)
            led.release(h.pipeline, h.stage)
        kinds[kind] = kinds.get(kind, 0) + 1
        t0 = time.perf_counter()
        p = plan(led, list(pending.values()), progress, now, params)
        times.append((time.perf_counter() - t0) * 1e3)
        led.apply(p, now)
        for g in p.grants:
            pending.pop(g.pipeline, None)

    result = {
        "plan_ms_p50": round(statistics.median(times), 3),
        "plan_ms_p99": round(percentile(times, 0.99), 3),
        "plan_ms_max": round(max(times), 3),
        "cold_plan_ms": round(cold_ms, 3),
        "gpus": led.topology.num_gpus,
        "pipelines": len(names),
        "plans": len(times),
        "goal_p99_ms": 10.0,
        "p99_vs_goal": round(percentile(times, 0.99) / 10.0, 3),
        "machine": f"{platform.machine()} {platform.python_version()}",
    }
    print(f"events: {kinds}; pending at end: {len(pending)}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
