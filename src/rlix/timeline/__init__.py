"""A run's timeline: who held every GPU when and why, what each pipeline did, and where every
GPU-second went. Pure (no Ray): it reads a run's summary (`rlix.run_summary.RunSummary`:
`rlix run`'s summary.json, or the simulator's of the same shape) and writes

- RUN_DIR/timeline.json: a Chrome / Perfetto trace (`trace.py`);
- RUN_DIR/timeline.png: a Gantt chart, GPUs as rows, pipelines as colours (`chart.py`);
- the GPU-time account (`account.py`): `summary.json`'s `gpu_account`, printed at a run's end.

`rlix run` writes all three at the end of a run, whatever the ending; `rlix timeline RUN_DIR`
redraws the files from summary.json; `rlix sim --out DIR` writes them for each policy's run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlix.run_summary import RunSummary
from rlix.timeline.account import account_lines, gpu_account
from rlix.timeline.model import CATEGORIES, FREE, HELD, Holding, Part, Timeline, build_timeline
from rlix.timeline.trace import chrome_trace

TRACE_FILE = "timeline.json"
CHART_FILE = "timeline.png"

__all__ = ["CATEGORIES", "CHART_FILE", "FREE", "HELD", "Holding", "Part", "TRACE_FILE", "Timeline",
           "account_lines", "build_timeline", "chrome_trace", "draw_png", "gpu_account",
           "run_fields", "write_timeline"]


def draw_png(tl: Timeline, path: str | Path, title: str = "") -> Path:
    # deferred: chart.py imports matplotlib (most of a second), only drawing needs it
    from rlix.timeline.chart import draw_png as draw

    return draw(tl, path, title)


def run_fields(started_at: float, ended_at: float, gpu_nodes: Sequence[int]) -> dict[str, Any]:
    """What a summary's `run` holds for its timeline (`RunSpan`'s JSON data): the run's
    wall-clock span and the node (index) of each GPU the scheduler handed out."""
    return {"started_at": started_at, "ended_at": ended_at, "gpu_nodes": [int(n) for n in gpu_nodes]}


def write_timeline(run_dir: str | Path, summary: RunSummary | Mapping[str, Any], title: str | None = None,
                   chart: bool = True) -> dict[str, Any]:
    """RUN_DIR/timeline.json (and timeline.png with `chart`) from a summary (its JSON data is
    validated as a RunSummary); returns the account, rounded to milliseconds."""
    run_dir = Path(run_dir)
    summary = RunSummary.coerce(summary)
    tl = build_timeline(summary)
    title = title if title is not None else (summary.config or run_dir.name)
    (run_dir / TRACE_FILE).write_text(json.dumps(chrome_trace(tl, title)))
    if chart:
        draw_png(tl, run_dir / CHART_FILE, title)
    return gpu_account(tl, digits=3)
