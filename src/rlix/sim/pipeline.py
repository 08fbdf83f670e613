"""One simulated async-GRPO pipeline: its collector, router and trainer loop.

Async GRPO with max staleness s: version v = finished train steps; batch k may start
generating once v >= k - s; train step k starts when batch k is complete and step k-1 is done.
The router is session-sticky: a turn goes back to the shard that served the trajectory's
previous turn while that shard is active and has room (only the new input is prefilled, the
prefix is cached there), else to the least-loaded active shard (the whole context is
prefilled). A turn aborted by a shrink keeps the tokens it generated and is re-dispatched.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from rlix.sim.account import ShardlessClock
from rlix.sim.shard import ACTIVE, WAKING, Shard
from rlix.sim.workload import TrajectorySpec, Workload
from rlix.scheduler.types import PipelineSpec, Progress, Stage

if TYPE_CHECKING:
    from rlix.sim.engine import Clock, Domain
    from rlix.sim.scenario import PipelineSetup


class Traj:
    """Runtime state of one trajectory; it has at most one turn in flight."""

    __slots__ = ("spec", "batch", "turn", "remaining", "ctx", "shard", "cached_on", "cached",
                 "token", "prefill_done", "joined", "finished_at")

    def __init__(self, spec: TrajectorySpec, batch: int) -> None:
        self.spec = spec
        self.batch = batch
        self.turn = 0
        self.remaining = float(spec.gen[0])  # tokens still to generate in this turn
        self.ctx = spec.prompt_tokens  # input tokens before this turn's generation
        self.shard: Shard | None = None
        self.cached_on: Shard | None = None  # shard holding this trajectory's prefix
        self.cached = 0  # tokens of that prefix
        self.token = 0  # invalidates stale prefill events
        self.prefill_done = 0.0
        self.joined = 0.0  # `remaining` when the turn last joined decode
        self.finished_at: float | None = None

    def context_now(self) -> float:
        return self.ctx + (self.spec.gen[self.turn] - self.remaining)


class PipelineRun:
    """Drives one pipeline inside one Domain (a ledger plus the planner)."""

    def __init__(self, clock: "Clock", domain: "Domain", setup: "PipelineSetup",
                 spec: PipelineSpec, workload: Workload) -> None:
        self.clock = clock
        self.domain = domain
        self.setup = setup
        self.spec = spec
        self.name = spec.name
        self.workload = workload
        self.engine = setup.engine
        self.transitions = setup.transitions
        self.steps = len(workload.batches)
        self.batch_size = setup.rollout.batch
        self.train_s = setup.train_gpu_seconds / spec.train_gpus
        self.version = 0
        self.released = 0
        self.batch_left = [len(b) for b in workload.batches]
        self.trajs: list[list[Traj]] = []
        self.remaining = 0
        self.reported: int | None = None
        self.queue: list[tuple[int, int, Traj]] = []
        self.shards: dict[int, Shard] = {}
        self.retired: list[Shard] = []
        self.request_id: int | None = None
        self.training = False
        self.started_at = clock.now
        self.finished_at: float | None = None
        self.step_ends: list[float] = []
        self.on_step = None  # optional callback(name) after every train step (progress bars)
        # counters for the report
        self.finish_events = 0
        self.preempted_turns = 0  # turns aborted while decoding
        self.aborted_turns = 0  # ... or while prefilling
        self.kept_tokens = 0.0
        self.prefill_tokens = 0.0
        self.train_gpu_s = 0.0
        self.train_waits: list[float] = []  # request -> training starts (GPUs granted and free)
        self.requested_at = 0.0
        self.granted_at = 0.0
        self.expands = 0
        self.turns_dispatched = 0
        self.queue_area = 0.0  # integral of queued turns over time (turn-seconds waiting)
        self._q_last = clock.now
        self.shardless = ShardlessClock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.started_at = self.clock.now
        self._release_batches()
        self._report(force=True)

    def _finish(self) -> None:
        self.finished_at = self.clock.now
        self.shardless.close(self.clock.now)
        for rank in sorted(self.shards):
            shard = self.shards.pop(rank)
            shard.abort_all()
            self.retired.append(shard)
        self.domain.unregister(self)

    def track_shardless(self) -> None:
        """Call whenever its pending work or the ledger's shards of it may have changed."""
        waiting = self.remaining > 0 and self.finished_at is None \
            and not self.domain.ledger.shards_of(self.name)
        self.shardless.update(self.clock.now, waiting)

    def all_shards(self) -> list[Shard]:
        return self.retired + list(self.shards.values())

    # ------------------------------------------------------------------ collector
    def _release_batches(self) -> None:
        s = self.setup.max_staleness
        while self.released < self.steps and self.released <= self.version + s:
            k = self.released
            batch = [Traj(spec, k) for spec in self.workload.batches[k]]
            self.trajs.append(batch)
            for traj in batch:
                self._enqueue(traj)
            self.remaining += len(batch)
            self.released += 1
        self.track_shardless()
        self.dispatch()

    def _queue_touch(self) -> None:
        now = self.clock.now
        self.queue_area += len(self.queue) * (now - self._q_last)
        self._q_last = now

    def _enqueue(self, traj: Traj) -> None:
        self._queue_touch()
        heapq.heappush(self.queue, (traj.batch, self.clock.next_seq(), traj))

    def _report(self, force: bool = False) -> None:
        if not force and self.reported is not None and \
                abs(self.reported - self.remaining) < 0.02 * self.batch_size:
            return
        self.reported = self.remaining
        open_batches = sum(1 for k in range(self.version, self.released) if self.batch_left[k] > 0)
        load = {rank: sh.load for rank, sh in self.shards.items() if sh.state == ACTIVE}
        self.domain.report(Progress(self.name, remaining=self.remaining,
                                    target=open_batches * self.batch_size, step=self.version,
                                    shard_load=load, reported_at=self.clock.now))

    def turn_done(self, traj: Traj, shard: Shard) -> None:
        spec = traj.spec
        traj.shard = None
        traj.cached_on = shard
        traj.cached = traj.ctx + spec.gen[traj.turn]
        traj.turn += 1
        if traj.turn == spec.turns:
            self._trajectory_done(traj)
            return
        traj.ctx = traj.cached + spec.obs_tokens
        traj.remaining = float(spec.gen[traj.turn])
        self.clock.at(self.clock.now + spec.tool[traj.turn - 1], self._tool_done, traj)

    def _tool_done(self, traj: Traj) -> None:
        self._enqueue(traj)
        self.dispatch()

    def _trajectory_done(self, traj: Traj) -> None:
        if traj.finished_at is not None:
            raise RuntimeError(f"simulator bug: {self.name} batch {traj.batch} finished twice")
        traj.finished_at = self.clock.now
        self.finish_events += 1
        self.batch_left[traj.batch] -= 1
        self.remaining -= 1
        if self.remaining == 0:
            self.track_shardless()
        self._report()
        if self.batch_left[traj.batch] == 0:
            self._maybe_train()

    # ------------------------------------------------------------------ router
    def dispatch(self) -> None:
        """Send queued turns to shards with room, oldest batch first."""
        queue = self.queue
        if queue:
            self._queue_touch()
        while queue:
            traj = queue[0][2]
            sticky = traj.cached_on
            if sticky is not None and sticky.run is self and sticky.has_room():
                shard, tokens = sticky, traj.context_now() - traj.cached
            else:
                shard = None
                for s in self.shards.values():
                    if s.has_room() and (shard is None or s.load < shard.load):
                        shard = s
                if shard is None:
                    return
                tokens = traj.context_now()
            heapq.heappop(queue)
            self.turns_dispatched += 1
            self.prefill_tokens += tokens
            shard.start_prefill(traj, tokens)

    # ------------------------------------------------------------------ trainer
    def _maybe_train(self) -> None:
        k = len(self.step_ends)
        if self.training or self.request_id is not None or k >= self.steps:
            return
        if k < self.released and self.batch_left[k] == 0:
            self.request_id = self.domain.submit(self, Stage.TRAIN, self.spec.train_gpus)
            self.requested_at = self.clock.now

    def on_grant(self, start_at: float) -> None:
        self.request_id = None
        self.training = True
        self.train_waits.append(start_at - self.requested_at)
        self.granted_at = start_at
        self.clock.at(start_at + self.train_s, self._train_end)

    def _train_end(self) -> None:
        self.domain.release(self, Stage.TRAIN)
        self.train_gpu_s += self.train_s * self.spec.train_gpus
        self.training = False
        self.version += 1
        self.step_ends.append(self.clock.now)
        if self.on_step is not None:
            self.on_step(self.name)
        trace = self.domain.trace
        if trace is not None:
            now, sync = self.clock.now, self.transitions.sync_s
            trace.step(self.name, self.version, self.started_at, self.requested_at, self.granted_at,
                       self.train_s, now)
            active = [r for r, s in self.shards.items() if s.state == ACTIVE]
            if active and sync > 0 and self.version < self.steps:  # after the last, it ends
                trace.event(self.name, now + sync, "refit", active, sync, self.version)
        for rank in sorted(self.shards):
            self.shards[rank].pause(self.transitions.sync_s)
        if len(self.step_ends) == self.steps:
            self._finish()
            return
        self._release_batches()
        self._report(force=True)
        self._maybe_train()

    # ------------------------------------------------------------------ shards
    def on_shrink(self, dp_rank: int) -> None:
        shard = self.shards.pop(dp_rank)
        decoding, prefilling = shard.abort_all()
        for traj in decoding:
            self.preempted_turns += 1
            self.kept_tokens += shard.generated_by(traj)
        for traj in decoding + prefilling:
            self.aborted_turns += 1
            self._enqueue(traj)
        self.retired.append(shard)

    def on_expand(self, dp_rank: int, gpus: tuple[int, ...], ready_at: float) -> None:
        shard = Shard(self.clock, self, dp_rank, gpus, self.engine, ready_at)
        self.shards[dp_rank] = shard
        self.expands += 1
        self.clock.at(ready_at, self._shard_ready, shard)

    def _shard_ready(self, shard: Shard) -> None:
        if shard.state != WAKING:
            return
        shard.activate()
        if self.domain.trace is not None:
            self.domain.trace.event(self.name, self.clock.now, "activate", [shard.dp_rank])
        self.dispatch()
