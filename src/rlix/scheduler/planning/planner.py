"""The pure planner: (ledger, pending requests, progress, now) -> Plan.

One pass, two phases:
  1. Non-rollout requests (init > train > logprob; then priority; then age) are granted first,
     preempting rollout shards. A request that has waited `aging_s` moves ahead of every
     younger request and nothing is granted past it while it is blocked, so its wait is
     bounded (docs/ARCHITECTURE.md states the bound).
  2. Rollout shards are rebalanced towards targets from `shares.rollout_targets`. Shrinks
     happen only to make room for a pipeline below its target, never to shards woken less
     than `dwell_s` ago (except to give a pipeline its first shard), and idle GPUs are then
     filled with shards for any pipeline whose demand is still unmet (work-conserving).
     Where pipelines report their rate (`Progress.seconds_per_trajectory`), a shard is taken
     from one pipeline for another only when the work it buys repays the move by
     `MoveCosts.margin` (`MoveGate`; a pipeline's first shard is never held back by it).
The planner never mutates the ledger; `Ledger.apply(plan)` does, after checking invariants.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from rlix.scheduler.costs import MoveCosts
from rlix.scheduler.planning.move_gate import ANY, NONE, WARM, MoveGate, report_is_stale
from rlix.scheduler.planning.pool import LOCKED, Pool
from rlix.scheduler.planning.shares import TIME_SLACK_S, Demand, floor_order, rollout_targets
from rlix.scheduler.planning.stage_placement import StagePlacer
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import GpuRequest, Grant, Holding, PipelineSpec, Plan, Progress, Stage


@dataclass(frozen=True)
class PlannerParams:
    """Knobs of the planning policy.

    dwell_s: a newly woken shard is not shrunk again for this long unless a non-rollout stage
      needs its GPUs or a pipeline would otherwise have no shard at all (stops thrash).
    aging_s: a non-rollout request waiting this long jumps ahead of every younger request and
      nothing is granted past it (bounds the wait; see docs/ARCHITECTURE.md).
    rotate_s: with more pipelines wanting a shard than the GPUs hold, a pipeline keeps its
      only (floor) shard this long; then the one of its tier that has waited longest without a
      shard takes it (bounds the rollout wait; see docs/ARCHITECTURE.md).
    report_stale_s: a progress report older than this counts as no report (full demand): the
      demand signal is evidence, and a pipeline whose reports stopped is not starved on an old
      one. None: reports never go stale.
    move_costs: what each move of a GPU costs and the margin by which the work it buys must
      exceed that (`rlix.scheduler.costs.MoveCosts`); used for pipelines that report their
      rate (`Progress.seconds_per_trajectory`), the others are planned as if moves were free.
    """

    dwell_s: float = 30.0
    aging_s: float = 60.0
    rotate_s: float = 120.0
    report_stale_s: float | None = None
    move_costs: MoveCosts = MoveCosts()

    def __post_init__(self) -> None:
        if self.dwell_s < 0 or self.aging_s < 0 or self.rotate_s < 0:
            raise ValueError("dwell_s, aging_s and rotate_s must be >= 0")
        if self.report_stale_s is not None and self.report_stale_s <= 0:
            raise ValueError("report_stale_s must be > 0 (or None: reports never go stale)")
        if not isinstance(self.move_costs, MoveCosts):
            raise ValueError(f"move_costs must be a MoveCosts, got {type(self.move_costs).__name__}")


def rollout_demand(spec: PipelineSpec, progress: Progress | None, now: float | None = None,
                   stale_s: float | None = None) -> int:
    """Shards a pipeline could use now. No report (or only one older than `stale_s`) means
    full demand: a pipeline that has not reported yet keeps its place instead of being
    starved. Pending work (requests at its router, a train step waiting for its batch) keeps
    a demand of at least one shard whatever `remaining` says: a report of 0 with work still
    queued would otherwise leave it shardless for good. A pipeline still setting up has none."""
    if progress is not None and progress.setting_up:
        return 0
    if progress is None or report_is_stale(progress, now, stale_s):
        return spec.max_shards
    wanted = math.ceil(progress.remaining / spec.seqs_per_shard) if progress.remaining > 0 else 0
    if wanted > 0:
        wanted = max(wanted, spec.min_shards)
    if progress.pending_work:
        wanted = max(wanted, 1)
    return min(spec.max_shards, wanted)


def plan(ledger: Ledger, requests: list[GpuRequest], progress: dict[str, Progress],
         now: float, params: PlannerParams = PlannerParams()) -> Plan:
    pool = Pool(ledger)
    stale_s = params.report_stale_s
    demand = {name: rollout_demand(spec, progress.get(name), now, stale_s)
              for name, spec in ledger.pipelines.items()}
    grants, wake_requests = _serve_requests(pool, ledger, requests, progress, demand, now, params)
    training = pool.training | {g.pipeline for g in grants}
    gate = MoveGate(pool, ledger, progress, now, params.move_costs, params.report_stale_s,
                    params.rotate_s, requests, training)
    wake_rollout = _rebalance_rollout(pool, ledger, progress, demand, now, params, training, gate)
    # only times still ahead: a deadline reached now was acted on by this pass, and a timer for
    # it would hide a later one (a rotation due after it was then never planned)
    wakes = [t for t in (wake_requests, wake_rollout, _stale_at(ledger, progress, demand, now, stale_s),
                         gate.due_until) if t is not None and t > now]
    return Plan(grants=grants, shrinks=pool.shrinks, expands=pool.expands,
                wake_at=min(wakes) if wakes else None)


def _stale_at(ledger: Ledger, progress: dict[str, Progress], demand: dict[str, int], now: float,
              stale_s: float | None) -> float | None:
    """When the next report that would change a demand goes stale."""
    if stale_s is None:
        return None
    times = [p.reported_at + stale_s for name, p in progress.items()
             if name in ledger.pipelines and not p.setting_up and demand[name] < ledger.pipelines[name].max_shards
             and p.reported_at + stale_s >= now]
    return min(times) + 1e-6 if times else None


# ---------------------------------------------------------------------- phase 1
def _serve_requests(pool: Pool, ledger: Ledger, requests: list[GpuRequest],
                    progress: dict[str, Progress], demand: dict[str, int],
                    now: float, params: PlannerParams) -> tuple[list[Grant], float | None]:
    def is_aged(r: GpuRequest) -> bool:
        # with float slack: a timer set for submitted_at + aging_s must find the request aged
        return now - r.submitted_at >= params.aging_s - TIME_SLACK_S

    def order(r: GpuRequest):
        if is_aged(r):
            return (0, r.submitted_at, r.id)
        prio = ledger.pipelines[r.pipeline].priority if r.pipeline in ledger.pipelines else 0
        return (1, int(r.stage), -prio, r.submitted_at, r.id)

    placer = StagePlacer(pool, ledger, progress, demand, now, params.dwell_s)
    grants: list[Grant] = []
    wake_at: float | None = None
    for r in sorted(requests, key=order):
        spec = ledger.pipelines.get(r.pipeline)
        if spec is None or r.stage is Stage.ROLLOUT or r.gpus <= 0:
            continue
        if ledger.stage_holding(r.pipeline, r.stage) is not None:
            continue
        aged = is_aged(r)
        chosen = placer.choose(spec, r.gpus) if r.gpus <= pool.unlocked() else None
        # Rollout floor reservation: until it ages, a grant may not take the last shard of a
        # pipeline of the same or a higher tier that still has rollout demand, unless idle GPUs
        # elsewhere can take that pipeline's shard in this same plan.
        if chosen is not None and not aged and placer.empties(spec, chosen, spec.priority) \
                and not placer.rehomed(spec, chosen, spec.priority):
            chosen = None
        if chosen is None:
            if aged:
                break  # no backfill past an aged request: this is what bounds its wait
            t = r.submitted_at + params.aging_s
            wake_at = t if wake_at is None else min(wake_at, t)
            continue
        # Sorted so the plan does not depend on the process's hash seed.
        for key in sorted({pool.state[g] for g in chosen if pool.state[g] is not None},
                          key=lambda k: (k[0], k[2])):
            pool.shrink(key)
        pool.lock(chosen)
        placer.changed(chosen)
        grants.append(Grant(r.id, r.pipeline, r.stage, tuple(sorted(chosen))))
    return grants, wake_at


# ---------------------------------------------------------------------- phase 2
def _rebalance_rollout(pool: Pool, ledger: Ledger, progress: dict[str, Progress],
                       demand: dict[str, int], now: float, params: PlannerParams,
                       training: set[str], gate: MoveGate) -> float | None:
    specs = ledger.pipelines
    demands = [Demand(name, demand[name], s.tp, s.priority, s.weight, s.min_shards,
                      pool.shard_count[name], ledger.shardless_since.get(name, ledger.version),
                      training=name in training,
                      held_s=now - ledger.holding_since.get(name, now), seq=i)
               for i, (name, s) in enumerate(specs.items())]
    target = rollout_targets(demands, pool.unlocked(), params.rotate_s)
    # Claims go most starved first; ties in the floor's order (not by name).
    first = {d.name: i for i, d in enumerate(sorted(demands, key=lambda d: floor_order(d, params.rotate_s)))}

    def protected(h: Holding) -> bool:
        return now - h.since < params.dwell_s

    _come_home(pool, ledger, target, progress, training, now, params.dwell_s)
    victims = _Victims(pool, specs, target, progress, first, gate)
    wake_at: float | None = None

    # Pipelines below target claim shards one at a time, most starved (relative) first.
    heap = [(-specs[n].priority, pool.shard_count[n] / t, first[n], n) for n, t in target.items()
            if pool.shard_count[n] < t]
    heapq.heapify(heap)
    while heap:
        name = heapq.heappop(heap)[-1]
        spec = specs[name]
        if pool.shard_count[name] >= target[name]:
            continue
        first_shard = pool.shard_count[name] == 0
        # taking a GPU from another pipeline: only where the work it buys repays the move
        mode = ANY if first_shard else gate.claim(name, pool.shard_count[name])
        free = pool.free_total >= spec.tp  # else no node has room without a shrink
        if mode == NONE and not free:
            continue
        rank = pool.next_rank(name, spec.max_shards)
        if rank is None:
            continue
        exclude = gate.exclude(name, first_shard)
        gpus = pool.place_shard(name, spec.tp, rank, exclude) if free else None
        if gpus is None:
            if mode == NONE:
                continue
            warm = gate.warm_targets(name, spec.max_shards, exclude) if mode == WARM else None
            if warm is not None:  # a start would not repay: only where an engine of it sleeps
                gpus, blocked_until = victims.make_warm_room(name, warm, protected, params.dwell_s)
            else:
                gpus, blocked_until = victims.make_room(name, spec.tp, exclude, first_shard,
                                                        protected, params.dwell_s)
            if gpus is None:
                if blocked_until is not None:
                    wake_at = blocked_until if wake_at is None else min(wake_at, blocked_until)
                continue
            rank = pool.next_rank(name, spec.max_shards)
            last = ledger.last_shard_gpus.get((name, rank)) if name in gate.work else None
            if last and last != gpus and all(pool.state[g] is None for g in last) \
                    and not exclude.intersection(last):
                gpus = last  # freed where this rank's engine is: it wakes, not starts anew
        pool.expand(name, rank, gpus, now)
        if pool.shard_count[name] < target[name]:
            heapq.heappush(heap, (-spec.priority, pool.shard_count[name] / target[name], first[name], name))

    _fill_idle(pool, ledger, demand, now, first, gate)
    rotation = _rotation_at(pool, demands, ledger, now, params.rotate_s)
    if rotation is not None:
        wake_at = rotation if wake_at is None else min(wake_at, rotation)
    return wake_at


def _come_home(pool: Pool, ledger: Ledger, target: dict[str, int], progress: dict[str, Progress],
               training: set[str], now: float, dwell_s: float) -> None:
    """A pipeline whose shards all sit on other pipelines' training homes while its own home is
    free moves one of them home, where its own engine sleeps (on whole GPUs, at its target: one
    below it claims its home as a further shard anyway). Each of those owners' train steps
    preempts a shard on its home mid-generation; with no shard of its own at home the pipeline
    then had nowhere to carry that work on, its home meanwhile lent to a third pipeline whose
    shard the next owner's step preempted in turn. At home only its own trainer preempts it, and
    a shard it borrows beside that one hands its work over to it when preempted. The least
    loaded one moves; none woken less than `dwell_s` ago."""
    homes = ledger.train_home
    if ledger.topology.slices != 1 or not homes:
        return
    owner = {g: name for name, home in homes.items() for g in home}
    for name, home in homes.items():
        spec = ledger.pipelines.get(name)
        wanted = target.get(name, 0)
        if spec is None or name in training or not pool.shard_count.get(name) or not wanted \
                or pool.shard_count[name] < wanted or ledger.shard_exclusion(name) & home:
            continue  # (no demand: its shards go to whoever claims them; below target: it claims)
        mine = [(key, h) for key, h in pool.shards.items() if h.pipeline == name]
        if any(owner.get(g) in (None, name) for _, h in mine for g in h.gpus):
            continue  # one of its shards is at home or on a GPU that is nobody's home
        free = sorted(g for g in home if pool.state[g] is None)
        movable = [(key, h) for key, h in mine if now - h.since >= dwell_s]
        if len(free) < spec.tp or not movable:
            continue
        prog = progress.get(name)
        load = prog.shard_load if prog is not None else {}
        key, h = min(movable, key=lambda kh: (load.get(kh[1].dp_rank, 0), kh[1].dp_rank))
        gpus = tuple(free[:spec.tp])
        pool.shrink(key)
        asleep_there = [r for r in range(spec.max_shards) if r not in pool.ranks[name]
                        and ledger.last_shard_gpus.get((name, r)) == gpus]
        pool.expand(name, asleep_there[0] if asleep_there else h.dp_rank, gpus, now)


def _rotation_at(pool: Pool, demands: list[Demand], ledger: Ledger, now: float,
                 rotate_s: float) -> float | None:
    """After this pass: while a pipeline that generates waits with no shard, the earliest time
    a holder of its tier or a lower one reaches `rotate_s` (then the waiter takes its shard).
    A pipeline that got its first shard in this pass starts its spell now."""
    if math.isinf(rotate_s):
        return None
    count = pool.shard_count
    waiting = [d.priority for d in demands if d.shards > 0 and not d.training and count[d.name] == 0]
    if not waiting:
        return None
    top = max(waiting)
    times = [ledger.holding_since.get(d.name, now) + rotate_s for d in demands
             if count[d.name] > 0 and not d.training and d.priority <= top]
    times = [t for t in times if t > now]
    return min(times) if times else None


def _fill_idle(pool: Pool, ledger: Ledger, demand: dict[str, int], now: float,
               first: dict[str, int], gate: MoveGate) -> None:
    """Work conservation: idle GPUs go to whoever still has unmet demand that fits (a training
    home whose owner wants it back sooner than a shard there would repay its wake excepted:
    `MoveGate.due`)."""
    specs = ledger.pipelines
    heap = [(-specs[n].priority, pool.shard_count[n] / d, first[n], n) for n, d in demand.items()
            if pool.shard_count[n] < d]
    heapq.heapify(heap)
    while heap and pool.free_total:
        name = heapq.heappop(heap)[-1]
        spec = specs[name]
        rank = pool.next_rank(name, spec.max_shards)
        if rank is None:
            continue
        gpus = pool.place_shard(name, spec.tp, rank, gate.exclude(name, pool.shard_count[name] == 0))
        if gpus is None:
            continue
        pool.expand(name, rank, gpus, now)
        if pool.shard_count[name] < demand[name]:
            heapq.heappush(heap, (-spec.priority, pool.shard_count[name] / demand[name], first[name], name))


class _Victims:
    """Shards that may be shrunk to make room: those of pipelines above their target,
    cheapest first (lowest tier, idle or least loaded, then the largest surplus); for a claim
    that is not a first shard, not those of a pipeline about to finish its work (`MoveGate.short`)."""

    def __init__(self, pool: Pool, specs: dict[str, PipelineSpec], target: dict[str, int],
                 progress: dict[str, Progress], first: dict[str, int], gate: MoveGate) -> None:
        self.pool, self.specs, self.target = pool, specs, target
        self.progress, self.first, self.gate = progress, first, gate
        self.order: list[tuple] | None = None  # built at the first make_room: most passes need none
        # (tp, exclude, first_shard, claimant's tier) -> blocked_until of a make_room that found
        # no room. Room only shrinks within a pass (claims add shards, victims only lose them; a
        # claimant is below its target, so its own shards are never victims), so that answer
        # stands, and it stands for a wider shard, more GPUs excluded or a lower tier too.
        self.failed: dict[tuple, float | None] = {}

    def _build(self) -> list[tuple]:
        pool, target, progress = self.pool, self.target, self.progress
        order = []
        for key, h in pool.shards.items():
            if pool.shard_count[h.pipeline] > target.get(h.pipeline, 0):
                prog = progress.get(h.pipeline)
                load = prog.shard_load.get(h.dp_rank, 0) if prog is not None and prog.shard_load else 0
                # last tie-break: yields first whoever comes last in the floor's order
                order.append((self.specs[h.pipeline].priority, load, -h.since,
                              -self.first[h.pipeline], h.dp_rank, key))
        order.sort()
        return order

    def make_room(self, name: str, tp: int, exclude: frozenset[int], first_shard: bool,
                  protected, dwell_s: float) -> tuple[tuple[int, ...] | None, float | None]:
        """Shrink victims on one node until `tp` GPUs are free there; those GPUs."""
        pool = self.pool
        tier = self.specs[name].priority
        memo = (tp, exclude, first_shard, tier)
        if memo in self.failed:
            return None, self.failed[memo]
        for (tp0, exclude0, first0, tier0), until in self.failed.items():
            if first0 == first_shard and tp >= tp0 and exclude0 <= exclude and tier <= tier0:
                return None, until
        gated = not first_shard and self.gate.work
        if self.order is None:
            self.order = self._build()
        usable: dict[int, list[tuple]] = {}
        room: dict[int, int] = {}
        blocked_until: float | None = None
        kept: list[tuple] = []  # entries still worth a look by later calls
        order = self.order
        for i, entry in enumerate(order):
            key = entry[-1]
            h = pool.shards.get(key)
            if h is None or pool.shard_count[h.pipeline] <= self.target.get(h.pipeline, 0):
                continue  # gone, or its pipeline is down to its target: for good in this pass
            kept.append(entry)
            if h.pipeline == name:
                continue
            if protected(h) and not first_shard:
                t = h.since + dwell_s
                blocked_until = t if blocked_until is None else min(blocked_until, t)
                continue
            if gated and self.gate.short(h.pipeline):
                continue
            if gated and self.gate.busy(h, name):
                t = h.since + self.gate.rotate_s  # then it may go, busy or not
                blocked_until = t if blocked_until is None else min(blocked_until, t)
                continue
            node = pool.node_of[h.gpus[0]]
            usable.setdefault(node, []).append(key)
            if node not in room:
                room[node] = len(pool.free_gpus_on(node, exclude))
            room[node] += sum(1 for g in h.gpus if g not in exclude)
            if room[node] >= tp:
                self.order = kept + order[i + 1:]
                for k in usable[node]:
                    pool.shrink(k)
                    if len(pool.free_gpus_on(node, exclude)) >= tp:
                        break
                return tuple(pool.free_gpus_on(node, exclude)[:tp]), None
        self.order = kept
        self.failed[memo] = blocked_until
        return None, blocked_until

    def make_warm_room(self, name: str, warm: dict[int, list[tuple[int, ...]]], protected,
                       dwell_s: float) -> tuple[tuple[int, ...] | None, float | None]:
        """Free the GPUs of one of `name`'s sleeping engines (`MoveGate.warm_targets`, in rank
        order) where every shard on them may be shrunk (a victim, not within its dwell time,
        not about to finish); those GPUs (a claim that is never a first shard)."""
        pool, target, gate = self.pool, self.target, self.gate
        blocked_until: float | None = None
        for targets in warm.values():
            for gpus in targets:
                keys: set[tuple] = set()
                until: float | None = None
                for g in gpus:
                    key = pool.state[g]
                    if key is None:
                        continue
                    h = pool.shards.get(key) if key is not LOCKED else None
                    if h is None or h.pipeline == name or gate.short(h.pipeline) or gate.busy(h, name) \
                            or pool.shard_count[h.pipeline] <= target.get(h.pipeline, 0):
                        break
                    if protected(h):
                        until = max(until or 0.0, h.since + dwell_s)
                    keys.add(key)
                else:
                    if until is not None:
                        blocked_until = until if blocked_until is None else min(blocked_until, until)
                        continue
                    for k in sorted(keys, key=lambda k: (k[0], k[2])):
                        pool.shrink(k)
                    return gpus, None
        return None, blocked_until
