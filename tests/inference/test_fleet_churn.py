"""Acceptance: 200 concurrent requests through the router while shards shrink and expand at
random; every request completes exactly once with exactly the requested number of tokens."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from kit import FleetHarness, sse_events

N_REQUESTS = 200
RANKS = [0, 1, 2]


async def _one(http: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> dict:
    """One request of a random kind, sent after a random delay; returns what the caller saw."""
    await asyncio.sleep(rng.uniform(0, 8.0))  # arrivals spread over the chaos
    n = rng.randint(6, 40)
    kind = rng.choice(["cmpl", "cmpl_stream", "chat", "chat_stream", "gen", "gen_stream"])
    common = {"max_tokens": n, "ignore_eos": True, "temperature": 1.0, "seed": i}
    session = {"X-Session-ID": f"s{i % 7}"} if i % 3 == 0 else {}
    if kind.startswith("gen"):
        body = {"token_ids": [5 + i % 50, 17, 33], "sampling_params": common}
        path = "/inference/v1/generate"
    elif kind.startswith("chat"):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}], **common}
        path = "/v1/chat/completions"
    else:
        body = {"model": "tiny", "prompt": f"prompt {i}", "return_token_ids": True, **common}
        path = "/v1/completions"
    if kind.endswith("stream"):
        body.update(stream=True, stream_options={"include_usage": True})
        r = await http.post(url + path, json=body, headers=session)
        assert r.status_code == 200, r.text
        chunks = sse_events(r.text)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                    and c["choices"][0]["finish_reason"] is not None]
        usage = [c["usage"] for c in chunks if not c["choices"]]
        assert len(usage) == 1
        got = usage[0]["completion_tokens"]
        if kind == "cmpl_stream" or kind == "gen_stream":
            ids = [t for c in chunks if c["choices"] for t in (c["choices"][0].get("token_ids") or [])]
            if kind == "cmpl_stream":
                assert len(ids) == got
        return {"i": i, "want": n, "got": got, "finish": finishes}
    r = await http.post(url + path, json=body, headers=session)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    got = data["usage"]["completion_tokens"]
    if kind == "cmpl" or kind == "gen":
        assert len(choice["token_ids"]) == got
    if kind == "gen":
        spans = choice["weight_versions"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == got
    return {"i": i, "want": n, "got": got, "finish": [choice["finish_reason"]]}


async def _chaos(h: FleetHarness, stop: asyncio.Event, rng: random.Random, log: list) -> None:
    """Every 100-400 ms shrink a random active shard or expand a sleeping one."""
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.1, 0.4))
        active = h.fleet.active_ranks()
        asleep = [r for r in RANKS if r not in active]
        # shrink mostly while >1 active; now and then take the last one (requests must wait)
        if active and (len(active) > 1 or rng.random() < 0.15) and (not asleep or rng.random() < 0.6):
            rank = rng.choice(active)
            report = await h.fleet.sleep_partial([rank])
            log.append(("shrink", rank, report[rank]))
        elif asleep:
            rank = rng.choice(asleep)
            await h.fleet.expand([rank])
            log.append(("expand", rank, None))
    await h.fleet.expand([r for r in RANKS if r not in h.fleet.active_ranks()])


def test_200_requests_survive_random_shrink_and_expand(tiny_model_dir):
    async def main() -> tuple[list[dict], list, dict, float]:
        rng = random.Random(7)
        async with FleetHarness(tiny_model_dir, drain_timeout_s=2.0) as h:
            await h.start(RANKS)
            stop, log = asyncio.Event(), []
            chaos = asyncio.create_task(_chaos(h, stop, rng, log))
            t0 = time.perf_counter()
            limits = httpx.Limits(max_connections=400)
            async with httpx.AsyncClient(timeout=120, limits=limits) as http:
                results = await asyncio.gather(*(_one(http, h.server.url, i, random.Random(i))
                                                 for i in range(N_REQUESTS)))
            elapsed = time.perf_counter() - t0
            stop.set()
            await chaos
            stats = {"requests": h.router.relay.requests, "redispatched": h.router.relay.redispatched}
        return results, log, stats, elapsed

    results, log, stats, elapsed = asyncio.run(main())
    assert sorted(r["i"] for r in results) == list(range(N_REQUESTS))  # each answered once
    for r in results:
        assert r["got"] == r["want"], r
        assert r["finish"] == ["length"], r  # exactly one finish, never "abort"
    shrinks = [e for e in log if e[0] == "shrink"]
    assert len(shrinks) >= 2 and any(e[0] == "expand" for e in log)
    assert stats["requests"] == N_REQUESTS
    assert stats["redispatched"] > 0, "no request was cut: the test did not exercise preemption"
    print(f"\n{N_REQUESTS} requests in {elapsed:.1f}s; {len(shrinks)} shrinks, "
          f"{stats['redispatched']} re-dispatches")
