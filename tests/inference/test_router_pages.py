"""The router's own pages: GET /metrics is typed Prometheus text (every family a counter or a
gauge, parsed by prometheus_client's own parser) whose counters hold what the relay counted after
real traffic; GET /version answers vLLM's shape with rlix's version, open like /health."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kit import AUTH, KEY, shard_processes
from rlix.httpkit import free_port
from rlix.inference.router.app import RouterServer, create_router_app
from rlix.inference.router.router import Router

GEN = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}


def test_router_metrics_are_typed_and_count_real_traffic(tiny_model_dir):
    async def main() -> tuple[str, str, dict, str]:
        with shard_processes(tiny_model_dir, 1, max_model_len=256) as (live,):
            router = Router(KEY)
            server = RouterServer(router)
            await server.start()
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    before = (await http.get("/metrics")).text
                    # rank 0 (picked first: lowest rank on a tie) has nothing listening: the first
                    # request finds it unreachable, marks it DOWN and is re-dispatched to rank 1
                    await router.set_shard(0, f"http://127.0.0.1:{free_port()}", "active")
                    await router.set_shard(1, live.url, "active")
                    for _ in range(2):
                        r = await http.post("/inference/v1/generate", json=GEN)
                        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
                    page = await http.get("/metrics")
                view = {s["rank"]: s["state"] for s in await router.shards()}
                return before, page.text, view, page.headers["content-type"]
            finally:
                await server.stop()

    before, after, view, content_type = asyncio.run(main())
    assert view == {0: "down", 1: "active"}
    assert content_type.startswith("text/plain")

    families = {f.name: f for f in text_string_to_metric_families(after)}
    assert {n: f.type for n, f in families.items()} == {
        "rlix:router_requests": "counter", "rlix:router_redispatched": "counter",
        "rlix:router_shards_marked_down": "counter", "rlix:router_outstanding": "gauge"}
    # Prometheus text format (0.0.4) as prometheus_client and vLLM write it: the TYPE line names
    # the sample, `_total` included; the parser files it under the family without the suffix
    assert "# TYPE rlix:router_requests_total counter\n" in after
    assert "# TYPE rlix:router_outstanding gauge\n" in after
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in families.values() for s in f.samples}
    assert values == {
        ("rlix:router_requests_total", ()): 2.0,
        ("rlix:router_redispatched_total", ()): 1.0,
        ("rlix:router_shards_marked_down_total", ()): 1.0,
        ("rlix:router_outstanding", (("rank", "0"), ("state", "down"))): 0.0,
        ("rlix:router_outstanding", (("rank", "1"), ("state", "active"))): 0.0,
    }
    # before any shard was set: the counters at zero, typed too, no outstanding samples
    first = {f.name: f for f in text_string_to_metric_families(before)}
    assert all(f.type in ("counter", "gauge") for f in first.values())
    assert [s.value for s in first["rlix:router_requests"].samples] == [0.0]
    assert first["rlix:router_outstanding"].samples == []


def test_router_version_is_open_and_names_rlixs_version():
    """vLLM's shape, rlix's version; no token needed (the admin API beside it does need one)."""
    async def main() -> None:
        router = Router(KEY)
        try:
            transport = httpx.ASGITransport(app=create_router_app(router))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
                    r = await http.get("/version", headers=headers)
                    assert r.status_code == 200 and r.json() == {"version": version("rlix")}, (headers, r.text)
                assert (await http.get("/router/shards")).status_code == 401
        finally:
            await router.close()
    asyncio.run(main())
