"""The planner's move gate: what moving a GPU costs against the work it buys (issue 35).

Built once per planning pass from the cost table (`rlix.scheduler.costs.MoveCosts`) and the
pipelines' reports; the planner asks it whether a claim may take a shard from another pipeline,
which GPUs a claimant must leave alone, and which shards are not to be taken (see `MoveGate`).
"""

from __future__ import annotations

from rlix.scheduler.costs import MoveCosts
from rlix.scheduler.planning.pool import Pool
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import GpuRequest, Holding, Progress


def report_is_stale(progress: Progress, now: float | None, stale_s: float | None) -> bool:
    return stale_s is not None and now is not None and now - progress.reported_at > stale_s



#: what a claim that must take GPUs from another pipeline may do (`MoveGate.claim`)
ANY, WARM, NONE = 0, 1, 2


class MoveGate:
    """Per pass: what moves cost (`PlannerParams.move_costs`) and each pipeline's expected
    generation work in shard-seconds (`Progress.work_s`; only pipelines that report their rate,
    with a report not stale). Three rules, none for a pipeline's first shard (the rollout floor
    and its bound stay as they were) and none on non-rollout requests (phase 1 never asks):
      (a) `claim`: a shard of one pipeline is shrunk to give another a shard only if the
          receiver's work on it, work / (its shards + 1), is at least margin x (sleep + wake,
          + a cold start where none of its ranks has an engine on the GPUs freed);
      (b) `due`: idle GPUs of a training home whose owner wants them back sooner than margin x
          (wake + sleep) are not filled (its request waits, or its next step's work per shard
          ends within that of its report); `due_until`: when the earliest such estimate runs out;
      (d) `short`: a shard of a pipeline whose work per shard ends within margin x (sleep +
          wake) is not shrunk for another's claim: it finishes first;
      (e) `busy`: nor is a shard with requests running (its pipeline's `shard_load`) for a claim
          of the same tier or a lower one, until it has been held `rotate_s`: the work in flight
          is a move's cost too (re-dispatched onto the pipeline's other shards it queues there,
          and across the pipeline's training step it goes stale). It is lent once it is idle
          (the report that says so re-plans).
    Filling an idle GPU is otherwise always allowed: nothing is lost."""

    def __init__(self, pool: Pool, ledger: Ledger, progress: dict[str, Progress], now: float,
                 costs: MoveCosts, report_stale_s: float | None, rotate_s: float,
                 requests: list[GpuRequest], training: set[str]) -> None:
        self.pool, self.ledger, self.progress = pool, ledger, progress
        self.now, self.rotate_s = now, rotate_s
        self.margin = costs.margin
        self.move_s = costs.sleep_s + costs.wake_s  # a shard slept for another that wakes
        self.cold_s = costs.cold_start_s
        self.work: dict[str, float] = {}
        self.due: frozenset[int] = frozenset()
        self.due_until: float | None = None
        self._short: dict[str, bool] = {}
        self._exclude: dict[str, frozenset[int]] = {}
        # the training homes of pipelines still setting up: their trainer and engine are loading
        # there, so no other pipeline's shard goes there until they are ready (the pipelines that
        # are ready start at once, each on the GPUs nobody is setting up on)
        self.setting_up_homes: frozenset[int] = frozenset(
            g for n, p in progress.items() if p.setting_up for g in ledger.train_home.get(n, ()))
        if not costs.gated:
            return
        stale_s = report_stale_s
        pipelines = ledger.pipelines
        for name, p in progress.items():
            if p.seconds_per_trajectory is not None and name in pipelines \
                    and not report_is_stale(p, now, stale_s):
                self.work[name] = p.remaining * p.seconds_per_trajectory
        if self.work and ledger.train_home:
            self._find_due(progress, now, requests, training)

    def _find_due(self, progress: dict[str, Progress], now: float, requests: list[GpuRequest],
                  training: set[str]) -> None:
        waiting = {r.pipeline for r in requests}
        threshold = self.margin * self.move_s
        due: set[int] = set()
        for owner, home in self.ledger.train_home.items():
            work = self.work.get(owner)
            if work is None or owner in training:
                continue
            if owner in waiting:  # its request waits for GPUs of its home: it wants them now
                due |= home
                continue
            shards = self.pool.shard_count[owner]
            if work > 0 and shards == 0:
                continue  # no shard, work left: its train step is not near
            p = progress[owner]
            # its next train request comes when the next step's batch is in, not its whole window
            next_work = p.next_step_remaining * (p.seconds_per_trajectory or 0.0)
            ends = p.reported_at + next_work / max(1, shards)
            if ends - threshold <= now < ends + threshold:
                due |= home
                until = ends + threshold
                self.due_until = until if self.due_until is None else min(self.due_until, until)
        self.due = frozenset(due)

    def exclude(self, name: str, first_shard: bool) -> frozenset[int]:
        """GPUs a shard of `name` may not go to in this pass. Beyond its first shard, none where
        its engine is still starting (`Ledger.engines_starting`): that shard would hold the GPU
        without generating until the start ends, and a claim on the GPU meanwhile (another
        pipeline's training) waited for the start too."""
        base = self.ledger.shard_exclusion(name)
        if self.setting_up_homes:
            base = base | (self.setting_up_homes - self.ledger.train_home.get(name, frozenset()))
        if first_shard:
            return base
        out = self._exclude.get(name)
        if out is None:
            out = self._exclude[name] = base | self.ledger.engines_starting.get(name, frozenset()) | self.due
        return out

    def claim(self, name: str, shards: int) -> int:
        """ANY, WARM (only onto GPUs where one of its ranks has an engine) or NONE."""
        work = self.work.get(name)
        if work is None:
            return ANY
        per_shard = work / (shards + 1)
        need = self.margin * self.move_s
        if per_shard < need:
            return NONE
        return WARM if per_shard < need + self.margin * self.cold_s else ANY

    def warm_targets(self, name: str, max_shards: int,
                     exclude: frozenset[int]) -> dict[int, list[tuple[int, ...]]] | None:
        """node -> last GPUs of each inactive rank of `name` not put to sleep in this pass (its
        engine is there). None: anywhere (on slices a moved rank keeps its process, and one
        has run)."""
        pool, ledger = self.pool, self.ledger
        active = pool.ranks[name]
        slept = {m.dp_rank for m in pool.shrinks if m.pipeline == name}
        whole = ledger.topology.slices == 1
        out: dict[int, list[tuple[int, ...]]] = {}
        for rank in range(max_shards):
            if rank in active or rank in slept:
                continue
            last = ledger.last_shard_gpus.get((name, rank))
            if last is None:
                continue
            if not whole:
                return None
            if not exclude.intersection(last):
                out.setdefault(pool.node_of[last[0]], []).append(last)
        return out

    def busy(self, h: Holding, claimant: str) -> bool:
        """Rule (e): `h` has requests running and may not go to `claimant` for that."""
        p = self.progress.get(h.pipeline)
        if p is None or not p.shard_load.get(h.dp_rank) or self.now - h.since >= self.rotate_s:
            return False
        specs = self.ledger.pipelines
        return specs[h.pipeline].priority >= specs[claimant].priority

    def short(self, pipeline: str) -> bool:
        """Its work per shard ends sooner than a move of one of them would repay (decided at
        the first look in a pass, so a pass's answers agree)."""
        out = self._short.get(pipeline)
        if out is None:
            work = self.work.get(pipeline)
            out = bool(work) and work / max(1, self.pool.shard_count[pipeline]) < self.margin * self.move_s
            self._short[pipeline] = out
        return out
