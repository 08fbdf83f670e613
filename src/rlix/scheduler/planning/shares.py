"""How many rollout shards each pipeline should have: a pure function of demand and capacity.

Order of claims on the rollout GPUs:
  1. one shard for every pipeline with demand while the GPUs last, in `floor_order`: highest
     tier first; within a tier, a pipeline that generates goes before one that trains; a
     holder keeps its shard for `rotate_s`, then the pipeline that has waited longest without
     a shard goes first, and holders past `rotate_s` come last (the one that has held longest
     last of all): the floor rotates, so who waits never depends on names;
  2. then each pipeline's `min_shards`, again by tier;
  3. then, tier by tier from the highest, the rest is water-filled in proportion to
     demand x weight, never above a pipeline's demand.
GPU counts are used here (a shard costs `tp` GPUs); where the shards physically fit is the
placement's business, and whatever it cannot place is filled work-conservingly afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: float slack on planned times: a re-plan timed for a deadline must find it reached
TIME_SLACK_S = 1e-6


@dataclass(frozen=True)
class Demand:
    name: str
    shards: int  # wanted, already capped at max_shards
    tp: int
    priority: int
    weight: float
    min_shards: int
    current: int  # shards it holds now (tie-break: keep what you have)
    waiting_since: int = 0  # when it last lost (or never had) a shard; earlier goes first
    training: bool = False  # trains now: its floor shard yields to one that only generates
    held_s: float = 0.0  # holders: how long its current spell with shards has lasted
    seq: int = 0  # registration order: the last tie-break (never the name)


def floor_order(d: Demand, rotate_s: float) -> tuple:
    """Sort key for the one-shard floor. Exact ties (same tier, same spell start) go by
    registration order, never by name: renaming pipelines cannot move starvation around."""
    if d.training:
        return (-d.priority, 3, -d.current, d.waiting_since, d.seq)
    if d.current > 0:
        # (a wake-up planned for `since + rotate_s` must see the spell as over: float slack)
        return (-d.priority, 0 if d.held_s < rotate_s - TIME_SLACK_S else 2, d.held_s, d.seq)
    return (-d.priority, 1, d.waiting_since, d.seq)


def rollout_targets(demands: list[Demand], capacity_gpus: int,
                    rotate_s: float = math.inf) -> dict[str, int]:
    target = {d.name: 0 for d in demands}
    left = capacity_gpus
    wanting = [d for d in demands if d.shards > 0]
    by_tier = sorted(wanting, key=lambda d: floor_order(d, rotate_s))

    for floor_of in (lambda d: 1, lambda d: min(d.shards, max(1, d.min_shards))):
        for d in by_tier:
            while target[d.name] < floor_of(d) and left >= d.tp:
                target[d.name] += 1
                left -= d.tp

    tiers = sorted({d.priority for d in wanting}, reverse=True)
    for tier in tiers:
        if left <= 0:
            break
        members = [d for d in wanting if d.priority == tier]
        left = _water_fill(members, target, left)
    return target


def _water_fill(members: list[Demand], target: dict[str, int], left: int) -> int:
    """Share `left` GPUs within one tier in proportion to demand x weight, capped at demand."""
    open_ = [d for d in members if target[d.name] < d.shards]
    want_gpus = {d.name: (d.shards - target[d.name]) * d.tp for d in open_}
    share: dict[str, float] = {d.name: 0.0 for d in open_}
    budget = float(left)
    while open_ and budget > 1e-9:
        total = sum(d.shards * d.weight for d in open_)
        saturated = []
        for d in open_:
            portion = budget * d.shards * d.weight / total
            if share[d.name] + portion >= want_gpus[d.name]:
                saturated.append(d)
        if not saturated:
            for d in open_:
                share[d.name] += budget * d.shards * d.weight / total
            budget = 0.0
            break
        for d in saturated:
            budget -= want_gpus[d.name] - share[d.name]
            share[d.name] = float(want_gpus[d.name])
            open_.remove(d)

    # Whole shards: floor every share, then hand out what remains by largest remainder.
    remainders = []
    for d in members:
        if d.name not in share:
            continue
        whole = min(int(math.floor(share[d.name] / d.tp + 1e-9)), d.shards - target[d.name])
        target[d.name] += whole
        left -= whole * d.tp
        remainders.append((share[d.name] / d.tp - whole, -d.priority, d.seq, d))
    for _, _, _, d in sorted(remainders, key=lambda r: (-r[0], r[1], r[2])):
        if target[d.name] < d.shards and left >= d.tp:
            target[d.name] += 1
            left -= d.tp
    return left
