"""The coordinator against real engine servers and a real trainer actor: shards woken by the
scheduler get the newest version before any request reaches them; active ones are refitted in
flight; sleeping ones are not touched."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

from rlix.config.models import TrainConfig
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import LocalLauncher, ShardFleet
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.training.actor import TrainerActor
from rlix.training.types import TrainSample

KEY = "coordinator-test"


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def batch(seed: int) -> list[TrainSample]:
    return [TrainSample([1, 2, 3], [4 + (seed + i) % 7, 5, 6], [-1.0, -1.2, -0.8], 1.0 if i % 2 else -1.0)
            for i in range(4)]


async def greedy(url: str) -> list[int]:
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = await http.post(f"{url}/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("wake_in_sync", [False, True], ids=["wake-then-sync", "wake-in-sync"])
def test_wake_syncs_then_activates_and_publish_refits_only_active_shards(ray_local, tiny_model_dir, wake_in_sync):
    trainer = TrainerActor.options(max_concurrency=2).remote(str(tiny_model_dir), TrainConfig(lr=0.05),
                                                             seed=0, api_key=KEY)

    async def main() -> None:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, {}, KEY, "tiny")
        backend = make_backend(EngineBackendConfig(backend="embedded", model=str(tiny_model_dir),
                                                   served_model_name="tiny", max_model_len=128))
        fleet = ShardFleet(LocalLauncher(backend, KEY), router, client)

        coord = ShardCoordinator(fleet, trainer.sync_weights.remote, wake_in_sync=wake_in_sync)
        try:
            await coord.start([0, 1], version=0)
            before = await greedy(fleet.shards[0].url)
            await fleet.sleep_partial([0, 1])
            ray.get(trainer.train_step.remote(batch(1)))
            ray.get(trainer.publish.remote(1))
            coord.announce(1)
            await coord.resize_inference([], {0: [0]})
            assert fleet.active_ranks() == [0] and coord.versions == {0: 1, 1: 0}
            kinds = [e.kind for e in coord.stats.events if e.kind != "start"]
            # a stale shard is woken by its own sync call, or by a wake call before it
            assert kinds == (["sync", "activate"] if wake_in_sync else ["wake", "sync", "activate"])
            assert fleet.shards[0].asleep is False and fleet.shards[1].asleep is True
            after = await greedy(fleet.shards[0].url)
            assert after != before  # serving the trained weights
            ray.get(trainer.train_step.remote(batch(2)))
            ray.get(trainer.publish.remote(2))
            assert await coord.publish(2) == [0]  # only the active shard is refitted
            assert coord.versions == {0: 2, 1: 0}
            await coord.resize_inference([0], {1: [1]})  # the scheduler moves the shard
            assert fleet.active_ranks() == [1] and coord.versions == {0: 2, 1: 2}
            assert await greedy(fleet.shards[1].url) != after  # rank 1 got version 2, not 1
            assert coord.history == {0: [0, 1, 2], 1: [0, 2]}
            assert coord.stats.version_mismatches == []
        finally:
            await fleet.shutdown()
            await server.stop()
            await client.aclose()

    try:
        asyncio.run(main())
    finally:
        ray.get(trainer.close.remote())
        ray.kill(trainer)
