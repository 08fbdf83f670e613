"""A run's result, RUN_DIR/summary.json, as one typed model: `rlix run` writes it through
`RunSummary` and every reader (the summary table, the timeline, `rlix timeline`, the CLI's exit
code) reads it back through `RunSummary`, so a field renamed or retyped on one side is refused
at once instead of read as missing.

The file keeps the plain JSON shape scripts and tests index: a key the producer left out (a
failed pipeline's summary has only a few, the simulator's only `records` and `events`) stays
out when written (`RunSummary.to_json` dumps the fields that were set). Imports nothing of
rlix but its errors, so any layer may read or write it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer, model_validator

from rlix.errors import ConfigError, format_validation_error

SUMMARY_FILE = "summary.json"


class _Part(BaseModel):
    """Unknown keys refused (drift between producer and model shows at once); NaN and infinity
    written as JSON's NaN / Infinity, as json.dumps does (a diverged loss stays readable)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


# ------------------------------------------------------------------ run-level parts
class RoleChange(_Part):
    """One GPU's role or owner changed (the scheduler's role log, on wall-clock time)."""

    seq: int = 0
    at: float
    gpu: int
    before: str
    after: str
    reason: str | None = None  # absent in logs written before changes carried one


class LostNode(_Part):
    """A node that left the cluster mid-run, with what the scheduler lost with it."""

    node_id: str
    gpus: list[int]
    at: float
    shards: list[str] = []
    training: list[str] = []
    homeless: list[str] = []
    error: str | None = None  # the scheduler could not be told


class LedgerAudit(_Part):
    """The scheduler ledger's invariants checked after an event (`after`); a failed call has
    only ok, error and after."""

    ok: bool
    error: str | None
    after: str
    pipelines: list[str] = []
    holders: list[str] = []
    restarts: int = 0


class RunSpan(_Part):
    """The run's wall-clock span and the node (index) of each GPU the scheduler handed out."""

    started_at: float
    ended_at: float
    gpu_nodes: list[int]


class PipelineAccount(_Part):
    """One pipeline's GPU-seconds by category (rlix.timeline.model.HELD) and their sum."""

    generate: float
    train: float
    sync: float
    switch: float
    waiting: float
    held: float


class GpuAccount(_Part):
    """Every GPU-second of the run, once (rlix.timeline.account.gpu_account)."""

    gpus: int
    span_s: float
    gpu_s: float
    idle_s: float
    lost_s: float
    pipelines: dict[str, PipelineAccount]
    role_changes: int


# ------------------------------------------------------------------ pipeline parts
class StepRow(_Part):
    """One train step (rlix.pipeline.async_grpo.StepRecord). Defaults: the simulator records
    only the phases it models, and the timeline reads rows that lack some."""

    step: int | None = None
    reward: float | None = None  # None: not recorded (the simulator's steps)
    reward_std: float = 0.0
    samples: int = 0
    tokens: int = 0
    oldest_version: int = 0
    loss: float = 0.0
    generate_s: float = 0.0
    wait_gpus_s: float = 0.0
    reload_s: float = 0.0
    train_s: float = 0.0
    cache_s: float = 0.0
    device_sync_s: float = 0.0
    audit_s: float = 0.0
    offload_s: float = 0.0
    release_s: float = 0.0
    sync_s: float = 0.0
    step_s: float = 0.0
    finished_at: float | None = None  # None: not finished (the timeline skips it)
    train_ranks: int = 1
    group_setup_s: float = 0.0
    group_teardown_s: float = 0.0
    group_destroyed: bool | None = None
    trainer_s: float = 0.0
    reward_min: float = 0.0
    reward_max: float = 0.0
    response_len_mean: float = 0.0
    response_len_max: int = 0
    response_truncated_frac: float = 0.0
    advantage_mean: float = 0.0
    advantage_std: float = 0.0
    advantage_min: float = 0.0
    advantage_max: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    entropy: float = 0.0
    kl: float | None = None
    clip_fraction: float = 0.0
    importance_ratio: float = 1.0
    grad_norm: float = 0.0
    tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    evaluation: dict[str, float] = {}  # the held-out scores of the step (metrics.jsonl's `eval/` keys)

    @model_validator(mode="before")
    @classmethod
    def _evaluation(cls, data: Any) -> Any:
        """A step's row (StepRecord.as_dict) carries its held-out scores as `eval/` keys beside
        the training metrics: kept together here."""
        if not isinstance(data, dict) or not any(isinstance(k, str) and k.startswith("eval/") for k in data):
            return data
        row = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("eval/"))}
        row["evaluation"] = {**row.get("evaluation", {}), **{k: v for k, v in data.items() if k not in row}}
        return row


