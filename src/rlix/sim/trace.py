"""A simulated run recorded as `rlix run` records a real one, for `rlix.timeline`: the GPU role
log (with the scheduler core's reasons), each pipeline's shard events ([at, kind, ranks, version,
seconds]: sleep, wake, sync, refit, activate) and its steps' records. `rlix sim --out DIR` writes
DIR/POLICY/summary.json in that shape and the timeline beside it (`rlix timeline` redraws it).
Times are simulated seconds from 0."""

from __future__ import annotations

from collections.abc import Iterable

from rlix.run_summary import RunSummary
from rlix.scheduler.core import gpu_roles, plan_reason
from rlix.scheduler.state import Ledger
from rlix.timeline import run_fields


class SimTrace:
    def __init__(self) -> None:
        self.changes: list[dict] = []
        self.roles: dict[int, str] = {}  # global GPU id -> role
        self.events: dict[str, list[list]] = {}
        self.records: dict[str, list[dict]] = {}
        self.step_start: dict[str, float] = {}

    def note_roles(self, ledger: Ledger, gpu_ids: list[int], now: float, reason: str | None) -> None:
        """Log the GPUs of one domain whose role changed; None: a plan's (see `plan_reason`)."""
        roles = {gpu_ids[g]: r for g, r in gpu_roles(ledger.snapshot()).items()}
        for g in gpu_ids:
            before, after = self.roles.get(g, "idle"), roles.get(g, "idle")
            if before != after:
                self.changes.append({"seq": len(self.changes) + 1, "at": now, "gpu": g, "before": before,
                                     "after": after, "reason": reason or plan_reason(after)})
                self.roles[g] = after

    def event(self, pipeline: str, at: float, kind: str, ranks: Iterable[int], seconds: float = 0.0,
              version: int | None = None) -> None:
        self.events.setdefault(pipeline, []).append([at, kind, sorted(ranks), version, seconds])

    def step(self, pipeline: str, step: int, started: float, requested: float, granted: float,
             train_s: float, finished: float, reload_s: float = 0.0, offload_s: float = 0.0) -> None:
        """A train step: the batch waited for from `started`, GPUs asked for at `requested`,
        granted at `granted`: the trainer's reload, `train_s` of training and its offload, the
        step ending at `finished`."""
        start = max(self.step_start.get(pipeline, started), started)
        record = {"step": step, "generate_s": max(0.0, requested - start), "wait_gpus_s": granted - requested,
                  "train_s": train_s, "step_s": finished - start, "finished_at": finished}
        if reload_s or offload_s:
            record.update(reload_s=reload_s, offload_s=offload_s)
        self.records.setdefault(pipeline, []).append(record)
        self.step_start[pipeline] = finished

    def summary(self, name: str, policy: str, end: float, gpu_nodes: list[int],
                pipelines: Iterable[str]) -> RunSummary:
        """The run as `rlix run`'s summary.json has it. Events are cut at `end` (a wake or sync
        planned for later than the pipeline's end never happened)."""
        def cut(events: list[list]) -> list[list]:
            out = []
            for at, kind, ranks, version, seconds in sorted(events, key=lambda e: e[0]):
                if at - seconds < end or not seconds and at <= end:
                    out.append([min(at, end), kind, ranks, version, seconds - max(0.0, at - end)])
            return out

        return RunSummary.model_validate({
            "config": f"{name} ({policy}, simulated)", "mode": f"sim {policy}", "wall_s": end,
            "run": run_fields(0.0, end, gpu_nodes), "role_changes": self.changes, "lost_nodes": [],
            "pipelines": {p: {"records": self.records.get(p, []), "events": cut(self.events.get(p, []))}
                          for p in pipelines}})
