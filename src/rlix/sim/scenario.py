"""Simulator scenarios: pydantic models and YAML loading.

A scenario is the whole experiment: the cluster, the scheduler's knobs, the inference engine's
cost model, the move costs and the pipelines with their workloads. Unknown keys are errors (a
typo must not silently fall back to a default); every failure is one `ScenarioError` line
naming the file, the field and the reason.

Move costs: `costs:` is the scheduler's table (`rlix.scheduler.costs.MoveCosts`), inline or the
path of a measured table file (relative to the scenario's folder); the simulator charges it and
the planner plans on it. Without it the table's defaults apply. The older `transitions:`
(sync_s, sleep_s, wake_s) is deprecated but still read: it means the table with sleep_s,
wake_sync_s = wake_s + sync_s and sync_s, and every cost it does not name (recapture,
trainer reload and offload, cold start) 0, as that model charged none of them. Giving both
at one level is an error. A pipeline's own `transitions:` changes only what the simulator
charges that pipeline; the planner plans on the scenario's table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlix.config.loader import load_model
from rlix.errors import ConfigError, ScenarioError
from rlix.scheduler.costs import MoveCosts, load_move_costs, problems
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Topology


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterModel(_Strict):
    """Uniform nodes (`nodes: 2`, `gpus_per_node: 8`) or uneven ones (`nodes: [4, 2]`: GPUs
    per node, and no `gpus_per_node`)."""

    nodes: int | list[Annotated[int, Field(ge=1)]]
    gpus_per_node: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _shape(self) -> "ClusterModel":
        if isinstance(self.nodes, list):
            if not self.nodes:
                raise ValueError("nodes: a list of GPU counts needs at least one node")
            if self.gpus_per_node is not None:
                raise ValueError("gpus_per_node: not allowed when nodes lists each node's GPUs")
        else:
            if self.nodes < 1:
                raise ValueError(f"nodes: must be >= 1, got {self.nodes}")
            if self.gpus_per_node is None:
                raise ValueError("gpus_per_node: required when nodes is a count")
        return self

    def topology(self) -> Topology:
        if isinstance(self.nodes, list):
            return Topology(tuple(self.nodes))
        return Topology.uniform(self.nodes, self.gpus_per_node)


class SchedulerModel(_Strict):
    """The planner's knobs (rlix.scheduler.planning.planner.PlannerParams); same defaults."""

    dwell_s: float = Field(30.0, ge=0)
    aging_s: float = Field(60.0, ge=0)
    rotate_s: float = Field(PlannerParams.rotate_s, ge=0)
    report_stale_s: float | None = Field(None, gt=0)

    def params(self, move_costs: MoveCosts | None = None) -> PlannerParams:
        return PlannerParams(dwell_s=self.dwell_s, aging_s=self.aging_s, rotate_s=self.rotate_s,
                             report_stale_s=self.report_stale_s,
                             move_costs=move_costs if move_costs is not None else MoveCosts())


class EngineModel(_Strict):
    """Cost model of one inference shard (continuous batching).

    One decode step takes `decode_base_ms + decode_per_seq_ms * n` for n running sequences and
    yields one token per sequence; prefill runs at `prefill_tokens_per_s` per shard.
    """

    max_seqs: int = Field(128, ge=1)
    decode_base_ms: float = Field(20.0, gt=0)
    decode_per_seq_ms: float = Field(0.3, ge=0)
    prefill_tokens_per_s: float = Field(20000.0, gt=0)


class TransitionModel(_Strict):
    """Deprecated (use `costs:`): role-switch costs. A shrunk shard's GPUs stay busy `sleep_s`;
    a woken shard is usable after `wake_s + sync_s`; a shard that stays active pauses `sync_s`
    after each train step. Read as the cost table `costs()` returns."""

    sync_s: float = Field(5.0, ge=0)
    sleep_s: float = Field(2.0, ge=0)
    wake_s: float = Field(5.0, ge=0)

    def costs(self, margin: float = MoveCosts().margin) -> MoveCosts:
        """The same model as a cost table: what it does not name was not charged (0)."""
        return MoveCosts(sleep_s=self.sleep_s, wake_sync_s=self.wake_s + self.sync_s,
                         sync_s=self.sync_s, recapture_s=0.0, trainer_reload_s=0.0,
                         trainer_offload_s=0.0, cold_start_s=0.0, margin=margin)


