"""A pipeline's step-numbered checkpoints: RUN_DIR/NAME/checkpoint/step-NNNNNN/.

A checkpoint is written under a temporary name (`.step-NNNNNN.partial`) and renamed into place
once the trainer has saved it whole, so a folder named `step-NNNNNN` is always complete: a save
cut short (a kill, a full disk) leaves only a temporary folder, which no resume reads and the
next save removes. After each save the folder is pruned to the newest `keep_last` checkpoints
plus the `keep_best` best by a metric of metrics.jsonl.

Filesystem only (no torch): `rlix export` and the tests read it without a trainer.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: a complete checkpoint's folder name
STEP_NAME = re.compile(r"^step-(\d{6,})$")
#: the file every trainer checkpoint holds (its step, seed and model)
TRAINER_FILE = "trainer.json"
#: where checkpoints of runs before step numbering were kept; resumed from when nothing newer is there
LEGACY_NAME = "trainer"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def partial_path(root: Path, step: int) -> Path:
    """Where a save of `step` is written before it is complete (a hidden name no reader takes)."""
    return root / f".{step_name(step)}.partial"


def complete(root: Path) -> list[Checkpoint]:
    """Every complete checkpoint under `root`, oldest first. A folder with a step name but no
    trainer.json (copied in part by hand) is not one."""
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        m = STEP_NAME.match(child.name)
        if m and child.is_dir() and (child / TRAINER_FILE).is_file():
            found.append(Checkpoint(int(m.group(1)), child))
    return sorted(found, key=lambda c: c.step)


def newest(root: Path) -> Checkpoint | None:
    """The checkpoint `--resume` continues from: the newest complete one; else one left by a run
    from before step numbering (`checkpoint/trainer`)."""
    found = complete(root)
    if found:
        return found[-1]
    legacy = root / LEGACY_NAME / TRAINER_FILE
    if legacy.is_file():
        return Checkpoint(int(json.loads(legacy.read_text())["step"]), legacy.parent)
    return None


def publish(root: Path, partial: Path, step: int) -> Path:
    """Rename a finished save into place as `step`'s checkpoint (a checkpoint of the same step
    already there, from a save on exit after the last periodic one, is replaced)."""
    final = root / step_name(step)
    if final.exists():
        old = root / f".{step_name(step)}.old"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(final)
    return final


def step_scores(rows: Iterable[dict], metric: str) -> dict[int, float]:
    """Each step's value of `metric`: the mean over that step's rows that carry it as a number
    (one training row per step; evaluation rows may add more)."""
    values: dict[int, list[float]] = {}
    for row in rows:
        value, step = row.get(metric), row.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(step, int):
            values.setdefault(step, []).append(float(value))
    return {step: sum(v) / len(v) for step, v in values.items()}


def to_keep(found: list[Checkpoint], keep_last: int, keep_best: int, scores: dict[int, float],
            mode: Literal["max", "min"] = "max") -> set[int]:
    """The steps kept: the newest `keep_last`, and the `keep_best` best ranked by `scores`
    (checkpoints without a score are not ranked; of equal scores the newer ranks first)."""
    steps = [c.step for c in found]
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    ranked = [s for s in steps if s in scores]
    sign = 1.0 if mode == "max" else -1.0
    ranked.sort(key=lambda s: (sign * scores[s], s), reverse=True)
    return keep | set(ranked[:keep_best])


def prune(root: Path, keep_last: int, keep_best: int = 0, scores: dict[int, float] | None = None,
          mode: Literal["max", "min"] = "max") -> list[int]:
    """Remove the checkpoints `to_keep` does not keep and any save left unfinished (call it after
    a save, never during one); returns the steps removed."""
    found = complete(root)
    keep = to_keep(found, keep_last, keep_best, scores or {}, mode)
    removed = []
    for c in found:
        if c.step not in keep:
            shutil.rmtree(c.path, ignore_errors=True)
            removed.append(c.step)
    for child in root.iterdir() if root.is_dir() else []:
        if child.name.startswith(".step-") and (child.name.endswith(".partial") or child.name.endswith(".old")):
            shutil.rmtree(child, ignore_errors=True)
    legacy = root / LEGACY_NAME
    if found and legacy.is_dir():  # superseded by a step-numbered one
        shutil.rmtree(legacy, ignore_errors=True)
    return removed
