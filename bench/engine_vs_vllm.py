"""rlix's engine server against vLLM's CPU server, side by side on the same files (issue 20).

Both are real servers (`rlix serve` and vLLM 0.32's CPU build from scripts/setup-vllm.sh),
started once on free ports on the same checkpoint, in bf16, with the same number of compute
threads: rlix gets `--threads N`; vLLM gets its OpenMP threads pinned to N of this process's
CPUs (VLLM_CPU_OMP_THREADS_BIND), since its default on a 2-core machine is one thread.

Rounds are interleaved so load drifting on a shared machine hits both alike: in each round,
for each concurrency c in (1, 8, 32), the same random prompts (8-64 token ids) run on one
server and then on the other, the order swapping every round. A request is a streamed
OpenAI completion (`/v1/completions`, temperature 1, end-of-sequence ignored, fixed
max_tokens); at most c are in flight, a finished one's slot refilled at once. Per server and c:
output tokens/s (all tokens / wall time, prefill included) and time to first token (p50).

Figures (one JSON line on stdout):
  engine_vs_vllm_c<c>    median over rounds of rlix tok/s / vLLM tok/s (the bound: >= 1.0)
  ttft_p50_c8_<server>_s median over rounds of the p50 time to first token at 8 concurrent
                         (the bound: rlix's no worse than vLLM's)
  tok_s_c<c>_<server>    median tok/s, for scale
The server not being measured is frozen (SIGSTOP, then SIGCONT): after a burst vLLM keeps a
core busy for about a second (1.2-1.4 CPU s of it landed in each rlix measurement that followed
without the freeze, on 2 cores); `--no-freeze` leaves both running. `--keep FILE` writes every
round's raw numbers, the servers' PIDs and the idle server's CPU time during each measurement.

    .venv/bin/python bench/engine_vs_vllm.py [--rounds 3] [--threads N] [--quick] [--keep FILE]
`--quick`: the tiny preset, short outputs, one round each way (a smoke test, about 2 minutes,
most of it vLLM's start). Needs scripts/setup-vllm.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlix import env
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.models.presets import resolve_model

KEY = "bench-engine-vs-vllm"
SERVERS = ("vllm", "rlix")
CONCURRENCY = (1, 8, 32)
console = Console(stderr=True)


@dataclass(frozen=True)
class Workload:
    """What one (server, c) measurement sends: requests per concurrency, tokens per request."""

    model: str
    counts: dict[int, int]
    max_tokens: int
    max_model_len: int = 256


REAL = Workload("qwen2-0.5b-shape", {1: 2, 8: 8, 32: 32}, 128)
QUICK = Workload("tiny", {1: 2, 8: 8, 32: 32}, 16)


@dataclass
class Measure:
    tok_s: float
    ttft_p50_s: float
    wall_s: float
    tokens: int
    ttfts_s: list[float] = field(default_factory=list)
    other_cpu_s: float = 0.0  # CPU time the idle server used meanwhile


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (not text): both servers see exactly the same prompt lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split at "\n" only: httpx's `aiter_lines` also splits at U+2028, U+0085
    and the like, which JSON leaves unescaped, so a random model's text could cut an event."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def run_load(http: httpx.AsyncClient, batch: list[list[int]], concurrency: int,
                   max_tokens: int) -> Measure:
    """Stream every prompt with at most `concurrency` in flight; tok/s and TTFT p50."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        async with gate:
            t0 = time.perf_counter()
            first = None
            got = usage = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
                async for line in sse_lines(r):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or ():
                        ids = choice.get("token_ids") or ()
                        if ids and first is None:
                            first = time.perf_counter() - t0
                        got += len(ids)
            if usage != max_tokens or got != max_tokens or first is None:
                raise RuntimeError(f"expected {max_tokens} tokens, streamed {got}, usage {usage}")
            ttfts.append(first)
            tokens += got

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in batch))
    wall = time.perf_counter() - t0
    return Measure(tokens / wall, statistics.median(ttfts), wall, tokens, sorted(ttfts))


