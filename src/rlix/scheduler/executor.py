"""Carries out plans: calls each pipeline's coordinator to shrink or expand its shards.

The ledger already holds a plan's outcome when it gets here; this module only makes the
pipelines catch up, in an order that is safe per GPU. For every GPU id it keeps the task of
the last action touching it, and a new action waits only for those of ITS GPUs. So a grant or
an expand waits for the shrink that frees its GPUs, but never for an unrelated slow shrink of
another pipeline. The same holds per (pipeline, dp rank): one plan may sleep rank r on some
GPUs and wake rank r on others, and the wake must not overtake the sleep of the same engine.
Calls run concurrently as asyncio tasks; nothing here holds a lock.

No Ray here: a coordinator is any `async (remove, add) -> None` callable, so the ordering is
testable with fakes. `ray_resize` adapts a Ray actor handle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from rlix.scheduler.types import Grant, Plan, ShardMove

log = logging.getLogger("rlix.scheduler")

#: `resize_inference(remove, add)`: dp ranks to sleep; dp rank -> GPU ids to wake.
ResizeFn = Callable[[list[int], dict[int, list[int]]], Awaitable[object]]
#: `reassert_shards(shards, wake)`: after a scheduler restart, the pipeline's awake shards
#: become these (dp rank -> GPU ids), whatever the old scheduler's calls did: the others are put
#: to sleep, and with `wake` the missing ones woken; idempotent
ReassertFn = Callable[[dict[int, list[int]], bool], Awaitable[object]]
OnGrant = Callable[[Grant], None]
OnError = Callable[[str, BaseException], None]


@dataclass
class Action:
    """One coordinator call (or one grant) in flight; kept for snapshots and tests."""

    kind: str  # "shrink" | "expand" | "grant" | "reassert"
    pipeline: str
    gpus: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    waits_for: int = 0  # earlier actions it had to wait for
    started_at: float = field(default_factory=time.monotonic)

    def describe(self) -> dict:
        return {"kind": self.kind, "pipeline": self.pipeline, "gpus": list(self.gpus),
                "ranks": list(self.ranks), "waits_for": self.waits_for,
                "age_s": time.monotonic() - self.started_at}


def ray_resize(handle) -> ResizeFn:
    """Adapt a coordinator's Ray actor handle to a `ResizeFn`."""

    async def resize(remove: list[int], add: dict[int, list[int]]) -> object:
        return await handle.resize_inference.remote(remove, add)

    return resize


def ray_reassert(handle) -> ReassertFn:
    """Adapt a coordinator's Ray actor handle to a `ReassertFn`."""

    async def reassert(shards: dict[int, list[int]], wake: bool) -> object:
        return await handle.reassert_shards.remote(shards, wake)

    return reassert


