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
from collections import deque
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
                 spec: PipelineSpec, workload: Workload, setup_s: float | None = None) -> None:
        self.clock = clock
        self.domain = domain
        self.setup = setup
        self.spec = spec
        self.name = spec.name
        self.workload = workload
        self.engine = setup.engine
        self.costs = setup.costs
        # a stage that time-shares its GPUs with shards loads its model before it and puts it
        # away after (its GPUs are held throughout); without partial overlap it stays resident
        overlap = spec.partial_overlap
        self.reload_s = self.costs.trainer_reload_s if overlap else 0.0
        self.offload_s = self.costs.trainer_offload_s if overlap else 0.0
        self.engines_ready_at = 0.0  # resident engines: when the set-up's process starts are done
        self.setup_s = setup_s  # its policy's set-up (scenario `run:`); None: cold_start_s
        # the collector's cap on trajectories in flight (None: none); those released beyond it
        # wait in `held`, in release order, until one in flight finishes
        self.in_flight_cap = setup.rollout.in_flight
        self.in_flight = 0
        self.peak_in_flight = 0
        self.held: deque[Traj] = deque()
        self.steps = len(workload.batches)
        self.batch_size = setup.rollout.batch
        self.train_s = setup.train_gpu_seconds / spec.train_gpus
        # Non-rollout phases of a step, in order: the extra stages (the scheduler's logprob
        # stage), then train; a stage gets at most what its domain (or its home) has.
        room = domain.ledger.topology.num_gpus if spec.partial_overlap else spec.train_gpus
        self.phases: list[tuple[str, Stage, int, float]] = [
            (st.name, Stage.LOGPROB, min(st.gpus, room), st.gpu_seconds / min(st.gpus, room))
            for st in setup.stages] + [("train", Stage.TRAIN, spec.train_gpus, self.train_s)]
        self.phase = 0  # index into phases of the step's current (or next) request
        self.epoch = 0  # bumped by a crash: events of the dead processes are dropped
        self.down = False
        self.crashes = 0
        self.lost_trajectories = 0  # finished, then lost with their batch in a crash
        self.muted = False
        self.stale = False
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
        self.stage_gpu_s = 0.0  # extra stages' GPU-seconds of work
        self.phase_requested_at = 0.0
        self.train_waits: list[float] = []  # request -> training starts (GPUs granted and free)
        self.requested_at = 0.0
        self.granted_at = 0.0
        self.expands = 0
        self.turns_dispatched = 0
        self.queue_area = 0.0  # integral of queued turns over time (turn-seconds waiting)
        self._q_last = clock.now
        self.shardless = ShardlessClock()
        # its rate, as its collector measures it: active shard-seconds per finished trajectory
        self.active_shards = 0
        self.active_shard_s = 0.0
        self._active_last = clock.now
        self.rated_trajectories = 0

    # ------------------------------------------------------------------ lifecycle
    def _set_up(self) -> None:
        """Its processes start: with resident engines every shard process at once (in parallel),
        so no shard of it serves before its set-up (`setup_s` of its policy where the scenario
        gives one, else `cold_start_s`) from now."""
        if self.setup.resident_engines:
            setup_s = self.setup_s if self.setup_s is not None else self.costs.cold_start_s
            self.engines_ready_at = self.clock.now + setup_s

    def _active_touch(self, delta: int = 0) -> None:
        now = self.clock.now
        self.active_shard_s += self.active_shards * (now - self._active_last)
        self._active_last = now
        self.active_shards += delta

    def seconds_per_trajectory(self) -> float | None:
        """Active shard-seconds per finished trajectory so far (None before the first)."""
        if not self.rated_trajectories:
            return None
        self._active_touch()
        return self.active_shard_s / self.rated_trajectories

    def start(self) -> None:
        self.started_at = self._q_last = self._active_last = self.clock.now
        self._set_up()
        for f in self.setup.faults:
            if f.kind == "crash":
                self.clock.at(self.started_at + f.at_s, self._crash, f.restart_after_s)
            else:
                if f.from_s <= 0:  # already on for its first report
                    self._set_report_fault(f.kind, True)
                else:
                    self.clock.at(self.started_at + f.from_s, self._report_fault, f.kind, True)
                self.clock.at(self.started_at + f.to_s, self._report_fault, f.kind, False)
        self._release_batches()
        self._report(force=True)

    # ------------------------------------------------------------------ faults
    def _crash(self, restart_after_s: float) -> None:
        """Its processes die: shards, queued turns, the step in progress and the batches not
        yet trained are lost; the scheduler forgets it. It restarts from its last step."""
        if self.down or self.finished_at is not None:
            return
        self.crashes += 1
        self.epoch += 1
        self.down = True
        self.shardless.close(self.clock.now)
        self._active_touch(-self.active_shards)
        for rank in sorted(self.shards):
            shard = self.shards.pop(rank)
            shard.abort_all()
            self.retired.append(shard)
        self._queue_touch()
        self.queue.clear()
        self.held.clear()
        self.in_flight = 0
        for k in range(self.version, self.released):
            self.lost_trajectories += len(self.trajs[k]) - self.batch_left[k]
            self.finish_events -= len(self.trajs[k]) - self.batch_left[k]
        del self.trajs[self.version:]
        self.released = self.version
        self.remaining = 0
        self.request_id = None
        self.training = False
        self.phase = 0
        self.reported = None
        self.domain.crash(self)
        self.clock.at(self.clock.now + restart_after_s, self._restart)

    def _restart(self) -> None:
        self.down = False
        self.batch_left[self.version:] = [len(b) for b in self.workload.batches[self.version:]]
        self.domain.add(self, resume=True)

    def resume(self) -> None:
        """Registered again after a crash: re-generate from the last finished step."""
        self._set_up()
        self._release_batches()
        self._report(force=True)

    def _set_report_fault(self, kind: str, on: bool) -> None:
        if kind == "mute_reports":
            self.muted = on
        else:
            self.stale = on

    def _report_fault(self, kind: str, on: bool) -> None:
        self._set_report_fault(kind, on)
        if not self.down and self.finished_at is None:
            self._report(force=True)  # a muted one says 0 now; at the end, the truth again

    def _finish(self) -> None:
        self.finished_at = self.clock.now
        self.shardless.close(self.clock.now)
        self._active_touch(-self.active_shards)
        for rank in sorted(self.shards):
            shard = self.shards.pop(rank)
            shard.abort_all()
            self.retired.append(shard)
        self.domain.unregister(self)

    def track_shardless(self) -> None:
        """Call whenever its pending work or the ledger's shards of it may have changed."""
        waiting = self.remaining > 0 and self.finished_at is None and not self.down \
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
            if self.in_flight_cap is None:
                for traj in batch:
                    self._enqueue(traj)
            else:
                self.held.extend(batch)
            self.remaining += len(batch)
            self.released += 1
        self._admit()
        self.track_shardless()
        self.dispatch()

    def _admit(self) -> None:
        """Under the in-flight cap (per active shard, at least one shard's worth, as the real
        collector's `concurrency`): let held trajectories into the router while there is room."""
        if self.in_flight_cap is None:
            return
        cap = self.in_flight_cap * max(1, self.active_shards)
        while self.held and self.in_flight < cap:
            self.in_flight += 1
            self._enqueue(self.held.popleft())
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

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
        if self.stale:
            return  # the scheduler keeps the last report it got, and that report's time
        # pending_work: the router's evidence (turns released and not finished), sent even when
        # the demand figure is muted
        rate = self.seconds_per_trajectory()
        if self.muted:
            self.domain.report(Progress(self.name, remaining=0, step=self.version,
                                        reported_at=self.clock.now, pending_work=self.remaining > 0,
                                        seconds_per_trajectory=rate))
            return
        open_left = [self.batch_left[k] for k in range(self.version, self.released) if self.batch_left[k] > 0]
        load = {rank: sh.load for rank, sh in self.shards.items() if sh.state == ACTIVE}
        # the whole window is its demand (what the real collector reports as `remaining`); the
        # earliest open batch's shortfall is what its next train request waits for
        self.domain.report(Progress(self.name, remaining=self.remaining,
                                    target=len(open_left) * self.batch_size, step=self.version,
                                    for_next_step=open_left[0] if open_left else 0,
                                    shard_load=load, reported_at=self.clock.now,
                                    pending_work=self.remaining > 0, seconds_per_trajectory=rate))

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
        self.clock.at(self.clock.now + spec.tool[traj.turn - 1], self._tool_done, traj, self.epoch)

    def _tool_done(self, traj: Traj, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._enqueue(traj)
        self.dispatch()

    def _trajectory_done(self, traj: Traj) -> None:
        if traj.finished_at is not None:
            raise RuntimeError(f"simulator bug: {self.name} batch {traj.batch} finished twice")
        traj.finished_at = self.clock.now
        self.finish_events += 1
        self.rated_trajectories += 1
        self.batch_left[traj.batch] -= 1
        self.remaining -= 1
        if self.in_flight_cap is not None:
            self.in_flight -= 1
            self._admit()  # dispatched by the caller (the shard, after its finished turns)
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
        if self.training or self.request_id is not None or k >= self.steps or self.down:
            return
        if k < self.released and self.batch_left[k] == 0:
            self.phase = 0
            self.requested_at = self.clock.now
            self._request_phase()

    def _request_phase(self) -> None:
        _, stage, gpus, _ = self.phases[self.phase]
        self.request_id = self.domain.submit(self, stage, gpus)
        self.phase_requested_at = self.clock.now

    @property
    def hold_s(self) -> float:
        """How long the phase being granted holds its GPUs: its model's reload, its work, the
        offload."""
        return self.reload_s + self.phases[self.phase][3] + self.offload_s

    @property
    def phase_label(self) -> str:
        return self.phases[self.phase][0]

    def on_grant(self, start_at: float) -> None:
        self.request_id = None
        self.training = True
        self.train_waits.append(start_at - self.phase_requested_at)
        self.granted_at = start_at
        if self.phase < len(self.phases) - 1:
            self.clock.at(start_at + self.hold_s, self._stage_end, self.epoch)
        else:
            self.clock.at(start_at + self.hold_s, self._train_end, self.epoch)

    def _stage_end(self, epoch: int) -> None:
        """An extra stage is done: give its GPUs back and ask for the next phase."""
        if epoch != self.epoch:
            return
        _, stage, gpus, seconds = self.phases[self.phase]
        self.stage_gpu_s += seconds * gpus
        self.domain.release(self, stage)
        self.training = False
        self.phase += 1
        self._request_phase()

    def _train_end(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.domain.release(self, Stage.TRAIN)
        self.train_gpu_s += self.train_s * self.spec.train_gpus
        self.training = False
        self.version += 1
        self.step_ends.append(self.clock.now)
        if self.on_step is not None:
            self.on_step(self.name)
        trace = self.domain.trace
        if trace is not None:
            now, sync = self.clock.now, self.costs.sync_s
            trace.step(self.name, self.version, self.started_at, self.requested_at, self.granted_at,
                       self.train_s, now, self.reload_s, self.offload_s)
            active = [r for r, s in self.shards.items() if s.state == ACTIVE]
            if active and sync > 0 and self.version < self.steps:  # after the last, it ends
                trace.event(self.name, now + sync, "refit", active, sync, self.version)
        for rank in sorted(self.shards):
            self.shards[rank].pause(self.costs.sync_s)
        if len(self.step_ends) == self.steps:
            self._finish()
            return
        self._release_batches()
        self._report(force=True)
        self._maybe_train()

    # ------------------------------------------------------------------ shards
    def on_shrink(self, dp_rank: int) -> None:
        shard = self.shards.pop(dp_rank)
        if shard.state == ACTIVE:
            self._active_touch(-1)
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
        self._active_touch(+1)
        if self.domain.trace is not None:
            self.domain.trace.event(self.name, self.clock.now, "activate", [shard.dp_rank])
        self._admit()
        self.dispatch()
