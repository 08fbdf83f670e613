"""Ray actors for the shard fleet; thin shells over ShardProcess, Router and ShardFleet.

`ShardActor` owns one engine server process (started on a free port of its node, bound to the
node's address, ended by its PID when the actor stops); placing the actor places the shard:
`rlix run` uses these on a cluster of several nodes (RayLauncher), and child processes of the
pipeline actor (LocalLauncher) on one. `FleetActor` is
one pipeline's fleet: it serves the router in its own event loop (so marking a shard preempted
is a method call, not an HTTP round trip) and drives the shards through `ShardFleet`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlix import env
from rlix.errors import EngineStateError
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.inference.fleet.startup import HEALTHY, STARTED, ShardStartup

#: beyond the server's own start-up limit: the actor's scheduling and process start
ACTOR_START_SLACK_S = 60.0
STOP_TIMEOUT_S = 30.0
#: an alive check that takes longer is a busy actor, not a dead one
ALIVE_TIMEOUT_S = 5.0
#: how often a starting shard's node is checked to be still in the cluster
NODE_CHECK_S = 1.0


@dataclass(frozen=True)
class ShardStart:
    """A started shard server, as its actor saw it on its node."""

    url: str
    pid: int  # its guard (its process group)
    server_pid: int | None
    node_id: str
    visible_devices: str | None  # read back from the server's own environment
    memory_share: str | None


@ray.remote(num_cpus=0, max_concurrency=4)
class ShardActor:
    """One engine server process on this actor's node, bound to the node's address (reached
    across nodes, protected by the token). The server's guard watches this actor's process:
    whatever ends the actor (a stop, a kill, its node going away) ends the server."""

    def __init__(self, cfg: dict, api_key: str, host: str | None = None,
                 extra_env: dict[str, str] | None = None, log_dir: str | None = None) -> None:
        self.proc = ShardProcess(make_backend(EngineBackendConfig(**cfg)), api_key,
                                 host or ray.util.get_node_ip_address(), log_dir=log_dir, extra_env=extra_env)

    def start(self) -> ShardStart:
        self.proc.start_ready()
        server = self.proc.server_pid()
        return ShardStart(self.proc.url, self.proc.pid or 0, server, ray.get_runtime_context().get_node_id(),
                          env.process_visible_devices(server) if server else None,
                          env.process_env(server, env.GPU_MEMORY_SHARE_VAR) if server else None)

    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def exit_code(self) -> int | None:
        return self.proc.proc.poll() if self.proc.proc is not None else None

    def log_tail(self, n: int = 5) -> str:
        return self.proc.log_tail(n)

    def stop(self) -> int | None:
        return self.proc.stop()


class RayLauncher:
    """ShardLauncher over ShardActors. `placement(gpus)` gives the Ray options that put an
    actor on those GPUs' node and bundle (rlix.placement), `process_env(gpus)` what its server
    must see (CUDA_VISIBLE_DEVICES); without them every actor gets `actor_options`."""

    def __init__(self, cfg: EngineBackendConfig, api_key: str, actor_options: dict | None = None, *,
                 placement: Callable[[Sequence[int]], dict] | None = None,
                 process_env: Callable[[Sequence[int]], dict[str, str]] | None = None,
                 node_of: Callable[[Sequence[int]], str] | None = None,
                 log_dir: str | None = None) -> None:
        self.cfg, self.api_key = cfg, api_key
        self.actor_options = actor_options or {}
        self._placement, self._process_env, self._node_of = placement, process_env, node_of
        self.log_dir = log_dir
        self.actors: dict[int, Any] = {}
        self.started: dict[int, ShardStart] = {}
        #: rank -> when its start began and how long it took (None: still starting)
        self._starts: dict[int, tuple[float, float | None]] = {}
        self._ended: dict[int, tuple[int | None, str]] = {}  # rank -> exit code, log tail, once dead

    def placement(self, gpus: Sequence[int]) -> dict[str, str]:
        """What a process placed on `gpus` runs with: its node and environment (a move that
        changes neither keeps the process)."""
        node = self._node_of(gpus) if self._node_of is not None else ""
        return {"node": node, **(self._process_env(gpus) if self._process_env is not None else {})}

    async def start(self, rank: int, gpus: Sequence[int] = ()) -> str:
        options = dict(self.actor_options)
        extra_env: dict[str, str] = {}
        if gpus and self._placement is not None:
            if self._node_of is not None:
                node = self._node_of(gpus)
                if not node_alive(node):
                    raise EngineStateError(f"shard {rank}: GPUs {list(gpus)} are on node {node[:12]}, "
                                           f"which is no longer in the Ray cluster")
            options.update(self._placement(gpus))
            extra_env = self._process_env(gpus) if self._process_env is not None else {}
        actor = ShardActor.options(**options).remote(self.cfg.model_dump(), self.api_key,
                                                     extra_env=extra_env, log_dir=self.log_dir)
        self.actors[rank] = actor
        self._ended.pop(rank, None)
        began = time.monotonic()
        self._starts[rank] = (began, None)
        try:
            info = await self._started(rank, actor, self._node_of(gpus) if gpus and self._node_of else None)
        except BaseException:
            self.actors.pop(rank, None)
            self._starts.pop(rank, None)
            ray.kill(actor)
            raise
        self.started[rank] = info
        self._starts[rank] = (began, time.monotonic() - began)
        return info.url

    async def _started(self, rank: int, actor: Any, node: str | None) -> ShardStart:
        """The actor's start, bounded: by the server's start-up limit plus the actor's own
        scheduling, and by its node staying in the cluster (an actor bound for a node that just
        died would wait for it until the limit)."""
        limit = self.cfg.startup_timeout_s + ACTOR_START_SLACK_S
        start = asyncio.ensure_future(_result(actor.start.remote()))
        deadline = time.monotonic() + limit
        try:
            while True:
                done, _ = await asyncio.wait({start}, timeout=NODE_CHECK_S)
                if done:
                    return start.result()
                if node is not None and not node_alive(node):
                    raise EngineStateError(f"shard {rank}: node {node[:12]} left the cluster while the "
                                           f"shard was starting there")
                if time.monotonic() > deadline:
                    raise EngineStateError(f"shard {rank}: its actor did not start a server within {limit:g} s")
        finally:
            start.cancel()

    def startup(self) -> list[ShardStartup]:
        """Each process's start-up as seen from here: starting or healthy (its phase is in its
        log on its own node, and its actor answers only once the server is up)."""
        now = time.monotonic()
        return [ShardStartup(key=rank, pid=None,  # known only once it is up: one identity throughout
                             phase=STARTED if took is None else HEALTHY,
                             elapsed_s=round(now - began if took is None else took, 1), healthy=took is not None)
                for rank, (began, took) in sorted(self._starts.items())]

    async def stop(self, rank: int) -> None:
        actor = self.actors.pop(rank, None)
        self._starts.pop(rank, None)
        self.started.pop(rank, None)
        self._ended.pop(rank, None)
        if actor is not None:
            try:
                await asyncio.wait_for(actor.stop.remote(), STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead already (its server went with it) or stuck
                pass
            finally:
                ray.kill(actor)

    def pids(self) -> dict[int, int]:
        return {r: i.pid for r, i in self.started.items()}

    def server_pids(self) -> dict[int, int]:
        return {r: i.server_pid for r, i in self.started.items() if i.server_pid is not None}

    def node_of_rank(self, rank: int) -> str | None:
        info = self.started.get(rank)
        return info.node_id if info is not None else None

    def process_info(self, rank: int) -> dict:
        """Where the rank's server runs, as its actor read it there."""
        info = self.started[rank]
        return {"pid": info.pid, "node_id": info.node_id, "visible_devices": info.visible_devices,
                "memory_share": info.memory_share}

    def exit_code(self, rank: int) -> int | None:
        return self._ended.get(rank, (None, ""))[0]

    def log_tail(self, rank: int, n: int = 5) -> str:
        return self._ended.get(rank, (None, ""))[1]

    async def dead_ranks(self) -> list[int]:
        """A shard is dead when its process exited or its actor is gone (its node too)."""
        async def dead(rank: int, actor: Any) -> bool:
            try:
                if await asyncio.wait_for(actor.alive.remote(), ALIVE_TIMEOUT_S):
                    return False
            except asyncio.TimeoutError:
                return False  # a busy actor is not a dead one
            except ray.exceptions.RayActorError:
                self._ended[rank] = (None, "(its actor is gone: killed, or its node left the cluster)")
                return True
            if rank not in self._ended:
                try:
                    self._ended[rank] = (await actor.exit_code.remote(), await actor.log_tail.remote())
                except ray.exceptions.RayActorError:
                    self._ended[rank] = (None, "")
            return True
        ranks = sorted(self.actors)
        answers = await asyncio.gather(*(dead(r, self.actors[r]) for r in ranks))
        return [r for r, d in zip(ranks, answers) if d]


async def _result(ref: Any) -> Any:
    return await ref


def node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


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
        return self.fleet.pids()

    async def shutdown(self) -> None:
        await self.fleet.shutdown()
        if self.server is not None:
            await self.server.stop()
            self.server = None
        await asyncio.sleep(0)