_EVENT_FIELDS = ("at", "kind", "ranks", "version", "seconds")


class ShardEvent(_Part):
    """A coordinator's shard event, written as the list [at, kind, ranks, version, seconds]
    (the compact form: a run has thousands); older logs may stop after ranks."""

    at: float
    kind: str
    ranks: list[int]
    version: int | None = None
    seconds: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if not 3 <= len(value) <= len(_EVENT_FIELDS):
                raise ValueError(f"a shard event is [at, kind, ranks, version, seconds], got {len(value)} items")
            return dict(zip(_EVENT_FIELDS, value))
        return value

    @model_serializer
    def _as_list(self) -> list[Any]:
        return [self.at, self.kind, self.ranks, self.version, self.seconds]


class Accounting(_Part):
    """Every trajectory started is trained, dropped (by reason) or still buffered."""

    started: int
    trained: int
    dropped: dict[str, int]
    buffered: int


class LengthLimits(_Part):
    """The generation length limits drawn lately: how many, median, p90, p99 and largest."""

    n: int
    p50: float
    p90: float
    p99: float
    max: float


class CollectorStats(_Part):
    """The trajectory collector's counters; the episode ones only for agentic pipelines."""

    tokens: int
    groups: int
    requests: int
    retries: int
    generate_s: float
    in_flight_groups: int
    peak_admitted: int
    reports: int
    errors: list[str]
    failed_in_a_row: int
    episode_turns: int | None = None
    tool_calls: int | None = None
    episodes_running: int | None = None
    length_limits: LengthLimits | None = None


class TrainerRank(_Part):
    rank: int
    gpu: int | None
    pid: int
    node_id: str
    visible_devices: str | None


class TrainerPlacement(_Part):
    """Where the trainer's processes run (rank 0's, then every rank's)."""

    gpus: list[int]
    pid: int
    node_id: str
    visible_devices: str | None
    memory_share: float | None
    ranks: list[TrainerRank]


class ShardPlacement(_Part):
    """An engine process started on GPUs (rank None: a resident engine, set up once)."""

    rank: int | None
    gpus: list[int]
    at: float
    resident: bool = False
    pid: int | None
    node_id: str | None = None  # a launcher on another node reports it
    visible_devices: str | None
    memory_share: str | float | None  # read from the process's environment (a string) or its actor


class ShardDeath(_Part):
    rank: int
    pid: int | None
    exit_code: int | None
    at: float
    assigned: bool
    what: str
    hung: bool = False  # killed for not answering
    log_tail: str = ""
    then: str | None = None  # what followed when it was not replaced (e.g. it held no GPU)


class ShardReplacement(_Part):
    rank: int
    gpus: list[int]
    at: float
    seconds: float
    version: int


class Replication(_Part):
    """A weight version copied to another node's replica cache."""

    node: str
    version: int
    bytes: int
    seconds: float
    at: float


class MemoryRow(_Part):
    """One GPU hand-off with the memory measured at it. Open beyond these fields: the rest is
    the holder's own report (device memory; for an engine its sleep and graph counters)."""

    model_config = ConfigDict(extra="allow")

    event: str
    holder: str
    at: float
    gpus: list[int] = []


class EnvStats(_Part):
    """An agentic pipeline's environment servers."""

    name: str
    restarts: list[str]
    open_episodes: int
    gateway_requests: int


class Failure(_Part):
    """One failure of a pipeline: why, when, at which step, and what followed (a restart)."""

    reason: str
    at: float
    step: int | None
    then: str | None = None