class LogNormal(_Strict):
    """A lognormal draw given by its median and sigma (of the underlying normal), capped."""

    median: float = Field(gt=0)
    sigma: float = Field(0.0, ge=0)
    max: float | None = Field(None, gt=0)


class RolloutModel(_Strict):
    """One step's batch and the shape of its trajectories.

    Turns per trajectory: 1 + G, G geometric on {0, 1, ...} with mean `extra_turns_mean`,
    capped at `max_turns`. Input tokens: `prompt_tokens` before the first turn and
    `obs_tokens` of tool output appended before every later turn.
    """

    prompts: int = Field(ge=1)
    samples: int = Field(ge=1)
    extra_turns_mean: float = Field(0.0, ge=0)
    max_turns: int = Field(1, ge=1)
    gen_tokens: LogNormal
    tool_s: LogNormal = LogNormal(median=1.0, sigma=0.0)
    prompt_tokens: int = Field(1000, ge=0)
    obs_tokens: int = Field(500, ge=0)
    # the collector's cap on trajectories in flight per active shard (admitted and not finished:
    # queued at the router, generating or in a tool call; one shard's worth while none is
    # active); the real one has `concurrency` groups x group_size per awake shard.
    # None: every released trajectory is dispatched at once.
    in_flight: int | None = Field(None, ge=1)

    @property
    def batch(self) -> int:
        return self.prompts * self.samples


class StageModel(_Strict):
    """A non-rollout stage run before every train step (reference or old-policy log-probs): the
    scheduler's `logprob` stage, `gpus` GPUs for `gpu_seconds / gpus` seconds."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    gpus: int = Field(ge=1)
    gpu_seconds: float = Field(gt=0)


class PipelineModel(_Strict):
    """One async-GRPO pipeline; `copies` > 1 makes identical pipelines `<name>-0`, `<name>-1`...

    `arrive_s`: when it is submitted (it leaves when its steps are done). `min_train_gpus`: the
    fewest GPUs its train step fits on; a policy that would give it fewer does not apply.
    `stages`: non-rollout stages before each train step, in order.
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    copies: int = Field(1, ge=1)
    priority: int = 0
    weight: float = Field(1.0, gt=0)
    steps: int = Field(ge=1)
    max_staleness: int = Field(1, ge=0)
    train_gpus: int = Field(ge=1)
    train_gpu_seconds: float = Field(gt=0)
    min_train_gpus: int | None = Field(None, ge=1)
    arrive_s: float = Field(0.0, ge=0)
    stages: list[StageModel] = []
    tp: int = Field(1, ge=1)
    min_shards: int = Field(1, ge=0)
    max_shards: int = Field(ge=1)
    partial_overlap: bool = True
    #: its trainer is bound to a home chosen at registration, as `rlix run`'s trainer processes
    #: are (every train step on the same GPUs, preempting any other pipeline's shard there);
    #: False: the planner may place each step anywhere (a simulated trainer only)
    fixed_trainer: bool = False
    seqs_per_shard: int = Field(8, ge=1)
    engine: EngineModel | None = None
    transitions: TransitionModel | None = None  # deprecated: what the simulator charges it only
    rollout: RolloutModel

    @model_validator(mode="after")
    def _shards(self) -> "PipelineModel":
        if self.min_shards > self.max_shards:
            raise ValueError(f"min_shards ({self.min_shards}) must not exceed max_shards ({self.max_shards})")
        if self.min_train_gpus is not None and self.min_train_gpus > self.train_gpus:
            raise ValueError(f"min_train_gpus ({self.min_train_gpus}) must not exceed train_gpus "
                             f"({self.train_gpus})")
        return self


class CrashFault(_Strict):
    """The pipeline's processes die `at_s` after it starts and come back `restart_after_s`
    later, resuming from its last finished train step (batches in flight are lost)."""

    kind: Literal["crash"]
    pipeline: str
    at_s: float = Field(ge=0)
    restart_after_s: float = Field(ge=0)


class ReportFault(_Strict):
    """From `from_s` to `to_s` after it starts, the pipeline's progress reports say it needs
    nothing (`mute_reports`) or stop reaching the scheduler, which keeps the last one it got,
    with that report's time (`stale_reports`)."""

    kind: Literal["mute_reports", "stale_reports"]
    pipeline: str
    from_s: float = Field(ge=0)
    to_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _window(self) -> "ReportFault":
        if self.to_s <= self.from_s:
            raise ValueError(f"to_s ({self.to_s}) must be after from_s ({self.from_s})")
        return self


Fault = Annotated[Union[CrashFault, ReportFault], Field(discriminator="kind")]


