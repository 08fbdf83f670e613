"""What `rlix status` shows: typed rows built from a scheduler snapshot, and their rich tables.

Pure functions of the snapshot (no Ray), so the table is testable from a recorded snapshot and
a live view only has to fetch a new snapshot and render it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class GpuRow:
    gpu: int
    node: int
    holder: str | None  # pipeline name; None: idle
    role: str  # "train", "generate #rank", "idle" or "lost"
    held_s: float | None  # how long the current holder has had it


@dataclass(frozen=True)
class PipelineRow:
    name: str
    priority: int
    weight: float
    shards: int
    training_gpus: int
    remaining: int | None  # trajectories still needed, from its last report
    step: int | None
    report_age_s: float | None
    waiting: str  # what it waits for: "-" or e.g. "train 1 GPU for 3.2s"


@dataclass(frozen=True)
class StatusView:
    address: str
    now: float
    gpus: list[GpuRow]
    pipelines: list[PipelineRow]
    restarts: int
    last_error: str | None


def _node_of(gpu: int, nodes: list[int]) -> int:
    start = 0
    for index, count in enumerate(nodes):
        if gpu < start + count:
            return index
        start += count
    return max(len(nodes) - 1, 0)


def build_view(snapshot: dict, address: str) -> StatusView:
    """The rows of a scheduler snapshot (`SchedulerService.snapshot`)."""
    now = float(snapshot.get("now", 0.0))
    ledger = snapshot.get("ledger", {})
    nodes = list(ledger.get("nodes", [])) or [int(ledger.get("gpus", 0))]
    lost = set(ledger.get("lost", []))
    held: dict[int, tuple[str, str, float]] = {}
    for h in ledger.get("holdings", []):
        role = "train" if h["role"] == "train" else f"generate #{h['dp_rank']}"
        if h["role"] == "train" and h.get("stage") not in (None, "train"):
            role = h["stage"]
        for g in h["gpus"]:
            held[int(g)] = (h["pipeline"], role, now - float(h["since"]))
    gpus = []
    for g in range(int(ledger.get("gpus", sum(nodes)))):
        if g in held:
            pipeline, role, age = held[g]
            gpus.append(GpuRow(g, _node_of(g, nodes), pipeline, role, max(age, 0.0)))
        else:
            gpus.append(GpuRow(g, _node_of(g, nodes), None, "lost" if g in lost else "idle", None))
    waiting: dict[str, list[str]] = {}
    for r in snapshot.get("pending", []):
        waiting.setdefault(r["pipeline"], []).append(
            f"{r['stage']} {r['gpus']} GPU{'s' if r['gpus'] != 1 else ''} for {r['waiting_s']:.1f}s")
    progress = snapshot.get("progress", {})
    pipelines = []
    for name, spec in sorted(snapshot.get("pipelines", {}).items()):
        report = progress.get(name)
        pipelines.append(PipelineRow(
            name=name, priority=int(spec.get("priority", 0)), weight=float(spec.get("weight", 1.0)),
            shards=len(spec.get("shards", {})), training_gpus=len(spec.get("train_gpus_held", [])),
            remaining=report["remaining"] if report else None,
            step=report["step"] if report else None,
            report_age_s=max(now - float(report["reported_at"]), 0.0) if report else None,
            waiting="; ".join(waiting.get(name, [])) or "-"))
    return StatusView(address=address, now=now, gpus=gpus, pipelines=pipelines,
                      restarts=int(snapshot.get("restarts", 0)), last_error=snapshot.get("last_error"))


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def render(view: StatusView, jobs: list[str] | None = None) -> Group:
    """Two tables (GPUs, pipelines) and the jobs lines of a shared cluster, for a rich console."""
    gpu_table = Table(title=f"rlix cluster at {view.address}: {len(view.gpus)} GPU(s)",
                      title_justify="left")
    for column in ("gpu", "node", "pipeline", "role", "held for"):
        gpu_table.add_column(column)
    for row in view.gpus:
        style = "dim" if row.holder is None else ("bold" if row.role == "train" else "")
        gpu_table.add_row(str(row.gpu), str(row.node), row.holder or "-", row.role,
                          _secs(row.held_s), style=style)
    pipe_table = Table(title=f"{len(view.pipelines)} pipeline(s) registered", title_justify="left")
    for column in ("pipeline", "priority", "weight", "shards", "train GPUs", "remaining", "step",
                   "report age", "waiting for"):
        pipe_table.add_column(column)
    for p in view.pipelines:
        pipe_table.add_row(p.name, str(p.priority), f"{p.weight:g}", str(p.shards), str(p.training_gpus),
                           "-" if p.remaining is None else str(p.remaining),
                           "-" if p.step is None else str(p.step), _secs(p.report_age_s), p.waiting)
    parts: list = [gpu_table, pipe_table]
    if view.restarts:
        parts.append(Text(f"scheduler restarted {view.restarts} time(s)"))
    if view.last_error:
        parts.append(Text(f"last scheduler error: {view.last_error}", style="red"))
    if jobs:
        parts.append(Text("\n".join(jobs)))
    return Group(*parts)
