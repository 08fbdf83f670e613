"""RUN_DIR/PIPELINE/metrics.jsonl: one JSON row per training step, appended as steps end and
rewritten whole on resume (rows past the checkpoint dropped), so a kill leaves at most one row
cut short, which reading drops."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line cut short by a kill is dropped."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
