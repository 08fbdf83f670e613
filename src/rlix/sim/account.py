"""What each pipeline got: GPU-seconds held per role, and its longest wait with work but no shard.

Per-pipeline fairness needs what the ledger gave, not what the pipeline did with it: a
`HoldAccount` integrates, between ledger changes, the GPUs each pipeline holds in each role
(`rollout` for its shards, the stage's name, `train`, `logprob`..., for the rest; a shard counts
from its expand, waking included, to its shrink). A `ShardlessClock` measures the spans during
which a pipeline had work pending (trajectories released and not finished) and held no shard;
a pipeline that is down (not arrived, crashed, finished) is not waiting for a shard.
"""

from __future__ import annotations

from collections.abc import Callable

from rlix.scheduler.state import Ledger
from rlix.scheduler.types import Role, Stage

ROLLOUT = "rollout"


class HoldAccount:
    """GPU-seconds held, per pipeline and role, over one domain's ledger."""

    def __init__(self) -> None:
        self.t_last = 0.0
        self.counts: dict[str, dict[str, int]] = {}
        self.gpu_s: dict[str, dict[str, float]] = {}

    def advance(self, now: float) -> None:
        """Credit the current holdings up to `now`; call before every ledger change."""
        dt = now - self.t_last
        if dt > 0:
            for name, roles in self.counts.items():
                acc = self.gpu_s.setdefault(name, {})
                for role, n in roles.items():
                    acc[role] = acc.get(role, 0.0) + n * dt
        self.t_last = max(self.t_last, now)

    def recount(self, ledger: Ledger, stage_label: Callable[[str], str]) -> None:
        """Re-read the holdings; call after every ledger change. `stage_label(pipeline)` names
        an extra stage it holds (its scenario name: "reference", "logprob"...)."""
        counts: dict[str, dict[str, int]] = {}
        for h in ledger.holdings.values():
            roles = counts.setdefault(h.pipeline, {})
            if h.role is Role.GENERATE:
                role = ROLLOUT
            elif h.stage is Stage.LOGPROB:
                role = stage_label(h.pipeline)
            else:
                role = h.stage.name.lower()
            roles[role] = roles.get(role, 0) + len(h.gpus)
        self.counts = counts


class ShardlessClock:
    """Longest span a pipeline had pending work and held no rollout shard."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.longest = 0.0
        self.total = 0.0

    def update(self, now: float, waiting: bool) -> None:
        if waiting and self.since is None:
            self.since = now
        elif not waiting and self.since is not None:
            span = now - self.since
            self.longest = max(self.longest, span)
            self.total += span
            self.since = None

    def close(self, now: float) -> None:
        self.update(now, False)