class RunModel(_Strict):
    """What a real `rlix run` pays around its pipelines' steps.

    `teardown_s`: from the last step's end to the process's exit (final checkpoint, summary,
    shutdown): added once to the makespan of rlix and exclusive-partition (one run each), and
    after every job of exclusive-queue (each its own run: its GPUs are freed, and the next job
    admitted, `teardown_s` after it finished). `setup_s`: with resident engines, a pipeline's
    set-up (launch to its first shard able to serve) under rlix, exclusive-queue and alone
    (time-shared runs); `standalone_setup_s`: the same under exclusive-partition (standalone
    mode). Each replaces `cold_start_s` as the set-up only where it is given."""

    teardown_s: float = Field(0.0, ge=0)
    setup_s: float | None = Field(None, ge=0)
    standalone_setup_s: float | None = Field(None, ge=0)

    def setup_for(self, policy: str) -> float | None:
        """The set-up a pipeline of `policy` is charged, or None: the table's cold_start_s."""
        return self.standalone_setup_s if policy == "exclusive-partition" else self.setup_s


class ScenarioModel(_Strict):
    """`costs`: the move-cost table, inline or a table file's path (see the module docstring);
    `transitions`: its deprecated form. `resident_engines`: every pipeline starts its shard
    processes at set-up, in parallel (`cold_start_s` once, before its first shard serves), and
    a shard then only wakes wherever it goes; false: a dp rank's process starts
    (`cold_start_s`) the first time the rank runs on a GPU, and again where it moves. `run`:
    teardown and per-mode set-up (`RunModel`)."""

    name: str = Field(min_length=1)
    seed: int = 0
    cluster: ClusterModel
    scheduler: SchedulerModel = SchedulerModel()
    engine: EngineModel = EngineModel()
    costs: MoveCosts | str | None = None
    transitions: TransitionModel | None = None
    resident_engines: bool = True
    run: RunModel = RunModel()
    pipelines: list[PipelineModel] = Field(min_length=1)
    faults: list[Fault] = []

    @field_validator("costs", mode="before")
    @classmethod
    def _table(cls, value: object) -> object:
        """Inline: checked as the scheduler checks it (each problem named by its field)."""
        if isinstance(value, dict):
            try:
                return MoveCosts.model_validate(value)
            except ValidationError as exc:
                raise ValueError(problems(exc)) from None
        if value is not None and not isinstance(value, (str, MoveCosts)):
            raise ValueError(f"expected a mapping of costs or the path of a cost table, "
                             f"got {type(value).__name__}")
        return value



@dataclass(frozen=True)
class StageSetup:
    name: str
    gpus: int
    gpu_seconds: float


@dataclass(frozen=True)
class PipelineSetup:
    """One resolved pipeline: its scheduler spec plus what the simulator needs to run it."""

    index: int  # position among the expanded pipelines; seeds its workload stream
    spec: PipelineSpec
    steps: int
    max_staleness: int
    train_gpu_seconds: float
    engine: EngineModel
    costs: MoveCosts  # what the simulator charges it
    rollout: RolloutModel
    resident_engines: bool = True
    arrive_s: float = 0.0
    min_train_gpus: int = 1
    stages: tuple[StageSetup, ...] = ()
    faults: tuple[CrashFault | ReportFault, ...] = ()  # times from the pipeline's start

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def train_seconds(self) -> float:
        return self.train_gpu_seconds / self.spec.train_gpus


@dataclass(frozen=True)
class Scenario:
    name: str
    source: str
    seed: int
    topology: Topology
    params: PlannerParams
    pipelines: tuple[PipelineSetup, ...]
    costs: MoveCosts = MoveCosts()  # the scenario's table (the planner's has no cold start
    resident_engines: bool = True   # when engines are resident)
    run: RunModel = RunModel()      # teardown and per-mode set-up

    @property
    def gpus(self) -> int:
        return self.topology.num_gpus


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file; raises ScenarioError naming the file and field."""
    try:
        model = load_model(ScenarioModel, path, error=ScenarioError)
    except ScenarioError:
        raise
    except ConfigError as exc:  # missing file, YAML syntax: same message, scenario's error type
        raise ScenarioError(str(exc)) from None
    return build_scenario(model, str(path))


def scenario_costs(model: ScenarioModel, source: str = "<scenario>") -> MoveCosts:
    """The scenario's cost table: `costs` (a path is read relative to the scenario's folder),
    else the deprecated `transitions`, else the table's defaults."""
    costs = model.costs
    if costs is not None and model.transitions is not None:
        raise ScenarioError(f"{source}: transitions: deprecated and not allowed beside costs (give "
                            f"the table only: sleep_s, wake_sync_s = wake_s + sync_s, sync_s)")
    if isinstance(costs, str):
        path = Path(costs).expanduser()
        if not path.is_absolute() and source and not source.startswith("<"):
            path = Path(source).parent / path
        try:
            return load_move_costs(path)
        except ConfigError as exc:
            raise ScenarioError(f"{source}: costs: {exc}") from None
    if costs is not None:
        return costs
    if model.transitions is not None:
        return model.transitions.costs()
    return MoveCosts()


