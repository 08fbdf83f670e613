"""Ray actors for the shard fleet; thin shells over ShardProcess, Router and ShardFleet.

`ShardActor` owns one engine server process (started on a free port of its node, ended by its
PID when the actor stops); placing the actor (num_gpus=tp) places the shard. `FleetActor` is
one pipeline's fleet: it serves the router in its own event loop (so marking a shard preempted
is a method call, not an HTTP round trip) and drives the shards through `ShardFleet`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray

from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer
from rlix.inference.fleet.shard_process import ShardProcess


@ray.remote(num_cpus=0)
class ShardActor:
    """One engine server process."""

    def __init__(self, cfg: dict, api_key: str, host: str = "127.0.0.1") -> None:
        self.proc = ShardProcess(make_backend(EngineBackendConfig(**cfg)), api_key, host)

    def start(self) -> str:
        self.proc.start()
        self.proc.wait_ready()
        return self.proc.url

    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> int | None:
        return self.proc.stop()


class RayLauncher:
    """ShardLauncher over ShardActors; `actor_options` places them (e.g. {"num_gpus": 1})."""

    def __init__(self, cfg: EngineBackendConfig, api_key: str, actor_options: dict | None = None) -> None:
        self.cfg, self.api_key = cfg, api_key
        self.actor_options = actor_options or {}
        self.actors: dict[int, Any] = {}
        self._pids: dict[int, int] = {}

    async def start(self, rank: int, gpus: Sequence[int] = ()) -> str:
        """`gpus` is not used: `actor_options` place the actor (issue 17 places each by GPU)."""
        actor = ShardActor.options(**self.actor_options).remote(self.cfg.model_dump(), self.api_key)
        self.actors[rank] = actor
        url = await actor.start.remote()
        self._pids[rank] = await actor.pid.remote()
        return url

    async def stop(self, rank: int) -> None:
        actor = self.actors.pop(rank, None)
        self._pids.pop(rank, None)
        if actor is not None:
            try:
                await actor.stop.remote()
            finally:
                ray.kill(actor)

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    async def dead_ranks(self) -> list[int]:
        """A shard is dead when its process exited or its actor is gone."""
        async def dead(actor: Any) -> bool:
            try:
                return not await actor.alive.remote()
            except ray.exceptions.RayActorError:
                return True
        ranks = sorted(self.actors)
        answers = await asyncio.gather(*(dead(self.actors[r]) for r in ranks))
        return [r for r, d in zip(ranks, answers) if d]


@ray.remote(num_cpus=0)
class FleetActor:
    """One pipeline's shards and router."""

    def __init__(self, cfg: dict, api_key: str, sleep_level: int = 1, drain_timeout_s: float = 5.0,
                 hold_timeout_s: float = 60.0, shard_options: dict | None = None) -> None:
        self.cfg = EngineBackendConfig(**cfg)
        self.api_key = api_key
        self.router = Router(api_key, hold_timeout_s=hold_timeout_s)
        self.server: RouterServer | None = None
        backend = make_backend(self.cfg)
        self.client = RemoteInferenceClient(None, {}, api_key, self.cfg.name_in_api)
        self.fleet = ShardFleet(RayLauncher(self.cfg, api_key, shard_options), self.router, self.client,
                                supports_sleep=backend.supports_sleep, sleep_level=sleep_level,
                                drain_timeout_s=drain_timeout_s)

    async def start(self, ranks: list[int], active: bool = True) -> str:
        """Start the router and the shards; returns the router URL."""
        if self.server is None:
            self.server = RouterServer(self.router)
            await self.server.start()
            self.client.router_url = self.server.url
        await self.fleet.start(ranks, active)
        return self.server.url

    def client_config(self) -> RemoteInferenceClient:
        """A picklable client for this pipeline (router + current shard URLs)."""
        return RemoteInferenceClient(self.client.router_url, dict(self.client.shard_urls), self.api_key,
                                     self.cfg.name_in_api)

    async def sleep_partial(self, ranks: list[int], level: int | None = None) -> dict:
        return await self.fleet.sleep_partial(ranks, level)

    async def wake_up_partial(self, ranks: list[int], tags: list[str] | None = None) -> None:
        await self.fleet.wake_up_partial(ranks, tags)

    async def activate(self, ranks: list[int]) -> None:
        await self.fleet.activate(ranks)

    async def deactivate(self, ranks: list[int]) -> None:
        await self.fleet.deactivate(ranks)

    async def expand(self, ranks: list[int]) -> None:
        await self.fleet.expand(ranks)

    async def shards(self) -> list[dict]:
        return await self.router.shards()

    def pids(self) -> dict[int, int]:
        return self.fleet.launcher.pids()

    async def shutdown(self) -> None:
        await self.fleet.shutdown()
        if self.server is not None:
            await self.server.stop()
            self.server = None
        await asyncio.sleep(0)
