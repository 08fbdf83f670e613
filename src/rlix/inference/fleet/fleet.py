"""The shard fleet of one pipeline: start, sleep/wake, (de)activate and preempt its shards.

Plain asyncio logic, testable without Ray: shard processes come from a `ShardLauncher` (local
processes in local_launcher.py, Ray actors in actors.py), routing state goes to a
`RouterControl` (the in-process Router or a RouterAdminClient), and shard control goes over
HTTP through `RemoteInferenceClient`, so the backend never matters here.

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
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlix import env
from rlix.devices import DeviceMemory, confirm_release, memory_report
from rlix.errors import GpuMemoryError, InvalidRequestError
from rlix.inference.fleet.api import RouterControl, ShardLauncher
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.shard import Life, Shard
from rlix.inference.fleet.startup import ShardStartup
from rlix.inference.router.shard_table import ShardState
from rlix.weights.http_endpoint import HttpShardEndpoint

log = logging.getLogger("rlix.inference")


@dataclass(frozen=True)
class Placed:
    """What `ShardFleet.place` did: ranks on a new process (serving the weights on disk) and
    ranks that took a resident engine (asleep, serving no known version)."""

    started: list[int]
    resident: list[int]


@dataclass
class ResidentEngine:
    """A started engine process that no rank uses now: asleep on its GPUs, kept so that a rank
    placed there later wakes it instead of starting a process (seconds on a GPU)."""

    key: int
    url: str
    gpus: tuple[int, ...]


class ShardFleet:
    """See module doc."""

    def __init__(self, launcher: ShardLauncher, router: RouterControl, client: RemoteInferenceClient,
                 *, supports_sleep: bool = True, sleep_level: int = 1, drain_timeout_s: float = 5.0,
                 poll_s: float = 0.005, drain_before_sleep: bool = True,
                 release_timeout_s: float | None = None, holder: str = "shard",
                 restart_on_move: bool = True) -> None:
        self.launcher, self.router, self.client = launcher, router, client
        # False: a shard given other GPUs keeps its process (fake GPUs on CPU, where a process
        # sees no GPU and a vLLM server takes a minute to start); it records the new GPUs only
        self.restart_on_move = restart_on_move
        # A preemption must confirm its release (sleep answered, memory measured) within this;
        # else the shard's process is killed: a GPU is never handed on while it may be in use.
        self.release_timeout_s = release_timeout_s
        self.holder = holder  # e.g. "pipeline-a": errors name "shard 0 of pipeline-a"
        self.memory_log: list[dict] = []  # release confirmations: what each shard still held
        self.placements: list[dict] = []  # every process start: rank, GPUs, pid, what it sees
        self.supports_sleep = supports_sleep
        self.sleep_level = sleep_level
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        # False: mark -> sleep(mode=abort) in one call; the engine aborts what is in flight
        # itself and the router re-dispatches it. Two round trips fewer per preemption, which
        # matters where round trips are slow (a saturated CPU); keep True for engines (vLLM) whose
        # sleep should not meet running requests.
        self.drain_before_sleep = drain_before_sleep
        self.shards: dict[int, Shard] = {}  # the one record of each rank's state (shard.py)
        self._routed: dict[int, ShardState] = {}  # what the router was last told of each rank
        # placed fleets: processes no rank uses now, asleep where they run (by launcher key)
        self.resident: dict[int, ResidentEngine] = {}
        # background starts of resident engines (`prestart_later`), by the GPUs they start on
        self._starting: dict[tuple[int, ...], asyncio.Task[ResidentEngine]] = {}
        self._keys = 0  # launcher keys of placed processes: never reused within the fleet
        # processes started once the pipeline's set-up is done (`setup_done`): a death, or a GPU
        # where it had no resident engine
        self.starts_after_setup = 0
        self.setup_done = False
        self._need_bytes: dict[int, int] = {}  # per rank: the most a sleep of it freed (its size)
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
            shard = self.shards[rank] = Shard(rank, url, Life.ACTIVE if active else Life.INACTIVE)
            self.client.shard_urls[rank] = url
            await self.router.set_shard(rank, url, shard.routing.value)
            self._routed[rank] = shard.routing
            return url

        results = await asyncio.gather(*(one(r) for r in ranks), return_exceptions=True)
        failed = [res for res in results if isinstance(res, BaseException)]
        if failed:  # leave no half-started shard of this call behind
            await self.shutdown(ranks)
            raise failed[0]
        return dict(zip(ranks, results))  # type: ignore[arg-type]

    async def shutdown(self, ranks: Iterable[int] | None = None) -> None:
        """End these shards' processes (default: all, resident ones included) by PID and forget
        them."""
        if ranks is not None:
            await asyncio.gather(*(self.kill(r) for r in sorted(ranks)))
            return
        await self._settle_starts()
        await asyncio.gather(*(self.kill(r) for r in sorted(self.shards)))
        self.resident.clear()
        # whatever else the launcher still runs (a start that raced a failure)
        await asyncio.gather(*(self.launcher.stop(k) for k in sorted(self.launcher.pids())))

    def _new_key(self) -> int:
        self._keys += 1
        return self._keys - 1

    def _distinct(self, gpu_sets: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
        """The sets not already served by a process of this fleet (bound, resident or starting),
        one per group of sets that see the same devices."""
        have = [i.gpus for i in self.shards.values()] + [e.gpus for e in self.resident.values()] \
            + list(self._starting)
        wanted: list[tuple[int, ...]] = []
        for gpus in gpu_sets:
            want = tuple(int(g) for g in gpus)
            if want and not any(w == want or self._sees_the_same(w, want) for w in have + wanted):
                wanted.append(want)
        return wanted

    async def _start_resident(self, gpus: tuple[int, ...], level: int | None) -> ResidentEngine:
        """One engine process on `gpus`, put to sleep at once: no rank uses it yet, and its GPU
        is not its own until one is placed there."""
        key = self._new_key()
        url = await self.launcher.start(key, gpus)
        engine = ResidentEngine(key, url, gpus)
        self.resident[key] = engine
        self.placements.append({"rank": None, "gpus": list(gpus), "at": time.time(), "resident": True,
                                **self._process_info(key)})
        if self.supports_sleep:
            one_shard = self.client.with_shards({key: url})
            try:
                await one_shard.sleep(level or self.sleep_level, [key])
            finally:
                await one_shard.aclose()
        return engine

    async def prestart(self, gpu_sets: Iterable[Sequence[int]], level: int | None = None,
                       background: Iterable[Sequence[int]] = ()) -> list[ResidentEngine]:
        """Start an engine process on each GPU set at once and put each to sleep: resident
        engines that ranks placed there later wake instead of starting (as standalone mode
        starts its shards during set-up). Sets that see the same devices as another get one
        process. A failed start ends them all and raises. `background`: sets started once
        these are up and not waited for (`prestart_later`, which leaves a set that sees the
        devices of one started here to it). Not beside them: every pipeline's engines starting at once
        slowed every set-up, the trainers' too (docs/BENCHMARKS.md); a rank placed on one still
        starting does not hold up the others (`ShardCoordinator.resize_inference`)."""
        results = await asyncio.gather(*(self._start_resident(g, level) for g in self._distinct(gpu_sets)),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.shutdown()
            raise failed[0]
        self.prestart_later(background, level)
        return list(results)  # type: ignore[arg-type]

    def prestart_later(self, gpu_sets: Iterable[Sequence[int]], level: int | None = None) -> None:
        """Start resident engines on these sets in the background: set-up does not wait for
        them. A rank placed on one of them while it starts waits for that start (never a second
        process); a start that fails is logged and forgotten (a rank placed there starts one)."""
        for gpus in self._distinct(gpu_sets):
            self._starting[gpus] = asyncio.ensure_future(self._start_resident(gpus, level))

    def starting_on(self, gpus: Sequence[int]) -> bool:
        """A background start of the engine a process on `gpus` would be is still under way
        (a rank placed there waits for it)."""
        want = tuple(int(g) for g in gpus)
        return bool(want) and any(not task.done() and (key == want or self._sees_the_same(key, want))
                                  for key, task in self._starting.items())

    async def _started_on(self, gpus: tuple[int, ...]) -> None:
        """Wait for a background start of an engine that a process on `gpus` would be, if any."""
        for key, task in list(self._starting.items()):
            if key == gpus or self._sees_the_same(key, gpus):
                try:
                    await asyncio.shield(task)
                except Exception as exc:  # noqa: BLE001 - the rank starts a process of its own
                    log.warning("%s: the engine started in the background on GPU %s failed: %s",
                                self.holder, ",".join(map(str, key)), exc)
                self._starting.pop(key, None)

    async def _settle_starts(self) -> None:
        """Every background start ended (done or cancelled), its process left to shutdown."""
        tasks = list(self._starting.values())
        self._starting.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def place(self, gpus_of: Mapping[int, Sequence[int]]) -> Placed:
        """Make each rank's process run on its GPUs, seeing only them. A rank that must move
        leaves its process resident where it was (asleep) and takes the resident engine on its
        new GPUs if there is one, or the sleeping engine of a rank not placed now (a wake, not a
        start: `_hand_over`); only where neither is does a process start (the costliest move:
        model load and graph capture). A move that changes nothing the process sees (another slice of the
        same GPU, `cluster.gpu_slices`) keeps the process. A rank bound to another process is
        INACTIVE; a new process serves the weights on disk, a resident one is asleep. Returns the
        ranks that got a new process and those that took a resident one."""
        async def one(rank: int) -> str | None:
            want = tuple(int(g) for g in gpus_of[rank])
            info = self.shards.get(rank)
            if info is not None and info.gpus == want:
                return None
            if info is not None and (not self.restart_on_move or self._sees_the_same(info.gpus, want)):
                info.gpus = want
                return None
            if info is not None:  # asleep (nothing in flight is lost): its process stays resident
                await self._unbind(rank)
            await self._started_on(want)
            engine = self._resident_on(want)
            if engine is None:
                engine = await self._hand_over(want, placing)
            how = "resident"
            if engine is not None:
                del self.resident[engine.key]
                self.shards[rank] = Shard(rank, engine.url, Life.ASLEEP, gpus=want, proc=engine.key)
            else:
                how = "started"
                key = self._new_key()
                url = await self.launcher.start(key, want)
                self.shards[rank] = Shard(rank, url, Life.INACTIVE, gpus=want, proc=key)
                if self.setup_done:
                    self.starts_after_setup += 1
                self.placements.append({"rank": rank, "gpus": list(want), "at": time.time(),
                                        **self._process_info(key)})
            self.client.shard_urls[rank] = self.shards[rank].url
            await self.router.set_shard(rank, self.shards[rank].url, self.shards[rank].routing.value)
            self._routed[rank] = self.shards[rank].routing
            return how
        placing = {int(r) for r in gpus_of}
        how = await self._each(sorted(placing), one)
        return Placed(started=sorted(r for r, h in how.items() if h == "started"),
                      resident=sorted(r for r, h in how.items() if h == "resident"))

    async def _hand_over(self, gpus: tuple[int, ...], placing: set[int]) -> ResidentEngine | None:
        """The engine of another rank of this pipeline that sleeps on `gpus` and is not being
        placed now, unbound from it and made resident: dp ranks are labels, and any engine of
        the pipeline serves any of them after a wake and sync. Without this, a plan that put
        rank 1 where rank 0 had just been put to sleep started a second process on that GPU
        (a process start is seconds, and slows the GPU's holder meanwhile)."""
        for rank, info in list(self.shards.items()):
            if rank in placing or info.state is not Life.ASLEEP or not self.supports_sleep:
                continue
            if info.gpus == gpus or self._sees_the_same(info.gpus, gpus):
                await self._unbind(rank)
                return self._resident_on(gpus)
        return None

    def _resident_on(self, gpus: tuple[int, ...]) -> ResidentEngine | None:
        """A resident engine whose process sees what a process placed on `gpus` would."""
        for engine in self.resident.values():
            if engine.gpus == gpus or self._sees_the_same(engine.gpus, gpus):
                return engine
        return None

    async def _unbind(self, rank: int) -> None:
        """The rank leaves its process, which stays resident (asleep) where it runs; a process
        whose sleep is not confirmed is ended instead (it may hold the GPU)."""
        info = self.shards.pop(rank)
        self._routed.pop(rank, None)
        self.client.shard_urls.pop(rank, None)
        try:
            await self.router.remove_shard(rank)
        except Exception:  # noqa: BLE001 - the router may be gone already
            pass
        if info.state is Life.ASLEEP and self.supports_sleep:
            self.resident[info.key] = ResidentEngine(info.key, info.url, info.gpus)
        else:
            await self.launcher.stop(info.key)

    def pids(self) -> dict[int, int]:
        """Each rank's process (its guard's PID)."""
        pids = self.launcher.pids()
        return {r: pids[i.key] for r, i in self.shards.items() if i.key in pids}

    def startup(self) -> list[ShardStartup]:
        """Start-up of each process the launcher runs (by launcher key), for progress reports."""
        return self.launcher.startup()

    def server_pids(self) -> dict[int, int]:
        """Each rank's server process (under its guard), where the launcher knows it."""
        server_pids = getattr(self.launcher, "server_pids", None)
        pids = server_pids() if server_pids is not None else {}
        return {r: pids[i.key] for r, i in self.shards.items() if i.key in pids}

    def resident_pids(self) -> dict[int, int]:
        """The resident engines' guard PIDs, by launcher key."""
        pids = self.launcher.pids()
        return {k: pids[k] for k in self.resident if k in pids}

    def exit_code(self, rank: int) -> int | None:
        fn = getattr(self.launcher, "exit_code", None)
        info = self.shards.get(rank)
        return fn(info.key) if fn is not None and info is not None else None

    def log_tail(self, rank: int) -> str:
        fn = getattr(self.launcher, "log_tail", None)
        info = self.shards.get(rank)
        return fn(info.key) if fn is not None and info is not None else ""

    def _process_info(self, key: int) -> dict:
        """Where a process runs, read from the process (its node's launcher asks there)."""
        info = getattr(self.launcher, "process_info", None)
        if info is not None:
            return info(key)
        pid = self.launcher.pids().get(key)
        return {"pid": pid, "visible_devices": env.process_visible_devices(pid) if pid else None,
                "memory_share": env.process_env(pid, env.GPU_MEMORY_SHARE_VAR) if pid else None}

    def node_of(self, rank: int) -> str | None:
        """The Ray node a rank's process runs on, where the launcher knows (None: this one)."""
        fn = getattr(self.launcher, "node_of_rank", None)
        info = self.shards.get(rank)
        return fn(info.key if info is not None else rank) if fn is not None else None

    def _sees_the_same(self, old: Sequence[int], new: Sequence[int]) -> bool:
        """A process placed on `old` would be started on `new` with the same environment."""
        placement = getattr(self.launcher, "placement", None)
        return placement is not None and bool(old) and placement(tuple(old)) == placement(tuple(new))

    async def kill(self, rank: int) -> None:
        """End one shard's process by its PID and forget it."""
        try:
            await self.router.remove_shard(rank)
        except Exception:  # noqa: BLE001 - the router may be gone already
            pass
        info = self.shards.pop(rank, None)
        self._routed.pop(rank, None)
        await self.launcher.stop(info.key if info is not None else rank)
        self.client.shard_urls.pop(rank, None)

    async def dead_ranks(self) -> list[int]:
        """Shards of this fleet whose process has exited (killed, crashed): the coordinator
        replaces them. A resident engine that died is ended and forgotten here (no rank used it:
        a later placement starts a process where it was)."""
        dead = set(await self.launcher.dead_ranks())
        for key in sorted(dead & set(self.resident)):
            del self.resident[key]
            await self.launcher.stop(key)
        return sorted(r for r, i in self.shards.items() if i.key in dead)

    async def confirm_dead(self, ranks: Iterable[int], within_s: float = 1.0) -> list[int]:
        """Those of `ranks` whose process is gone, waiting up to `within_s` for the exit to show
        (a call can fail on a server's closed socket a moment before its process is reaped)."""
        ranks = set(ranks)
        deadline = time.monotonic() + within_s
        while True:
            dead = [r for r in await self.dead_ranks() if r in ranks]
            if dead or time.monotonic() >= deadline:
                return dead
            await asyncio.sleep(0.05)

    def describe(self, rank: int) -> str:
        """How errors name a shard: its rank, pipeline and GPUs."""
        info = self.shards.get(rank)
        where = f" on GPU {','.join(map(str, info.gpus))}" if info is not None and info.gpus else ""
        return f"shard {rank} of {self.holder}{where}"

    # ------------------------------------------------------------ routing state
    async def _enter(self, rank: int, state: Life) -> Shard:
        """A shard's state changed by the fleet's own act: checked against the state machine,
        then the router told what it may route to it, if that differs from what it was last
        told. (Wakes change the state without a router call: a woken shard stays unrouted,
        as PREEMPTED, until it is activated.)"""
        shard = self.shards[rank]
        shard.enter(state)
        if self._routed.get(rank) is not shard.routing:
            await self.router.set_shard(rank, state=shard.routing.value)
            self._routed[rank] = shard.routing
        return shard

    async def activate(self, ranks: Iterable[int]) -> None:
        """Route to these awake shards."""
        await self._each(self._known(ranks), lambda r: self._enter(r, Life.ACTIVE))

    async def deactivate(self, ranks: Iterable[int]) -> None:
        """No new requests; in-flight ones finish normally."""
        await self._each(self._known(ranks), lambda r: self._enter(r, Life.INACTIVE))

    def active_ranks(self) -> list[int]:
        return sorted(r for r, s in self.shards.items() if s.active)

    # ------------------------------------------------------------ preemption and sleep
    async def sleep_partial(self, ranks: Iterable[int], level: int | None = None) -> dict[int, dict]:
        """Preempt and sleep these shards; per rank, the time of each phase in ms. A shard that
        does not answer within `release_timeout_s` is hung: it is killed by its PID and
        forgotten, like a dead one (answer `{"died": True, "hung": why}`; its rank starts anew
        when it is given GPUs again). One that answers but leaves its GPU short of memory is
        killed, and GpuMemoryError names it. Its GPU is free either way afterwards."""
        level = level or self.sleep_level
        return await self._each(self._known(ranks), lambda r: self._release(r, level))

    async def _release(self, rank: int, level: int) -> dict:
        name = self.describe(rank)
        try:
            if self.release_timeout_s is None:
                phases = await self._preempt(rank, level)
            else:
                phases = await asyncio.wait_for(self._preempt(rank, level), self.release_timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever stopped the release, the GPU is freed
            if await self.confirm_dead([rank]):
                # its process is gone, and with it everything it held: released. The
                # coordinator finds it dead and replaces or forgets it
                self.shards[rank].enter(Life.DOWN)
                self.memory_log.append({"event": "release", "holder": name, "at": time.time(),
                                        "gpus": list(self.shards[rank].gpus), "died": True})
                return {"died": True, "level": level}
            if isinstance(exc, asyncio.TimeoutError):
                return await self._kill_hung(rank, level, f"did not confirm its release within "
                                                          f"{self.release_timeout_s:g} s")
            if not self.shards[rank].gpus:
                raise  # not placed on a GPU: nothing to free, the caller sees the error itself
            raise await self.kill_for(rank, f"failed to release it ({exc})") from None
        memory = phases.get("memory")
        if memory:
            self.memory_log.append({"event": "release", "holder": name, "gpus": list(self.shards[rank].gpus),
                                    **memory})
            if self.shards[rank].gpus:
                await self._confirm_release(rank, level, memory)
        return phases

    async def _confirm_release(self, rank: int, level: int, memory: dict) -> None:
        """A sleeping shard's residue (a resident engine keeps its CUDA context and graph pool)
        is tolerated while its GPU has room for what the shard just freed, i.e. for a holder of
        its size; a shortfall is measured again (a repeated sleep frees and measures) and only a
        lasting one kills the shard, with the bytes named."""
        info = self.shards[rank]
        need = max(int(memory.get("freed_bytes") or 0), self._need_bytes.get(rank, 0))
        self._need_bytes[rank] = need
        gpu = ",".join(map(str, info.gpus))

        async def remeasure() -> DeviceMemory:
            answer = (await self.client.sleep(level, [rank], mode="abort"))[rank]
            return memory_report(answer.get("memory") or {})

        try:
            await confirm_release(memory_report(memory), remeasure, holder=self.describe(rank), gpu=gpu,
                                  need_bytes=need)
        except GpuMemoryError as exc:
            raise await self.kill_for(rank, f"left its GPU short after sleeping at level {level}: {exc}") from None

    async def _kill_hung(self, rank: int, level: int, why: str) -> dict:
        """A shard that stopped answering (frozen, deadlocked) is ended by its PID, which frees
        its GPU, and forgotten: a hang is handled like a death, not as the pipeline's failure."""
        pid = self.server_pids().get(rank) or self.pids().get(rank)
        name = self.describe(rank)
        gpus = list(self.shards[rank].gpus)
        await self.kill(rank)
        what = f"{name} (pid {pid}) {why}: hung, killed"
        log.warning("%s", what)
        self.memory_log.append({"event": "release", "holder": name, "at": time.time(), "gpus": gpus,
                                "died": True, "hung": what})
        return {"died": True, "hung": what, "pid": pid, "level": level}

    async def kill_for(self, rank: int, why: str) -> GpuMemoryError:
        """A shard failed its GPU hand-off: end its process by PID (its GPU is then free) and
        return the error that names it, its GPU and what went wrong."""
        pid = self.server_pids().get(rank) or self.pids().get(rank)  # the server under its guard
        name = self.describe(rank)
        await self.kill(rank)
        return GpuMemoryError(f"{name} {why}; its process (pid {pid}) was killed to free the GPU")

    async def _preempt(self, rank: int, level: int) -> dict:
        t0 = time.perf_counter()
        was = self.shards[rank].state
        await self._enter(rank, Life.PREEMPTING)  # the router: no new requests, re-dispatch cut ones
        if was is Life.ASLEEP:
            self.shards[rank].enter(Life.ASLEEP)
            return {"already_asleep": True}
        t_mark = time.perf_counter()
        forced = False
        try:
            if self.drain_before_sleep or not self.supports_sleep:
                await self.client.abort_requests([rank])
                t_abort = time.perf_counter()
                forced = not await self._drain(rank)
            else:
                t_abort = t_mark
            t_drain = time.perf_counter()
            answer: Any = {}
            if self.supports_sleep:
                answer = (await self.client.sleep(level, [rank], mode="abort"))[rank]
            else:  # e.g. vLLM on CPU refuses sleep mode: hold the shard paused instead
                await self.client.pause("abort", [rank])
        except BaseException:
            self.shards[rank].enter(Life.UNKNOWN)  # asleep or not: the next call asks it
            raise
        self.shards[rank].enter(Life.ASLEEP)
        t_end = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1000, 3)  # noqa: E731
        return {"mark_ms": ms(t0, t_mark), "abort_ms": ms(t_mark, t_abort), "drain_ms": ms(t_abort, t_drain),
                "sleep_ms": ms(t_drain, t_end), "to_asleep_ms": ms(t0, t_end),
                "before_sleep_ms": ms(t0, t_drain), "forced": forced, "level": level,
                "memory": answer.get("memory") if isinstance(answer, dict) else None}

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
            shard = self.shards[rank]
            if shard.awake:
                return
            shard.enter(Life.WAKING)
            try:
                if self.supports_sleep:
                    res = (await self.client.wake_up(tags, [rank]))[rank]
                    awake = res.get("status") == "awake"  # some tags only: still asleep
                else:
                    await self.client.resume([rank])
                    awake = True
            except BaseException:
                shard.enter(Life.UNKNOWN)
                raise
            shard.enter(Life.INACTIVE if awake else Life.ASLEEP)
        await self._each(self._known(ranks), one)

    def asleep_ranks(self, ranks: Iterable[int]) -> list[int]:
        """Those of `ranks` that sleep (or may: state unknown)."""
        return [r for r in self._known(ranks) if not self.shards[r].awake]

    def note_woken(self, ranks: Iterable[int], woken: bool = True) -> None:
        """Someone else woke these shards (a sync call that wakes first), or tried to and failed
        (`woken=False`: the state is unknown, so the next sleep or wake asks the shard)."""
        for r in self._known(ranks):
            if woken and self.shards[r].awake:
                continue
            self.shards[r].enter(Life.INACTIVE if woken else Life.UNKNOWN)

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