def build_scenario(model: ScenarioModel, source: str = "<scenario>") -> Scenario:
    """Expand copies, resolve per-pipeline overrides and check what needs the whole file."""
    topology = model.cluster.topology()
    table = scenario_costs(model, source)
    if not model.resident_engines:
        for key in ("setup_s", "standalone_setup_s"):
            if getattr(model.run, key) is not None:
                raise ScenarioError(f"{source}: run.{key}: a set-up replaces cold_start_s only with "
                                    f"resident_engines: true (without, each shard process start "
                                    f"is charged cold_start_s)")
    total, biggest = topology.num_gpus, max(topology.gpus_per_node)
    setups: list[PipelineSetup] = []
    seen: dict[str, str] = {}
    for i, p in enumerate(model.pipelines):
        where = f"{source}: pipelines[{i}]"
        if p.tp > biggest:
            raise ScenarioError(f"{where}.tp: {p.tp} does not fit on one node (the largest has {biggest} GPUs)")
        if p.train_gpus > total:
            raise ScenarioError(f"{where}.train_gpus: {p.train_gpus} exceeds the cluster's {total} GPUs")
        if not p.partial_overlap and p.train_gpus + p.tp > total:
            raise ScenarioError(f"{where}.train_gpus: without partial_overlap, {p.train_gpus} training "
                                f"GPUs leave no room for a shard of tp={p.tp}")
        for j, st in enumerate(p.stages):
            room = total if p.partial_overlap else p.train_gpus  # a no-overlap stage runs in its home
            if st.gpus > room:
                raise ScenarioError(f"{where}.stages[{j}].gpus: {st.gpus} exceeds the {room} GPUs "
                                    + ("of the cluster" if p.partial_overlap else
                                       "of its training home (no partial_overlap)"))
        names = [p.name] if p.copies == 1 else [f"{p.name}-{c}" for c in range(p.copies)]
        for name in names:
            if name in seen:
                raise ScenarioError(f"{where}.name: pipeline name {name!r} is used twice")
            seen[name] = where
            spec = PipelineSpec(name=name, priority=p.priority, weight=p.weight, train_gpus=p.train_gpus,
                                tp=p.tp, min_shards=p.min_shards, max_shards=p.max_shards,
                                partial_overlap=p.partial_overlap, seqs_per_shard=p.seqs_per_shard,
                                fixed_trainer=p.fixed_trainer)
            setups.append(PipelineSetup(
                index=len(setups), spec=spec, steps=p.steps, max_staleness=p.max_staleness,
                train_gpu_seconds=p.train_gpu_seconds, engine=p.engine or model.engine,
                costs=p.transitions.costs(table.margin) if p.transitions is not None else table,
                rollout=p.rollout, resident_engines=model.resident_engines,
                arrive_s=p.arrive_s, min_train_gpus=p.min_train_gpus or 1,
                stages=tuple(StageSetup(st.name, st.gpus, st.gpu_seconds) for st in p.stages)))
    faults: dict[str, list] = {}
    for j, f in enumerate(model.faults):
        if f.pipeline not in seen:
            raise ScenarioError(f"{source}: faults[{j}].pipeline: no pipeline {f.pipeline!r} "
                                f"(pipelines: {', '.join(seen)})")
        faults.setdefault(f.pipeline, []).append(f)
    setups = [dataclasses.replace(s, faults=tuple(faults.get(s.name, ()))) for s in setups]
    # resident engines: after set-up no process starts, so none is planned on
    planned = table.model_copy(update={"cold_start_s": 0.0}) if model.resident_engines else table
    return Scenario(name=model.name, source=source, seed=model.seed, topology=topology,
                    params=model.scheduler.params(planned), pipelines=tuple(setups),
                    costs=table, resident_engines=model.resident_engines, run=model.run)
