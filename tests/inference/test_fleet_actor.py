"""The fleet's Ray actors: shard processes started by ShardActors, router inside FleetActor;
everything ends by PID at shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from kit import KEY, engine_cfg, pid_alive
from rlix.inference.fleet.actors import FleetActor


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def test_fleet_actor_lifecycle(ray_local, tiny_model_dir):
    fleet = FleetActor.remote(engine_cfg(tiny_model_dir).model_dump(), KEY, drain_timeout_s=2.0)
    pids: dict = {}
    try:
        router_url = ray.get(fleet.start.remote([0, 1]), timeout=180)
        pids = ray.get(fleet.pids.remote())
        assert sorted(pids) == [0, 1] and all(pid_alive(p) for p in pids.values())
        client = ray.get(fleet.client_config.remote())  # picklable, crosses the actor boundary
        assert client.router_url == router_url and sorted(client.shard_urls) == [0, 1]

        async def ask():
            try:
                r = await client.completions("hello", max_tokens=5, ignore_eos=True)
                return r["usage"]["completion_tokens"], await client.is_sleeping()
            finally:
                await client.aclose()
        assert asyncio.run(ask()) == (5, {0: False, 1: False})

        report = ray.get(fleet.sleep_partial.remote([1]))
        assert set(report[1]) >= {"mark_ms", "abort_ms", "drain_ms", "sleep_ms", "to_asleep_ms"}
        states = {s["rank"]: s["state"] for s in ray.get(fleet.shards.remote())}
        assert states == {0: "active", 1: "preempted"}
        assert asyncio.run(_sleeping(client)) == {0: False, 1: True}
        ray.get(fleet.expand.remote([1]))
        assert {s["state"] for s in ray.get(fleet.shards.remote())} == {"active"}
    finally:
        ray.get(fleet.shutdown.remote(), timeout=60)
        ray.kill(fleet)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids.values())


async def _sleeping(client):
    try:
        return await client.is_sleeping()
    finally:
        await client.aclose()
