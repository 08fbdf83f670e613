"""What `rlix status` shows: the scheduler dashboard's typed state (rlix.scheduler.dashboard:
the same pipelines table and GPU rows the page draws) as rich tables.

Pure rendering, so the table is tested from a state built without Ray; a live view fetches a
new state and renders it again.
"""

from __future__ import annotations

from typing import TextIO

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from rlix.scheduler.dashboard import DashboardState, GpuRow, PipelineRow


#: `rlix status` written to a file or a pipe: rows as wide as their cells, up to this (rich cuts
#: to the terminal's width on a terminal, and to 80 columns off one unless told a width)
PIPED_WIDTH = 1000


def status_console(file: TextIO | None = None) -> Console:
    """The console `rlix status` prints to: the terminal's width on a terminal; otherwise
    PIPED_WIDTH, so that a table piped to a file or another program keeps whole rows (a table
    is only as wide as its cells: nothing is padded out to that width)."""
    console = Console(file=file)
    return console if console.is_terminal else Console(file=file, width=PIPED_WIDTH)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def gpu_role(row: GpuRow) -> str:
    return f"generate #{row.rank}" if row.role == "generate" else row.role


def held_for(row: GpuRow) -> float | None:
    """How long the GPU has had its current holder (None: idle, or held since before the window,
    shown as the window's length)."""
    if row.pipeline is None or not row.segments:
        return None
    return -row.segments[-1].start_s


def waiting(row: PipelineRow) -> str:
    if row.waiting_for is None:
        return "-"
    gpus = row.waiting_gpus or 0
    return f"{row.waiting_for} {gpus} GPU{'s' if gpus != 1 else ''} for {_secs(row.waiting_s)}"


def render(state: DashboardState, address: str, jobs: list[str] | None = None) -> Group:
    """Two tables (GPUs, pipelines) and the jobs lines of a shared cluster, for a rich console."""
    gpu_table = Table(title=f"rlix cluster at {address}: {state.gpus_total} GPU(s), {state.gpus_idle} idle"
                      + (f", {state.gpus_lost} lost" if state.gpus_lost else ""), title_justify="left")
    for column in ("gpu", "node", "pipeline", "role", "held for"):
        gpu_table.add_column(column)
    for g in state.gpus:
        style = "dim" if g.pipeline is None else ("bold" if g.role == "train" else "")
        gpu_table.add_row(str(g.gpu), str(g.node), g.pipeline or "-", gpu_role(g), _secs(held_for(g)),
                          style=style)
    registered = [p for p in state.pipelines if p.state not in ("left", "failed")]
    pipe_table = Table(title=f"{len(registered)} pipeline(s) registered", title_justify="left")
    for column in ("pipeline", "state", "priority", "shards", "demand", "train GPUs", "step", "remaining",
                   "waiting for"):
        pipe_table.add_column(column)
    for p in state.pipelines:
        pipe_table.add_row(
            p.name, p.state + (f": {p.error}" if p.error else ""), "-" if p.priority is None else str(p.priority),
            f"{p.shards}/{p.max_shards}" if p.max_shards is not None else str(p.shards),
            "-" if p.demand_shards is None else str(p.demand_shards), str(len(p.train_gpus)),
            "-" if p.step is None else str(p.step), "-" if p.remaining is None else str(p.remaining),
            waiting(p), style="dim" if p.state in ("left", "failed") else "")
    parts: list = [gpu_table, pipe_table]
    if state.restarts:
        parts.append(Text(f"scheduler restarted {state.restarts} time(s)"))
    if jobs:
        parts.append(Text("\n".join(jobs)))
    return Group(*parts)