def group_cpu_s(pgid: int, only: int | None = None) -> float:
    """User+system CPU seconds of every live process in a process group (a server and its
    children, e.g. vLLM's engine core), read from /proc; `only`: of that one process."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or (only is not None and entry.name != str(only)):
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields from the state on: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])
    return total / tick


def idle_cpu(pgid: int, seconds: float = 3.0) -> dict[int, float]:
    """Cores each process of a group keeps busy while its server has no request (per PID)."""
    def per_pid() -> dict[int, float]:
        return {pid: group_cpu_s(pgid, only=pid) for pid in group_pids(pgid)}

    before = per_pid()
    time.sleep(seconds)
    after = per_pid()
    return {pid: round((after[pid] - before.get(pid, 0.0)) / seconds, 2) for pid in after}


def group_pids(pgid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def freeze_group(pgid: int) -> list[int]:
    """SIGSTOP a server's processes, all but its guard (the group leader): a guard left running
    still ends them (SIGKILL reaches a stopped process) if this process is killed meanwhile."""
    pids = [pid for pid in group_pids(pgid) if pid != pgid]
    for pid in pids:
        signal_pid(pid, signal.SIGSTOP)
    return pids


def start_server(kind: str, model: Path, threads: int, wl: Workload) -> ShardProcess:
    """One server on a free port; rlix and vLLM get the same files, dtype and thread count."""
    common = dict(model=str(model), served_model_name="m", dtype="bfloat16",
                  max_model_len=wl.max_model_len, max_num_seqs=max(CONCURRENCY), startup_timeout_s=900)
    extra_env: dict[str, str] = {}
    if kind == "rlix":
        # the idle server is frozen while this one runs: it has its cores to itself, as vLLM does
        cfg = EngineBackendConfig(backend="embedded", cpu_threads=threads, shared_cores=False,
                                  **common)  # type: ignore[arg-type]
    else:
        cfg = EngineBackendConfig(backend="vllm", cpu_kvcache_gib=1, **common)  # type: ignore[arg-type]
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        extra_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    proc = ShardProcess(make_backend(cfg), KEY, extra_env=extra_env)
    proc.start()
    return proc


def vocab_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


async def bench(urls: dict[str, str], pgids: dict[str, int], wl: Workload, vocab: int,
                rounds: int, progress: Progress, freeze: bool, keep_idle: dict) -> list[dict]:
    """Warm both up, then the interleaved rounds. With `freeze` the server not being measured
    is stopped (its processes but the guard get SIGSTOP, then SIGCONT): vLLM keeps a core
    busy for about a second after a burst, which on two cores lands in rlix's measurement."""
    clients = {k: httpx.AsyncClient(base_url=u, headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64))
               for k, u in urls.items()}
    try:
        warm = prompts(max(CONCURRENCY), vocab, seed=999)
        task = progress.add_task("warm-up", total=len(SERVERS))
        for k in SERVERS:  # first requests pay for allocation and vLLM's compiled shapes
            await run_load(clients[k], warm[:1], 1, 4)
            await run_load(clients[k], warm, max(CONCURRENCY), 4)
            progress.advance(task)
        progress.remove_task(task)
        for k in SERVERS:
            keep_idle[k] = idle_cpu(pgids[k])
            progress.console.log(f"{k} idle, cores busy per process: {keep_idle[k]}")
        out = []
        task = progress.add_task("rounds", total=rounds * len(CONCURRENCY) * len(SERVERS))
        for r in range(rounds):
            order = SERVERS if r % 2 == 0 else SERVERS[::-1]
            row: dict = {"round": r, "order": list(order)}
            for c in CONCURRENCY:
                batch = prompts(wl.counts[c], vocab, seed=1000 * r + c)
                for k in order:
                    other = next(o for o in SERVERS if o != k)
                    progress.update(task, description=f"round {r + 1}/{rounds} c={c} {k}")
                    cpu0 = group_cpu_s(pgids[other])
                    frozen = freeze_group(pgids[other]) if freeze else []
                    try:
                        m = await run_load(clients[k], batch, c, wl.max_tokens)
                    finally:
                        for pid in frozen:
                            signal_pid(pid, signal.SIGCONT)
                    m.other_cpu_s = round(group_cpu_s(pgids[other]) - cpu0, 2)
                    row[f"c{c}_{k}"] = {"tok_s": round(m.tok_s, 2), "ttft_p50_s": round(m.ttft_p50_s, 4),
                                        "wall_s": round(m.wall_s, 2), "tokens": m.tokens,
                                        "ttfts_s": [round(t, 4) for t in m.ttfts_s],
                                        "idle_other_cpu_s": m.other_cpu_s}
                    progress.advance(task)
                ratio = row[f"c{c}_rlix"]["tok_s"] / row[f"c{c}_vllm"]["tok_s"]
                row[f"ratio_c{c}"] = round(ratio, 3)
                progress.console.log(
                    f"round {r + 1} c={c:>2}: rlix {row[f'c{c}_rlix']['tok_s']:7.1f} tok/s, vLLM "
                    f"{row[f'c{c}_vllm']['tok_s']:7.1f} tok/s, ratio {ratio:.2f}; TTFT p50 rlix "
                    f"{row[f'c{c}_rlix']['ttft_p50_s']:.3f} s, vLLM {row[f'c{c}_vllm']['ttft_p50_s']:.3f} s")
            out.append(row)
        return out
    finally:
        for c in clients.values():
            await c.aclose()


