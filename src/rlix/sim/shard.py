"""One simulated inference shard: prefill queue plus processor-sharing decode.

Decode is modelled exactly as processor sharing at turn granularity: with n sequences running,
one decode step takes `base + per_seq * n` and yields one token per sequence, so every running
sequence advances at 1 / step_time tokens/s. The shard keeps a virtual token clock `vclock`
(tokens produced so far by any one sequence that ran all along); a sequence joining with r
tokens to go finishes when the clock reaches join-clock + r. Only when n changes does the clock
advance and the next completion get rescheduled (stale events are skipped by an epoch counter).

Prefill simplification: a shard's prefill is a FIFO server at `prefill_tokens_per_s`, running
beside decode without slowing it (real engines interleave the two in chunks). A turn pays
(uncached input tokens / rate) in that queue before it joins decode.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlix.sim.engine import Clock
    from rlix.sim.pipeline import PipelineRun, Traj
    from rlix.sim.scenario import EngineModel

WAKING, ACTIVE, GONE = "waking", "active", "gone"
_EPS = 1e-7


class Shard:
    """A shard instance: created by an expand, ended by a shrink (its KV cache goes with it)."""

    def __init__(self, clock: "Clock", run: "PipelineRun", dp_rank: int, gpus: tuple[int, ...],
                 engine: "EngineModel", ready_at: float) -> None:
        self.clock = clock
        self.run = run
        self.dp_rank = dp_rank
        self.gpus = gpus
        self.tp = len(gpus)
        self.max_seqs = engine.max_seqs
        self.base_s = engine.decode_base_ms / 1000.0
        self.per_seq_s = engine.decode_per_seq_ms / 1000.0
        self.prefill_rate = engine.prefill_tokens_per_s
        self.state = WAKING
        self.ready_at = ready_at
        self.vclock = 0.0
        self.running: list[tuple[float, int, "Traj"]] = []  # (finish vclock, seq, traj)
        self.prefilling: list["Traj"] = []  # FIFO
        self.prefill_free_at = 0.0
        self.paused_until = float("-inf")
        self.epoch = 0
        self.t_last = clock.now
        # accounting (GPU-seconds count tp GPUs per shard-second)
        self.tokens = 0.0
        self.busy_gpu_s = 0.0
        self.decode_s = 0.0  # shard-seconds with >= 1 sequence decoding
        self.seq_s = 0.0  # integral of n over time (mean batch = seq_s / decode_s)

    # ------------------------------------------------------------------ model
    @property
    def load(self) -> int:
        return len(self.running) + len(self.prefilling)

    def has_room(self) -> bool:
        return self.state == ACTIVE and self.load < self.max_seqs

    def step_s(self, n: int) -> float:
        return self.base_s + self.per_seq_s * n

    def paused(self, now: float) -> bool:
        return now < self.paused_until

    def advance(self) -> None:
        """Bring the virtual clock and the accounting up to now."""
        now = self.clock.now
        # A pause always starts with an advance, so only [max(last, paused_until), now] ran.
        dt = now - max(self.t_last, self.paused_until)
        if dt > 0 and self.state == ACTIVE:
            n = len(self.running)
            if n:
                dv = dt / self.step_s(n)
                self.vclock += dv
                self.tokens += n * dv
                self.decode_s += dt
                self.seq_s += n * dt
                self.busy_gpu_s += dt * self.tp
            elif self.prefilling:
                self.busy_gpu_s += dt * self.tp
        self.t_last = now

    def _reschedule(self) -> None:
        self.epoch += 1
        now = self.clock.now
        if not self.running or self.state != ACTIVE or self.paused(now):
            return
        left = max(0.0, self.running[0][0] - self.vclock)
        self.clock.at(now + left * self.step_s(len(self.running)), self._on_decode, self.epoch)

    # ------------------------------------------------------------------ lifecycle
    def activate(self) -> None:
        self.advance()
        self.state = ACTIVE

    def pause(self, duration: float) -> None:
        """In-flight weight update: running sequences and queued prefills freeze."""
        if self.state != ACTIVE or duration <= 0:
            return
        self.advance()
        now = self.clock.now
        start = max(now, self.paused_until)
        until = max(self.paused_until, now + duration)
        shift = until - start
        self.paused_until = until
        if shift > 0:
            self.prefill_free_at = max(self.prefill_free_at, now) + shift
            for traj in self.prefilling:
                traj.token += 1
                traj.prefill_done += shift
                self.clock.at(traj.prefill_done, self._on_prefill_done, traj, traj.token)
        self._reschedule()
        self.clock.at(until, self._on_pause_end)

    def _on_pause_end(self) -> None:
        if self.state != ACTIVE or self.paused(self.clock.now):
            return
        self.advance()
        self._reschedule()

    def abort_all(self) -> tuple[list["Traj"], list["Traj"]]:
        """Shrink: stop everything; returns (decoding, prefilling) turns. Decoding turns keep
        the tokens generated so far."""
        self.advance()
        decoding: list["Traj"] = []
        for finish_v, _, traj in sorted(self.running, key=lambda e: e[1]):
            traj.remaining = max(0.0, finish_v - self.vclock)
            decoding.append(traj)
        prefilling = list(self.prefilling)
        for traj in decoding + prefilling:
            traj.token += 1
            traj.shard = None
        self.running.clear()
        self.prefilling.clear()
        self.state = GONE
        self.epoch += 1
        return decoding, prefilling

    @staticmethod
    def generated_by(traj: "Traj") -> float:
        """Tokens an aborted turn generated on this shard (it keeps them)."""
        return traj.joined - traj.remaining

    # ------------------------------------------------------------------ work
    def start_prefill(self, traj: "Traj", tokens: int) -> None:
        self.advance()
        now = self.clock.now
        start = max(now, self.prefill_free_at, self.paused_until)
        done = start + tokens / self.prefill_rate
        self.prefill_free_at = done
        traj.shard = self
        traj.token += 1
        traj.prefill_done = done
        self.prefilling.append(traj)
        self.clock.at(done, self._on_prefill_done, traj, traj.token)

    def _on_prefill_done(self, traj: "Traj", token: int) -> None:
        if token != traj.token or traj.shard is not self or self.state != ACTIVE:
            return
        self.advance()
        self.prefilling.remove(traj)
        traj.joined = traj.remaining
        heapq.heappush(self.running, (self.vclock + traj.remaining, self.clock.next_seq(), traj))
        self._reschedule()

    def _on_decode(self, epoch: int) -> None:
        if epoch != self.epoch or self.state != ACTIVE:
            return
        self.advance()
        done: list["Traj"] = []
        limit = self.vclock + _EPS * max(1.0, self.vclock)
        while self.running and self.running[0][0] <= limit:
            _, _, traj = heapq.heappop(self.running)
            traj.remaining = 0.0
            traj.token += 1
            done.append(traj)
        self._reschedule()
        for traj in done:
            self.run.turn_done(traj, self)
        if done:
            self.run.dispatch()
