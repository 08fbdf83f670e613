"""A pipeline's shards as the scheduler moves them, and the weights they serve.

`ShardCoordinator` is what the scheduler's `resize_inference(remove, add)` lands on: the shards
it loses are preempted and put to sleep (mark -> abort -> drain -> sleep, in ShardFleet); the
shards it gains are woken, synced to the newest published weight version if theirs is older,
and only then routed to. After each training step `publish(version)` gives the shards that
stayed active the new version in flight: pause(keep) -> selective sync -> resume, so running
requests continue on the new weights and none is lost.

Every sync is a refit by the pipeline's weight path (rlix.weights.refit), one call per shard,
and is checked: the shard itself reports the version it serves in its answer, and the
coordinator keeps each shard's version history, so tests can prove that a shard only ever
served versions it was synced to.

With `wake_in_sync` (engines that offer /sync_weights), a stale shard that wakes is woken by
its refit call: one round trip instead of a wake and then a refit.

A shard whose process dies (`replace_dead`, polled by the pipeline) is forgotten; if the
scheduler had it on GPUs, a new process is started there, synced to the latest version and
routed to again, so the pipeline goes on. One that keeps dying fails the pipeline.

On GPUs, the shards that slept on the trainer's GPUs can get the new version before the trainer
offloads (`sync_beside_trainer`): each trainer rank's GPU copy goes to the shard on its GPU by
CUDA IPC, waking only the shard's weights (its KV cache stays asleep: the GPU is still the
trainer's). When the scheduler then gives such a shard the GPU, its wake is just the KV cache;
when it gives the GPU elsewhere, `cool` drops those weights again.

A scheduler that restarted does not know which of its last resize calls got here; it calls
`reassert(shards)` with what its ledger says, and the coordinator (once those calls are done)
sleeps or wakes only the difference.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlix.errors import GpuMemoryError, RlixError, ShardDiedError
from rlix.inference.fleet.fleet import ShardFleet
from rlix.pipeline.weight_audit import engine_checksums, mismatches
from rlix.weights.api import ShardTarget, SyncReport
from rlix.weights.vllm.names import Digest

log = logging.getLogger("rlix.pipeline")


class Refit(Protocol):
    """What the coordinator needs of the weight path (rlix.weights.refit.WeightPath): move
    these shards to a published version, waking those in `wake` inside their call; the report's
    `reported` holds the version each shard answered serving."""

    async def refit(self, version: int, targets: Mapping[int, ShardTarget],
                    wake: Collection[int] = ()) -> SyncReport: ...


@dataclass
class ShardEvent:
    at: float
    kind: str  # start | rebind | sleep | wake | sync | refit | device_sync | cool | activate | audit | died | replace
    ranks: tuple[int, ...]
    version: int | None = None
    seconds: float = 0.0


@dataclass
class CoordinatorStats:
    events: list[ShardEvent] = field(default_factory=list)
    sync_seconds: float = 0.0
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    version_mismatches: list[str] = field(default_factory=list)
    checksum_checks: int = 0  # shard syncs audited (audit: checksums compared with the trainer's)
    audit_seconds: float = 0.0  # what the shard audits took (before activation: on the path)
    checksum_mismatches: list[str] = field(default_factory=list)
    sleep_phases_ms: dict[str, float] = field(default_factory=dict)  # preemption phases, summed
    deaths: list[dict] = field(default_factory=list)  # shard processes found dead
    replacements: list[dict] = field(default_factory=list)  # new processes for dead assigned shards
    # per sync beside the trainer: its slowest shard's call, timed by the sender (its
    # `device_sync` event adds the hops to the trainer ranks)
    device_sync_calls_s: list[float] = field(default_factory=list)
    #: per sync beside the trainer: {rank: the shard's own phases (ms)}
    device_sync_phases_ms: list[dict[int, dict[str, float]]] = field(default_factory=list)


class ShardCoordinator:
    """See module doc. `weights.refit(version, targets, wake)` moves shards to a published
    version. `beside_trainer`: the trainer keeps a GPU copy of each version until its offload,
    and the shards asleep on its GPUs are refitted from it (`sync_beside_trainer`)."""

    def __init__(self, fleet: ShardFleet, weights: Refit, *, initial_version: int = 0,
                 wake_in_sync: bool = False, placed: bool = False,
                 audit: Callable[[int], Awaitable[Mapping[str, int | Digest]]] | None = None,
                 served_checksums: Callable[[ShardFleet, list[int]], Awaitable[dict[int, dict]]] | None = None,
                 max_restarts: int = 3, beside_trainer: bool = False) -> None:
        self.fleet = fleet
        self.weights = weights
        self.beside_trainer = beside_trainer
        self.homes: dict[int, tuple[int, ...]] = {}  # rank -> the GPUs it was last given
        self.warm: set[int] = set()  # asleep, but holding the latest weights on their GPU
        # placed: each shard's process runs on the GPUs the scheduler names in `add` and is
        # started (or moved) there on demand; level-2 sleeps drop its weights
        self.placed = placed
        # audit(version) -> the trainer's per-tensor checksums of it: every synced shard's
        # served weights are compared with them (costs a pass over the weights on both sides)
        self._audit = audit
        # what the shards say they serve, in the audit's terms (default: rlix's engine server)
        self._served_checksums = served_checksums or engine_checksums
        self.failure: RlixError | None = None  # a GPU hand-off failed, a shard kept dying: the pipeline must end
        self.max_restarts = max_restarts  # replacements of one rank's process before the pipeline fails
        # rank -> GPUs: the shards the scheduler (or the fixed mode) last gave GPUs and has not
        # taken back; a dead one of these is replaced, any other dead one just forgotten
        self.assigned: dict[int, tuple[int, ...]] = {}
        self.failed = asyncio.Event()
        self.wake_in_sync = wake_in_sync and fleet.supports_sleep
        self.initial_version = initial_version  # what a shard process started from disk serves
        self.latest = initial_version  # newest version the trainer has published
        self.published: set[int] = {initial_version}
        self.versions: dict[int, int | None] = {}  # rank -> version it serves (None: no weights)
        self.history: dict[int, list[int]] = {}  # rank -> every version it was synced to, in order
        self.stats = CoordinatorStats()
        self._lock = asyncio.Lock()  # resize and publish never interleave
        self._resizing = 0  # resize calls in flight (a re-assertion waits for them)
        self._no_resize = asyncio.Event()
        self._no_resize.set()

    def _event(self, kind: str, ranks: Iterable[int], version: int | None = None, seconds: float = 0.0) -> None:
        self.stats.events.append(ShardEvent(time.time(), kind, tuple(sorted(ranks)), version, seconds))

    async def start(self, ranks: list[int], version: int, active: bool = False) -> None:
        """Start shard processes serving `version` (the weights they load from disk)."""
        await self.fleet.start(ranks, active=active)
        for r in ranks:
            self.versions[r] = version
            self.history[r] = [version]
        self._event("start", ranks, version)

    async def quiesce(self) -> None:
        """Until no resize or publish is in progress (a wake's sync and its audit included):
        what a finished pipeline waits for before its summary counts the syncs."""
        async with self._lock:
            pass

    def active_ranks(self) -> list[int]:
        return self.fleet.active_ranks()

    def fail(self, exc: RlixError) -> RlixError:
        """Something the pipeline cannot go on without broke (its trainer died): the loop,
        which races every step against `failed`, ends with `exc`."""
        return self._fail(exc)

    def _fail(self, exc: RlixError) -> RlixError:
        if self.failure is None:
            self.failure = exc
            self.failed.set()
            log.error("%s", exc)
        return exc

    async def resize_inference(self, remove: list[int], add: Mapping[int, Any]) -> dict:
        """The scheduler's call: sleep `remove`, then wake + sync + activate `add`. A failed GPU
        hand-off (GpuMemoryError) ends the pipeline: it is kept in `failure` and raised."""
        self._resizing += 1
        self._no_resize.clear()
        try:
            starting = {r: g for r, g in add.items()
                        if self.placed and self.fleet.starting_on(tuple(int(x) for x in g or ()))}
            if not starting or len(starting) == len(add):
                return await self._resize(remove, add)
            # ranks placed where their engine is up are woken and routed to now; those placed on
            # an engine still starting in the background follow when it is up (together, the
            # ranks that could generate at once waited seconds for the slowest start)
            out = await self._resize(remove, {r: g for r, g in add.items() if r not in starting})
            late = await self._resize([], starting)
            return {**late, **out, "woke": out.get("woke", []) + late.get("woke", [])}
        except GpuMemoryError as exc:
            raise self._fail(exc) from None
        finally:
            self._resizing -= 1
            if not self._resizing:
                self._no_resize.set()

    async def reassert(self, shards: Mapping[int, Any], wake: bool = True) -> dict:
        """A restarted scheduler's call: the awake shards become `shards` (rank -> GPUs). The
        calls of the scheduler's old instance may still be running here: they finish first.
        Then every rank not named that is or may be awake (or was given GPUs) is put to sleep,
        and with `wake` every rank named that is not already on those GPUs is woken there (one
        that is, active or being replaced by `replace_dead`, is left alone). Repeating it
        changes nothing."""
        while not self._no_resize.is_set():
            await self._no_resize.wait()
        want = {int(r): tuple(int(g) for g in gpus or ()) for r, gpus in shards.items()}
        add = {r: list(g) for r, g in want.items() if wake and self.assigned.get(r) != g}
        awake = {r for r, info in self.fleet.shards.items() if info.active or info.asleep is not True}
        remove = sorted((set(self.assigned) | awake) - set(want))
        if not add and not remove:
            return {"unchanged": sorted(want)}
        log.warning("%s: the restarted scheduler re-asserts shards %s: sleep %s, wake %s",
                    self.fleet.holder, sorted(want), remove, sorted(add))
        out = await self.resize_inference(remove, add)
        return {**out, "reasserted": {"remove": remove, "add": sorted(add)}}

    async def _resize(self, remove: list[int], add: Mapping[int, Any]) -> dict:
        place_first = self.placed and bool(add) and not remove
        if place_first:
            # a process start takes seconds: outside the lock, so a refit of the active shards
            # (the loop's step waits for it) does not wait behind it; the ranks are inactive
            await self._place(add)
        async with self._lock:
            out: dict[str, Any] = {}
            for r in remove:
                self.assigned.pop(int(r), None)
                self.warm.discard(int(r))  # its sleep below drops whatever it holds
            for r, gpus in add.items():
                self.assigned[int(r)] = self.homes[int(r)] = tuple(int(g) for g in gpus or ())
                self.warm.discard(int(r))
            remove = [r for r in remove if r in self.fleet.shards]  # a dead one has no process to sleep
            if remove:
                t0 = time.perf_counter()
                out["slept"] = await self.fleet.sleep_partial(remove)
                dt = time.perf_counter() - t0
                self.stats.sleep_seconds += dt
                for phases in out["slept"].values():
                    for k in ("mark_ms", "abort_ms", "drain_ms", "sleep_ms"):
                        self.stats.sleep_phases_ms[k] = self.stats.sleep_phases_ms.get(k, 0.0) + phases.get(k, 0.0)
                self._event("sleep", remove, seconds=dt)
                if self.fleet.sleep_level >= 2:  # weights dropped: a wake must sync them
                    for r in remove:
                        self.versions[r] = None
                for r, phases in out["slept"].items():
                    if phases.get("hung"):  # killed and forgotten by the fleet: a death
                        self._hung(int(r), phases["hung"], phases.get("pid"))
            if add:
                ranks = sorted(int(r) for r in add)
                await self._drop_dead()  # a process that died asleep cannot be woken
                if self.placed:  # after the sleeps of the same call (again: dropped ones)
                    gpus_of = {int(r): g for r, g in add.items()}
                    await self._place({r: gpus_of[r] for r in ranks
                                       if not place_first or r not in self.fleet.shards})
                missing = [r for r in ranks if r not in self.fleet.shards]
                if missing:  # unplaced, and its process died while it slept: start a new one
                    await self._start_new(missing)
                limit = self.fleet.release_timeout_s if self.placed else None
                try:
                    await asyncio.wait_for(self._bring_up(ranks), limit)
                except asyncio.TimeoutError:
                    # a shard that no longer answers is hung: killed and started again like a
                    # dead one, then the wake is tried once more; one that answers but is slow,
                    # or a second timeout, is a failed hand-off
                    hung = await self._unanswering(ranks)
                    if not hung:
                        raise await self._end(ranks, f"did not wake and sync within {limit:g} s") from None
                    await self._replace_hung(hung, f"did not wake and sync within {limit:g} s")
                    try:
                        await asyncio.wait_for(self._bring_up(ranks), limit)
                    except asyncio.TimeoutError:
                        raise await self._end(ranks, f"did not wake and sync within {limit:g} s, "
                                                     f"after its hung shards {hung} were replaced") from None
                await self.fleet.activate(ranks)
                self._event("activate", ranks, self.latest)
                out["woke"] = ranks
            return out

    async def _unanswering(self, ranks: list[int], within_s: float = 1.0) -> list[int]:
        """Those of `ranks` whose server does not answer a state query within `within_s`."""
        async def silent(r: int) -> bool:
            try:
                await asyncio.wait_for(self.fleet.client.is_sleeping([r]), within_s)
                return False
            except Exception:  # noqa: BLE001 - no answer, or a broken one: not serving
                return True
        flags = await asyncio.gather(*(silent(r) for r in ranks))
        return [r for r, bad in zip(ranks, flags) if bad]

    async def _replace_hung(self, ranks: list[int], why: str) -> None:
        """(Under the lock.) Hung shards are ended by their PIDs, recorded as deaths, and
        started again on the GPUs they were given (resident engines elsewhere stay)."""
        for r in ranks:
            pid = self.fleet.server_pids().get(r) or self.fleet.pids().get(r)
            what = f"{self.fleet.describe(r)} (pid {pid}) {why}: hung, killed"
            await self.fleet.kill(r)
            self._hung(r, what, pid)
        if self.placed:
            await self._place({r: self.assigned[r] for r in ranks if r in self.assigned})
        else:
            await self._start_new(ranks)

    def _hung(self, rank: int, what: str, pid: int | None) -> None:
        """A shard killed for not answering: recorded as a death (counted against
        `max_restarts`, like any other), its weights of no known version."""
        log.warning("%s", what)
        self.versions.pop(rank, None)
        self.stats.deaths.append({"rank": rank, "pid": pid, "exit_code": None, "at": time.time(),
                                  "assigned": rank in self.assigned, "what": what, "hung": True})
        self._event("died", [rank])
        if len([d for d in self.stats.deaths if d["rank"] == rank]) > self.max_restarts:
            raise self._fail(ShardDiedError(f"{what}, more than {self.max_restarts} times; "
                                            f"the pipeline stops"))

    async def _end(self, ranks: list[int], why: str) -> GpuMemoryError:
        """These shards failed a GPU hand-off: each is ended by its PID; one error names all."""
        errors = [await self.fleet.kill_for(r, why) for r in ranks]
        return errors[0] if len(errors) == 1 else GpuMemoryError("; ".join(map(str, errors)))

    async def _place(self, add: Mapping[int, Any]) -> None:
        """(Under the lock.) Dead processes are recorded and dropped first: placing would
        otherwise restart (or, where moves keep the process, keep) a dead one unnoticed."""
        await self._drop_dead()
        placed = await self.fleet.place({int(r): gpus for r, gpus in add.items()})
        for r in placed.started:
            # a new process serves the weights on disk: the initial version
            self.versions[r] = self.initial_version
            if not self.history.get(r):
                self.history[r] = [self.initial_version]
            self._event("start", [r], self.initial_version)
        for r in placed.resident:  # asleep, its weights dropped or of no known version: synced at wake
            self.versions[r] = None
            self.history.setdefault(r, [])
            self._event("rebind", [r])

    async def _start_new(self, ranks: list[int]) -> None:
        """New processes for unplaced ranks; inactive, serving the weights on disk."""
        await self.fleet.start(ranks, active=False)
        for r in ranks:
            self.versions[r] = self.initial_version
            self.history.setdefault(r, []).append(self.initial_version)
        self._event("start", ranks, self.initial_version)

    async def replace_dead(self) -> list[int]:
        """Find shards whose process died and deal with each: forgotten if the scheduler had
        not given it GPUs (it starts again when it is given some), else started again on the
        same GPUs, synced to the latest version and activated. Returns the ranks found dead.
        A rank that dies more than `max_restarts` times fails the pipeline (ShardDiedError)."""
        dead = await self.fleet.dead_ranks()
        if not dead and all(r in self.fleet.shards for r in self.assigned):
            return []
        async with self._lock:
            dead = await self._drop_dead()
            # assigned ranks without a process: just died, or a replacement that failed to start
            for r in sorted(r for r in self.assigned if r not in self.fleet.shards):
                gpus = self.assigned[r]
                t0 = time.perf_counter()
                if self.placed:
                    await self._place({r: gpus})
                else:
                    await self._start_new([r])
                await self._bring_up([r])
                await self.fleet.activate([r])
                took = time.perf_counter() - t0
                self._event("replace", [r], self.latest, took)
                self.stats.replacements.append({"rank": r, "gpus": list(gpus), "at": time.time(),
                                                "seconds": round(took, 2), "version": self.latest})
                log.warning("shard %d of %s replaced in %.1f s at version %d",
                            r, self.fleet.holder, took, self.latest)
        return dead

    async def _drop_dead(self) -> list[int]:
        """Under the lock: every shard whose process died is recorded, removed from the router
        and ended (process group, log dir); returns their ranks. Too many deaths of one rank
        fail the pipeline."""
        dead = [r for r in await self.fleet.dead_ranks() if r in self.fleet.shards]
        for r in dead:
            why = self._death(r)
            await self.fleet.kill(r)
            self.versions.pop(r, None)
            if len([d for d in self.stats.deaths if d["rank"] == r]) > self.max_restarts:
                raise self._fail(ShardDiedError(f"{why}, more than {self.max_restarts} times; "
                                                f"the pipeline stops"))
            if r not in self.assigned:
                self.stats.deaths[-1]["then"] = "forgotten (it held no GPU)"
        return dead

    def _death(self, rank: int) -> str:
        """Record a dead shard; returns how errors and logs name it."""
        code = self.fleet.exit_code(rank)
        pid = self.fleet.pids().get(rank)
        why = f"{self.fleet.describe(rank)} (pid {pid}) died (exit code {code})"
        tail = self.fleet.log_tail(rank)
        self.stats.deaths.append({"rank": rank, "pid": pid, "exit_code": code, "at": time.time(),
                                  "assigned": rank in self.assigned, "what": why,
                                  "log_tail": tail[-2000:]})
        self._event("died", [rank])
        return why

    async def _bring_up(self, ranks: list[int]) -> None:
        """Wake `ranks` and sync the stale ones to the latest version."""
        stale = [r for r in ranks if self.versions.get(r) != self.latest]
        if self.wake_in_sync and stale:
            # stale shards wake inside their sync call; the others wake meanwhile
            fresh = [r for r in ranks if r not in stale]
            await asyncio.gather(self._wake(fresh), self._sync(stale, "sync", wake=True))
        else:
            await self._wake(ranks)
            if stale:
                await self._sync(stale, "sync")

    @property
    def syncs_on_device(self) -> bool:
        return self.beside_trainer

    async def sync_beside_trainer(self, version: int, trainer_gpus: list[int],
                                  device_ranks: list[int]) -> list[int]:
        """Before the trainer offloads: every shard asleep on one GPU of the trainer's (rank i
        trains on `trainer_gpus[i]`; those in `device_ranks` hold a GPU copy of `version`) is
        synced to `version` from that copy, its weights woken, its KV cache left asleep. Such a
        shard then wakes in one KV allocation when the scheduler gives it the GPU. Returns the
        shards synced; a failure is logged and leaves the shard to the host-cache sync."""
        if not self.beside_trainer or not device_ranks:
            return []
        async with self._lock:
            on_gpu = {trainer_gpus[i]: i for i in device_ranks if i < len(trainer_gpus)}
            targets: dict[int, ShardTarget] = {}
            for r, info in self.fleet.shards.items():
                gpus = info.gpus or self.homes.get(r, ())
                if (not info.active and info.asleep is True and len(gpus) == 1 and gpus[0] in on_gpu
                        and self.versions.get(r) != version):
                    targets[r] = ShardTarget(info.url, self.fleet.node_of(r), beside=on_gpu[gpus[0]])
            ranks = sorted(targets)
            if not ranks:
                return []
            t0 = time.perf_counter()
            # from here the shards' weights may be on their GPU, whatever the outcome: the next
            # sleep or wake asks them (a sleep then drops those weights)
            self.fleet.note_woken(ranks, woken=False)
            try:
                report = await self.weights.refit(version, targets, wake=ranks)
            except Exception as exc:  # noqa: BLE001 - the host-cache sync at wake still works
                for r in ranks:
                    self.versions[r] = None  # whatever it holds now: synced again at its wake
                self.warm.update(ranks)  # possibly holding weights: cooled if not given the GPU
                log.warning("%s: sync of shards %s from the trainer's GPU failed (%s); they are "
                            "synced from the host cache when they wake", self.fleet.holder, ranks, exc)
                return []
            dt = time.perf_counter() - t0
            synced = sorted(report.ranks)
            for r in synced:
                got = int(report.reported.get(r, version))
                if got != version:
                    self.stats.version_mismatches.append(f"shard {r}: synced {version}, reports {got}")
                self.versions[r] = got
                self.history.setdefault(r, []).append(got)
            self.warm.update(synced)
            self.stats.sync_seconds += dt
            self.stats.device_sync_calls_s.append(report.seconds + report.setup_seconds)
            self.stats.device_sync_phases_ms.append(dict(report.shard_phases_ms))
            self._event("device_sync", synced, version, dt)
            log.info("synced shards %s to version %d from the trainer's GPU in %.4fs", synced, version, dt)
            if self._audit is not None and synced:
                await self._check_checksums(synced, version)
            return synced

    async def cool(self, held: set[int] | None) -> list[int]:
        """After the release: the shards synced beside the trainer that were not given their
        GPU (`held`: the ranks the scheduler now places; None: not known, keep waiting for the
        scheduler's call) drop their weights, so the GPU's next holder finds it free."""
        if not self.warm or held is None:
            return []
        async with self._lock:
            cold = sorted(r for r in self.warm
                          if r not in held and r not in self.assigned and r in self.fleet.shards)
            self.warm -= set(cold) | {r for r in self.warm if r in self.assigned or r not in self.fleet.shards}
            if not cold:
                return []
            t0 = time.perf_counter()
            await self.fleet.sleep_partial(cold, level=2)
            for r in cold:
                self.versions[r] = None
            self._event("cool", cold, seconds=time.perf_counter() - t0)
            return cold

    async def _wake(self, ranks: list[int]) -> None:
        if not ranks:
            return
        t0 = time.perf_counter()
        await self.fleet.wake_up_partial(ranks)
        dt = time.perf_counter() - t0
        self.stats.wake_seconds += dt
        self._event("wake", ranks, seconds=dt)

    def announce(self, version: int) -> None:
        """`version` is in the cache: shards woken from now on are synced to it."""
        self.latest = version
        self.published.add(version)

    async def publish(self, version: int) -> list[int]:
        """A new version exists in the cache: refit the shards that are active now, in flight.
        Sleeping shards get it when they wake. Returns the ranks refitted."""
        async with self._lock:
            self.announce(version)
            await self._drop_dead()  # replaced (at the new version) by replace_dead
            stale = [r for r in self.fleet.active_ranks() if self.versions.get(r) != version]
            if not stale:
                return []
            try:
                await self._refit(stale)
            except Exception:
                # a shard that died during the refit: the others are refitted once more
                if not await self.fleet.confirm_dead(stale):
                    raise
                await self._drop_dead()
                stale = [r for r in self.fleet.active_ranks() if self.versions.get(r) != version]
                if stale:
                    await self._refit(stale)
            return stale

    async def _refit(self, ranks: list[int]) -> None:
        """Running requests stay (pause keep) while these shards move to the latest version."""
        await self.fleet.client.pause("keep", ranks)
        try:
            await self._sync(ranks, "refit")
        finally:
            await self.fleet.client.resume(ranks)

    async def _sync(self, ranks: list[int], kind: str, wake: bool = False) -> None:
        """Sync `ranks` to the latest version (waking the sleeping ones in the same call if
        `wake`), then record what each shard says it serves."""
        version = self.latest
        targets = {r: ShardTarget(self.fleet.shards[r].url, self.fleet.node_of(r)) for r in ranks}
        asleep = self.fleet.asleep_ranks(ranks) if wake else []
        t0 = time.perf_counter()
        try:
            rep = await self.weights.refit(version, targets, asleep)
        except BaseException as exc:
            self.fleet.note_woken(asleep, woken=False)  # maybe woken before it failed
            if self.placed and "out of memory" in str(exc).lower():  # half an update may be held
                raise await self._end(ranks, f"ran out of GPU memory during a {kind} to version "
                                             f"{version}: {exc}") from None
            raise
        self.fleet.note_woken(asleep)
        dt = time.perf_counter() - t0
        self.stats.sync_seconds += dt
        for r in ranks:
            got = rep.reported.get(r)
            if got != version:
                self.stats.version_mismatches.append(f"shard {r}: synced {version}, reports {got}")
            self.versions[r] = got
            if got is not None:
                self.history[r].append(got)
        self._event(kind, ranks, version, dt)
        log.info("%s shards %s to version %d in %.3fs", kind, ranks, version, dt)
        if self._audit is not None:
            await self._check_checksums(ranks, version)

    async def _check_checksums(self, ranks: list[int], version: int) -> None:
        t0 = time.perf_counter()
        try:
            await self._compare_checksums(ranks, version)
        finally:
            self.stats.audit_seconds += time.perf_counter() - t0
            self._event("audit", ranks, version, time.perf_counter() - t0)

    async def _compare_checksums(self, ranks: list[int], version: int) -> None:
        audit = self._audit
        assert audit is not None  # called only where an audit was configured
        want = dict(await audit(version))
        answers = await self._served_checksums(self.fleet, ranks)
        for r in ranks:
            bad, extra = mismatches(want, answers[r])
            self.stats.checksum_checks += 1
            if bad or extra:
                self.stats.checksum_mismatches.append(
                    f"shard {r} at version {version}: {len(bad)} tensors differ ({bad[:3]}), "
                    f"{len(extra)} unknown ({extra[:3]})")