class PipelineSummary(_Part):
    """One pipeline's result: PipelineRunner.summary() with the supervisor's fields (state,
    restarts, failures, gpu_seconds, error). A pipeline that failed before its summary has only
    pipeline, steps and rewards of the runner's; the simulator writes only records and events."""

    pipeline: str = ""
    mode: str = ""
    steps: int = 0
    start_step: int = 0
    rewards: list[float] = []
    # mean reward of the first and the last `reward_window` steps (5, or half of a shorter run's,
    # so the two never overlap); None: fewer than two steps, or no summary from the runner
    reward_first5: float | None = None
    reward_last5: float | None = None
    reward_window: int = 5  # summaries written without it averaged 5 steps (or all of fewer)
    records: list[StepRow] = []
    trained_versions: list[tuple[int, list[int]]] = []  # (step, weight versions in its batch)
    accounting: Accounting | None = None
    collector: CollectorStats | None = None
    shard_history: dict[int, list[int]] = {}  # rank -> versions it served
    published: list[int] = []
    version_mismatches: list[str] = []
    checksum_checks: int = 0
    checksum_mismatches: list[str] = []
    shard_deaths: list[ShardDeath] = []
    shard_replacements: list[ShardReplacement] = []
    sync_s: float = 0.0
    sleep_s: float = 0.0
    wake_s: float = 0.0
    setup_s: float = 0.0
    setup_phases_s: dict[str, float] = {}
    sleep_phases_ms: dict[str, float] = {}
    device_sync_calls_ms: list[float] = []
    device_sync_phases_ms: list[dict[str, dict[str, float]]] = []  # per sync: {rank: phases}
    events: list[ShardEvent] = []
    device: str = ""
    gpu_memory: list[MemoryRow] = []
    trainer_placement: TrainerPlacement | None = None
    shard_placements: list[ShardPlacement] = []
    shard_starts_after_setup: int = 0
    router_redispatched: int = 0  # requests (samples) its router sent again after their shard was preempted
    replications: list[Replication] = []
    env: EnvStats | None = None
    # the supervisor's
    gpu_seconds: float | None = None
    state: str | None = None  # new | setup | running | done | failed | stopped
    restarts: int = 0
    failures: list[Failure] = []
    error: str | None = None  # state failed: its last failure's reason

    @property
    def failed(self) -> bool:
        return self.state == "failed"


class RunSummary(_Part):
    """RUN_DIR/summary.json. Only `rlix run` writes every field; the simulator's run and a
    hand-made one may leave out what they do not have (the defaults)."""

    config: str = ""
    mode: str = ""
    wall_s: float = 0.0
    ending: str = "finished"  # finished | interrupted | failed: REASON
    pipelines: dict[str, PipelineSummary] = {}
    role_changes: list[RoleChange] = []
    lost_nodes: list[LostNode] = []
    ledger_audits: list[LedgerAudit] = []
    run: RunSpan | None = None
    gpu_account: GpuAccount | None = None

    def to_json(self, indent: int | None = 1) -> str:
        """summary.json's text: the fields that were set, nothing added."""
        return self.model_dump_json(indent=indent, exclude_unset=True)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON data (what `rlix.run.run` returns, what the file holds)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def coerce(cls, summary: RunSummary | Any) -> RunSummary:
        """`summary` as a RunSummary: as is, or validated from its JSON data (a dict)."""
        return summary if isinstance(summary, RunSummary) else cls.model_validate(summary)


def load_summary(run_dir: str | Path) -> RunSummary:
    """A run dir's summary.json; a ConfigError (one line) when it is not there, not JSON or not
    a run summary (each field that does not fit named)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: not found (rlix run writes it when a run ends; rlix sim --out, "
                          f"one per policy)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: not a readable summary ({' '.join(str(exc).split())})") from None
    try:
        return RunSummary.model_validate_json(text)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise ConfigError(f"{path}: not a readable summary (not JSON: "
                              f"{exc.errors()[0]['msg']})") from None
        if any(e["type"] == "model_type" and not e["loc"] for e in exc.errors()):
            raise ConfigError(f"{path}: not a run summary (not a JSON object)") from None
        raise ConfigError(format_validation_error(f"{path}: not a run summary", exc)) from None
