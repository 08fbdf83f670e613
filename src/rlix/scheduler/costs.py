"""What moving a GPU between roles costs, in seconds: one table for the planner and the simulator.

The planner moves a GPU only when the work it buys repays the move (see `MoveCosts`); the
simulator (`rlix sim`) charges the same figures, so what it predicts is what the planner plans
on. The GPU benchmark can write a measured table (`save_move_costs`) that both read
(`load_move_costs`): a YAML or JSON file

    costs:                # MoveCosts' fields; an unknown one is refused, named
      sleep_s: 0.055
      wake_sync_s: 0.041
      ...
    about: "the cards, the model shape, the benchmark and the date it was measured"   # optional, free text
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlix.errors import ConfigError
from rlix.safe_yaml import load_yaml


class MoveCosts(BaseModel):
    """Seconds each move of a GPU costs, and how much work a move must promise to be made.

    Defaults are the upper ends of what one GPU measured for 0.5B-1.5B shapes (docs/BENCHMARKS.md,
    "The main job on one real GPU"): a bigger model or a slower link costs more, so a cluster
    should measure its own table (the GPU benchmark writes one; `load_move_costs` reads it).

    sleep_s: a shard's level-2 sleep until its GPU is free (with the HTTP call and the aborted
      requests handed back).
    wake_sync_s: a sleeping shard's wake plus the weight sync until it serves.
    sync_s: the weight-sync part of `wake_sync_s`; also what an awake shard pauses for after
      each train step (its refit). At most `wake_sync_s`.
    recapture_s: the CUDA graphs a level-2 sleep released are captured again by the first decode
      steps after a wake: part of every wake's cost where graphs do not survive a sleep.
    trainer_reload_s / trainer_offload_s: a trainer (or a log-prob stage's model) moves its
      weights and optimiser state onto its GPUs before a step, and off them after it, so that
      shards can use those GPUs in between (0.1-0.3 s each).
    cold_start_s: a shard process started where its pipeline's dp rank has no engine (a process
      cannot change devices, so a rank that never ran on those GPUs starts anew: 11-15 s).
    margin: a move is made only when the work it buys is at least `margin` x its cost (2: half
      of what the move buys may be misestimated and it still pays). 0 switches the check off.

    Why: measured on real GPUs, time-sharing lost to giving each pipeline its own GPUs partly
    because moves never repaid their cost (a GPU taken for less work than its sleep and wake,
    a pipeline near its end slowed by moves that could not pay back before it ended).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    sleep_s: float = Field(0.3, ge=0, allow_inf_nan=False)
    wake_sync_s: float = Field(0.1, ge=0, allow_inf_nan=False)
    sync_s: float = Field(0.05, ge=0, allow_inf_nan=False)
    recapture_s: float = Field(0.6, ge=0, allow_inf_nan=False)
    trainer_reload_s: float = Field(0.3, ge=0, allow_inf_nan=False)
    trainer_offload_s: float = Field(0.3, ge=0, allow_inf_nan=False)
    cold_start_s: float = Field(15.0, ge=0, allow_inf_nan=False)
    margin: float = Field(2.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _sync_within_wake(self) -> "MoveCosts":
        if self.sync_s > self.wake_sync_s:
            raise ValueError(f"sync_s ({self.sync_s}) is part of wake_sync_s ({self.wake_sync_s}) "
                             f"and cannot exceed it")
        return self

    @property
    def wake_s(self) -> float:
        """A sleeping shard's wake until it serves at full speed (sync and graph capture)."""
        return self.wake_sync_s + self.recapture_s

    def expand_s(self, cold: bool) -> float:
        """A shard brought up on GPUs: a wake, plus a process start where it has no engine."""
        return self.wake_s + (self.cold_start_s if cold else 0.0)

    @property
    def gated(self) -> bool:
        """Whether the planner weighs moves at all (`margin` 0: it does not)."""
        return self.margin > 0


def problems(err: ValidationError, prefix: str = "") -> str:
    """A MoveCosts validation error as `field: reason (got value)`, joined on one line."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (*([prefix] if prefix else []), *e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif "input" in e and e["type"] != "missing" and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def move_costs_from(data: object, source: str = "<costs>") -> MoveCosts:
    """A table from a file's parsed content: a mapping with `costs` (and optionally `about`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with `costs:` at the top level, "
                          f"got {type(data).__name__}")
    extra = sorted(set(data) - {"costs", "about"})
    if extra:
        raise ConfigError(f"{source}: {extra[0]}: unknown field (a cost table has `costs:` and "
                          f"an optional `about:`)")
    if "costs" not in data:
        raise ConfigError(f"{source}: costs: missing (the table's figures go under `costs:`)")
    costs = data["costs"]
    if not isinstance(costs, dict):
        raise ConfigError(f"{source}: costs: expected a mapping, got {type(costs).__name__}")
    try:
        return MoveCosts.model_validate(costs)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {problems(exc, 'costs')}") from None


def load_move_costs(path: str | Path) -> MoveCosts:
    """Read a cost table (YAML or JSON, which is YAML too) with the config's bounded loader (no
    alias bombs, no duplicate keys, a size cap); every problem is one ConfigError naming file and
    field."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: no such cost table")
    return move_costs_from(load_yaml(p), str(p))


def save_move_costs(path: str | Path, costs: MoveCosts, about: str | None = None) -> Path:
    """Write a table `load_move_costs` reads back (JSON, which is YAML too)."""
    p = Path(path)
    doc: dict = {"costs": costs.model_dump()}
    if about:
        doc["about"] = about
    p.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return p
