"""The shard fleet of one pipeline: start, sleep/wake, (de)activate and preempt its shards.

Plain asyncio logic, testable without Ray: shard processes come from a `ShardLauncher` (local
processes here, Ray actors in actors.py), routing state goes to a `RouterControl` (the
in-process Router or a RouterAdminClient), and shard control goes over HTTP through
`RemoteInferenceClient`, so the backend never matters here.

Preemption (`sleep_partial`, what a scheduler shrink calls): mark the shards PREEMPTED in the
router (no new requests; whatever they abort is re-dispatched) -> /abort_requests -> drain:
poll `vllm:num_requests_running` + waiting to 0, re-aborting stragglers that were already on the
wire, up to `drain_timeout_s` -> /sleep (which aborts anything left: the forced case). Shards
stay PREEMPTED while asleep; `activate` makes them ACTIVE again after `wake_up_partial` (and a
weight sync, for level 2). Operations on one rank are serialised; different ranks run
concurrently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlix.errors import InvalidRequestError
from rlix.inference.fleet.api import EngineBackend, RouterControl, ShardLauncher
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.inference.router.shard_table import ShardState
from rlix.weights.http_endpoint import HttpShardEndpoint


class LocalLauncher:
    """Shard processes started from this process (tests, single-machine runs)."""

    def __init__(self, backend: EngineBackend, api_key: str, host: str = "127.0.0.1",
                 log_dir: str | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.backend, self.api_key, self.host = backend, api_key, host
        self.log_dir, self.extra_env = log_dir, extra_env
        self.procs: dict[int, ShardProcess] = {}

    async def start(self, rank: int) -> str:
        proc = ShardProcess(self.backend, self.api_key, self.host, log_dir=self.log_dir,
                            extra_env=self.extra_env)
        self.procs[rank] = proc
        proc.start()
        await asyncio.to_thread(proc.wait_ready)
        return proc.url

    async def stop(self, rank: int) -> None:
        proc = self.procs.pop(rank, None)
        if proc is not None:
            await asyncio.to_thread(proc.stop)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if p.pid is not None}


@dataclass
class ShardInfo:
    rank: int
    url: str
    asleep: bool | None = False  # None: not known (a wake inside a failed call); ask the shard
    active: bool = False


class ShardFleet:
    """See module doc."""

    def __init__(self, launcher: ShardLauncher, router: RouterControl, client: RemoteInferenceClient,
                 *, supports_sleep: bool = True, sleep_level: int = 1, drain_timeout_s: float = 5.0,
                 poll_s: float = 0.005, drain_before_sleep: bool = True) -> None:
        self.launcher, self.router, self.client = launcher, router, client
        self.supports_sleep = supports_sleep
        self.sleep_level = sleep_level
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        # False: mark -> sleep(mode=abort) in one call; the engine aborts what is in flight
        # itself and the router re-dispatches it. Two round trips fewer per preemption, which
        # matters when each costs ~100 ms on a saturated CPU; keep True for engines (vLLM) whose
        # sleep should not meet running requests.
        self.drain_before_sleep = drain_before_sleep
        self.shards: dict[int, ShardInfo] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    def _lock(self, rank: int) -> asyncio.Lock:
        return self._locks.setdefault(rank, asyncio.Lock())

    def _known(self, ranks: Iterable[int] | None) -> list[int]:
        ranks = sorted(self.shards) if ranks is None else sorted(set(ranks))
        unknown = [r for r in ranks if r not in self.shards]
        if unknown:
            raise InvalidRequestError(f"unknown DP ranks {unknown}; fleet has {sorted(self.shards)}")
        return ranks

    async def _each(self, ranks: list[int], fn) -> dict[int, Any]:
        async def one(rank: int) -> Any:
            async with self._lock(rank):
                return await fn(rank)
        results = await asyncio.gather(*(one(r) for r in ranks))
        return dict(zip(ranks, results))

    # ------------------------------------------------------------ lifecycle
    async def start(self, ranks: Iterable[int], active: bool = True) -> dict[int, str]:
        """Launch shard processes concurrently and register them with the router."""
        ranks = sorted(set(ranks))
        taken = [r for r in ranks if r in self.shards]
        if taken:
            raise InvalidRequestError(f"DP ranks {taken} already started")

        async def one(rank: int) -> str:
            url = await self.launcher.start(rank)
            self.shards[rank] = ShardInfo(rank, url, active=active)
            self.client.shard_urls[rank] = url
            state = ShardState.ACTIVE if active else ShardState.INACTIVE
            await self.router.set_shard(rank, url, state.value)
            return url

        results = await asyncio.gather(*(one(r) for r in ranks), return_exceptions=True)
        failed = [res for res in results if isinstance(res, BaseException)]
        if failed:  # leave no half-started shard of this call behind
            await self.shutdown(ranks)
            raise failed[0]
        return dict(zip(ranks, results))  # type: ignore[arg-type]

    async def shutdown(self, ranks: Iterable[int] | None = None) -> None:
        """End these shards' processes (default: all) by PID and forget them."""
        ranks = sorted(set(self.shards) | set(self.launcher.pids())) if ranks is None else sorted(ranks)
        for rank in ranks:
            try:
                await self.router.remove_shard(rank)
            except Exception:  # the router may be gone already
                pass
        await asyncio.gather(*(self.launcher.stop(r) for r in ranks))
        for rank in ranks:
            self.shards.pop(rank, None)
            self.client.shard_urls.pop(rank, None)

    # ------------------------------------------------------------ routing state
    async def activate(self, ranks: Iterable[int]) -> None:
        async def one(rank: int) -> None:
            await self.router.set_shard(rank, state=ShardState.ACTIVE.value)
            self.shards[rank].active = True
        await self._each(self._known(ranks), one)

    async def deactivate(self, ranks: Iterable[int]) -> None:
        """No new requests; in-flight ones finish normally."""
        async def one(rank: int) -> None:
            await self.router.set_shard(rank, state=ShardState.INACTIVE.value)
            self.shards[rank].active = False
        await self._each(self._known(ranks), one)

    def active_ranks(self) -> list[int]:
        return sorted(r for r, s in self.shards.items() if s.active)

    # ------------------------------------------------------------ preemption and sleep
    async def sleep_partial(self, ranks: Iterable[int], level: int | None = None) -> dict[int, dict]:
        """Preempt and sleep these shards; per rank, the time of each phase in ms."""
        level = level or self.sleep_level
        return await self._each(self._known(ranks), lambda r: self._preempt(r, level))

    async def _preempt(self, rank: int, level: int) -> dict:
        info = self.shards[rank]
        t0 = time.perf_counter()
        await self.router.set_shard(rank, state=ShardState.PREEMPTED.value)
        info.active = False
        if info.asleep is True:
            return {"already_asleep": True}
        t_mark = time.perf_counter()
        forced = False
        if self.drain_before_sleep or not self.supports_sleep:
            await self.client.abort_requests([rank])
            t_abort = time.perf_counter()
            forced = not await self._drain(rank)
        else:
            t_abort = t_mark
        t_drain = time.perf_counter()
        if self.supports_sleep:
            await self.client.sleep(level, [rank], mode="abort")
        else:  # e.g. vLLM on CPU refuses sleep mode: hold the shard paused instead
            await self.client.pause("abort", [rank])
        info.asleep = True
        t_end = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1000, 3)  # noqa: E731
        return {"mark_ms": ms(t0, t_mark), "abort_ms": ms(t_mark, t_abort), "drain_ms": ms(t_abort, t_drain),
                "sleep_ms": ms(t_drain, t_end), "to_asleep_ms": ms(t0, t_end),
                "before_sleep_ms": ms(t0, t_drain), "forced": forced, "level": level}

    async def _drain(self, rank: int) -> bool:
        """Wait for the shard to hold no request; True if it drained within the timeout."""
        deadline = time.perf_counter() + self.drain_timeout_s
        while True:
            load = (await self.client.load([rank]))[rank]
            if load["running"] + load["waiting"] == 0:
                return True
            if time.perf_counter() >= deadline:
                return False
            await self.client.abort_requests([rank])  # requests that were on the wire at the mark
            await asyncio.sleep(self.poll_s)

    async def wake_up_partial(self, ranks: Iterable[int], tags: list[str] | None = None) -> None:
        """Wake (all tags, or only these) without activating: a weight sync may come first."""
        async def one(rank: int) -> None:
            info = self.shards[rank]
            if info.asleep is False:
                return
            if self.supports_sleep:
                res = (await self.client.wake_up(tags, [rank]))[rank]
                info.asleep = res.get("status") != "awake"
            else:
                await self.client.resume([rank])
                info.asleep = False
        await self._each(self._known(ranks), one)

    def asleep_ranks(self, ranks: Iterable[int]) -> list[int]:
        """Those of `ranks` that sleep (or may: state unknown)."""
        return [r for r in self._known(ranks) if self.shards[r].asleep is not False]

    def note_woken(self, ranks: Iterable[int], woken: bool = True) -> None:
        """Someone else woke these shards (a sync call that wakes first), or tried to and failed
        (`woken=False`: the state is unknown, so the next sleep or wake asks the shard)."""
        for r in self._known(ranks):
            self.shards[r].asleep = False if woken else None

    async def expand(self, ranks: Iterable[int], weights: Mapping[str, Any] | None = None,
                     version: int | None = None) -> None:
        """Wake weights, push `weights` if given (required after a level-2 sleep), wake the KV
        cache, then route to the shards."""
        ranks = self._known(ranks)
        if weights is None:
            await self.wake_up_partial(ranks)
        else:
            await self.wake_up_partial(ranks, ["weights"])
            await asyncio.gather(*(self._push_tensors(r, weights, version) for r in ranks))
            await self.wake_up_partial(ranks, ["kv_cache"])
        await self.activate(ranks)

    async def _push_tensors(self, rank: int, weights: Mapping[str, Any], version: int | None) -> None:
        endpoint = HttpShardEndpoint(self.shards[rank].url, self.client.api_key, f"shard {rank}")
        try:
            await endpoint.push_tensors(weights, version)
        finally:
            await endpoint.aclose()

    async def shrink(self, ranks: Iterable[int]) -> dict[int, dict]:
        return await self.sleep_partial(ranks)