class PlanExecutor:
    """Runs plans' coordinator calls with per-GPU ordering. Use from one event loop.

    `on_grant(grant)` runs once the shrinks on the grant's GPUs are done (failed calls count
    as done: a dead engine holds no GPU, and waiting forever helps nobody).
    `on_error(pipeline, exc)` reports a failed or timed-out coordinator call; the caller
    decides whether that pipeline is dead.
    """

    def __init__(self, on_grant: OnGrant, on_error: OnError | None = None,
                 call_timeout_s: float | None = None) -> None:
        self._on_grant = on_grant
        self._on_error = on_error or (lambda pipeline, exc: None)
        self.call_timeout_s = call_timeout_s
        # GPU id, or ("rank", pipeline, dp_rank) -> the last action touching it
        self._last: dict[object, asyncio.Task] = {}
        self._actions: dict[asyncio.Task, Action] = {}

    # ------------------------------------------------------------------ submit
    def submit(self, plan: Plan, coordinators: Mapping[str, ResizeFn]) -> list[asyncio.Task]:
        """Start a plan's actions: shrinks, then grants, then expands, each after its GPUs'
        earlier actions. A pipeline missing from `coordinators` is skipped (it is gone)."""
        started: list[asyncio.Task] = []
        for pipeline, moves, deps in self._group(plan.shrinks):
            remove = [m.dp_rank for m in moves]
            started.append(self._start(
                Action("shrink", pipeline, _gpus(moves), tuple(remove), len(deps)),
                self._resize(pipeline, coordinators.get(pipeline), remove, {}, deps)))
        for grant in plan.grants:
            deps = self._deps(grant.gpus)
            started.append(self._start(
                Action("grant", grant.pipeline, tuple(grant.gpus), (), len(deps)),
                self._grant(grant, deps)))
        for pipeline, moves, deps in self._group(plan.expands):
            add = {m.dp_rank: list(m.gpus) for m in moves}
            started.append(self._start(
                Action("expand", pipeline, _gpus(moves), tuple(add), len(deps)),
                self._resize(pipeline, coordinators.get(pipeline), [], add, deps)))
        return started

    def submit_call(self, kind: str, pipeline: str, gpus: Iterable[int], ranks: Iterable[int],
                    call: Callable[[], Awaitable[object]], report: bool = True) -> asyncio.Task:
        """One coordinator call outside a plan (after a restart: re-assert a pipeline's shards),
        ordered like a plan's actions: it waits for earlier actions on these GPUs and ranks,
        and later ones wait for it. `report` False: a failure is only logged (a pipeline that
        has left may be gone)."""
        gpus, ranks = tuple(sorted(set(gpus))), tuple(sorted(set(ranks)))
        deps = self._deps([*gpus, *(_rank_key(pipeline, r) for r in ranks)])
        return self._start(Action(kind, pipeline, gpus, ranks, len(deps)),
                           self._run(pipeline, call, kind, deps, report))

    def _deps(self, resources: Iterable[object]) -> list[asyncio.Task]:
        out: dict[int, asyncio.Task] = {}
        for r in resources:
            task = self._last.get(r)
            if task is not None and not task.done():
                out[id(task)] = task
        return list(out.values())

    def _group(self, moves: list[ShardMove]):
        """Moves of one pipeline that wait for the same earlier actions share one call;
        moves with different dependencies get their own, so none waits for another's GPUs."""
        groups: dict[tuple, tuple[str, list[ShardMove], list[asyncio.Task]]] = {}
        for move in moves:
            deps = self._deps([*move.gpus, _rank_key(move.pipeline, move.dp_rank)])
            key = (move.pipeline, frozenset(id(t) for t in deps))
            groups.setdefault(key, (move.pipeline, [], deps))[1].append(move)
        return list(groups.values())

    def _start(self, action: Action, coro: Awaitable[None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._actions[task] = action
        task.add_done_callback(self._actions.pop)
        for g in action.gpus:
            self._last[g] = task
        if action.kind != "grant":
            for rank in action.ranks:
                self._last[_rank_key(action.pipeline, rank)] = task
        return task

    # ------------------------------------------------------------------ actions
    async def _resize(self, pipeline: str, fn: ResizeFn | None, remove: list[int],
                      add: dict[int, list[int]], deps: list[asyncio.Task]) -> None:
        if fn is None:
            if deps:
                await asyncio.wait(deps)
            log.debug("skip resize of %s (no coordinator): remove=%s add=%s", pipeline, remove, add)
            return
        await self._run(pipeline, lambda: fn(remove, add),
                        f"resize_inference (remove={remove} add={add})", deps)

    async def _run(self, pipeline: str, call: Callable[[], Awaitable[object]], what: str,
                   deps: list[asyncio.Task], report: bool = True) -> None:
        if deps:
            await asyncio.wait(deps)
        try:
            if self.call_timeout_s is None:
                await call()
            else:
                await asyncio.wait_for(call(), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure is reported, never swallowed
            log.warning("%s of %s failed: %r", what, pipeline, exc)
            if report:
                self._report(pipeline, exc)

    async def _grant(self, grant: Grant, deps: list[asyncio.Task]) -> None:
        if deps:
            await asyncio.wait(deps)
        try:
            self._on_grant(grant)
        except Exception:  # noqa: BLE001 - a bad callback must not break the GPU chain
            log.exception("grant callback for request %d failed", grant.request_id)

    def _report(self, pipeline: str, exc: BaseException) -> None:
        try:
            self._on_error(pipeline, exc)
        except Exception:  # noqa: BLE001
            log.exception("error callback for %s failed", pipeline)

    # ------------------------------------------------------------------ waiting
    async def settled(self, gpus: Iterable[int]) -> None:
        """Return once every action submitted so far on these GPUs has finished."""
        deps = self._deps(gpus)
        if deps:
            await asyncio.wait(deps)

    async def drain(self) -> None:
        """Return once nothing is in flight (including actions started meanwhile)."""
        while self._actions:
            await asyncio.wait(list(self._actions))

    def in_flight(self) -> list[dict]:
        return [a.describe() for a in self._actions.values()]

    def busy_gpus(self) -> list[int]:
        return sorted(g for g, t in self._last.items() if isinstance(g, int) and not t.done())

    async def close(self) -> None:
        """Cancel everything still in flight (used at shutdown)."""
        tasks = list(self._actions)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)


def _rank_key(pipeline: str, dp_rank: int) -> tuple:
    return ("rank", pipeline, dp_rank)


def _gpus(moves: list[ShardMove]) -> tuple[int, ...]:
    return tuple(g for m in moves for g in m.gpus)