def headline(rows: list[dict], wl: Workload, threads: int, freeze: bool) -> dict:
    def med(key: str, sub: str | None = None) -> float:
        return statistics.median(row[key][sub] if sub else row[key] for row in rows)

    out: dict = {"bench": "engine_vs_vllm", "model": wl.model, "threads": threads, "rounds": len(rows),
                 "max_tokens": wl.max_tokens, "freeze_idle": freeze}
    for c in CONCURRENCY:
        out[f"engine_vs_vllm_c{c}"] = round(med(f"ratio_c{c}"), 3)
    out["ttft_p50_c8_rlix_s"] = round(med("c8_rlix", "ttft_p50_s"), 4)
    out["ttft_p50_c8_vllm_s"] = round(med("c8_vllm", "ttft_p50_s"), 4)
    for c in CONCURRENCY:
        for k in SERVERS:
            out[f"tok_s_c{c}_{k}"] = round(med(f"c{c}_{k}", "tok_s"), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; 2 with --quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads of each server (default: this process's CPUs)")
    ap.add_argument("--quick", action="store_true", help="tiny model, short outputs: a smoke test")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128; 16 quick)")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the idle server running during the other's measurement (unfair on few cores)")
    ap.add_argument("--keep", metavar="FILE", help="write every round's raw numbers here (JSON)")
    args = ap.parse_args()
    if not env.vllm_python():
        sys.exit("bench/engine_vs_vllm.py: no Python with vLLM (run scripts/setup-vllm.sh)")
    wl = QUICK if args.quick else REAL
    if args.max_tokens:
        wl = Workload(wl.model, wl.counts, args.max_tokens, max(wl.max_model_len, 64 + args.max_tokens))
    rounds = args.rounds or (2 if args.quick else 3)
    threads = args.threads or len(os.sched_getaffinity(0))
    # SIGTERM ends us through the finally below, so the servers are stopped by PID either way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = resolve_model(wl.model)  # built into the rlix cache once, then reused
    vocab = vocab_of(model)
    console.log(f"{wl.model} at {model}: {threads} thread(s) each, {rounds} round(s), "
                f"{wl.max_tokens} tokens per request, requests per c {wl.counts}")
    procs: dict[str, ShardProcess] = {}
    keep: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "loadavg_start": os.getloadavg()}}
    try:
        t0 = time.perf_counter()
        for k in SERVERS:  # started together (vLLM's start is the long one), waited on in turn
            procs[k] = start_server(k, model, threads, wl)
        for k in SERVERS:
            procs[k].wait_ready()
            console.log(f"{k} healthy at {procs[k].url} after {time.perf_counter() - t0:.0f} s")
        keep["pids"] = {k: group_pids(p.pid) for k, p in procs.items() if p.pid}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, disable=not console.is_terminal) as progress:
            rows = asyncio.run(bench({k: p.url for k, p in procs.items()},
                                     {k: p.pid for k, p in procs.items() if p.pid}, wl, vocab, rounds, progress,
                                     not args.no_freeze, keep.setdefault("idle_cores_per_pid", {})))
    finally:
        for p in procs.values():
            p.stop()
        keep["ended"] = {k: not p.alive() for k, p in procs.items()}
        if args.keep:
            keep.setdefault("rounds", [])
            Path(args.keep).write_text(json.dumps(keep, indent=1))
    keep["machine"]["loadavg_end"] = os.getloadavg()
    keep["rounds"] = rows
    out = headline(rows, wl, threads, not args.no_freeze)
    keep["headline"] = out
    if args.keep:
        Path(args.keep).write_text(json.dumps(keep, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
