"""Typed configuration: the cluster, the scheduler's knobs and each pipeline.

Pure pydantic (no torch, no Ray) so a bad file is refused before anything heavy starts.
Unknown keys are errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlix.envs.agent_config import EnvConfig
from rlix.errors import ConfigError
from rlix.envs.config import TaskConfig
from rlix.scheduler.costs import MoveCosts, load_move_costs
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Topology


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClusterConfig(_Strict):
    """The GPUs rlix schedules. "auto" reads them from the Ray cluster's resources."""

    nodes: int | Literal["auto"] = Field("auto", description="number of nodes, or auto")
    gpus_per_node: int | Literal["auto"] = Field("auto", description="GPUs on each node, or auto")
    gpu_slices: int = Field(1, ge=1, le=8, description="the scheduler sees each GPU as this many GPUs "
                                                       "(slices), each with 1/N of its memory: shards and "
                                                       "trainers of several pipelines then share one GPU "
                                                       "at once; every GPU count and id in the config "
                                                       "counts slices")
    resident_engines: bool = Field(True, description="on CUDA, start each pipeline's engine on every GPU "
                                                     "it may run a shard on during set-up, and keep them "
                                                     "asleep there: a shard moved to a GPU wakes the "
                                                     "engine waiting there instead of starting a process "
                                                     "(each sleeping engine keeps its CUDA context and "
                                                     "graphs on its GPU, about 1 GiB)")

    @model_validator(mode="after")
    def _positive(self) -> "ClusterConfig":
        for field in ("nodes", "gpus_per_node"):
            value = getattr(self, field)
            if value != "auto" and value < 1:
                raise ValueError(f"{field} must be >= 1 or 'auto', got {value}")
        return self

    @property
    def is_auto(self) -> bool:
        return self.nodes == "auto" or self.gpus_per_node == "auto"

    @property
    def physical_gpus(self) -> int:
        """GPUs in the cluster (not auto), as Ray counts them."""
        return int(self.nodes) * int(self.gpus_per_node)

    @property
    def scheduled_gpus(self) -> int:
        """GPUs the scheduler hands out (not auto): slices of the physical ones."""
        return self.physical_gpus * self.gpu_slices

    def physical_topology(self) -> Topology:
        if self.is_auto:
            raise ValueError("cluster is 'auto': resolve it from Ray (rlix.scheduler.service.topology_from_ray)")
        return Topology.uniform(int(self.nodes), int(self.gpus_per_node))

    def topology(self) -> Topology:
        """What the scheduler plans over: every GPU as `gpu_slices` GPUs."""
        return self.physical_topology().sliced(self.gpu_slices)


class SchedulerConfig(_Strict):
    """Planner knobs; see rlix.scheduler.planning.planner.PlannerParams."""

    dwell_s: float = Field(30.0, ge=0, description="a woken shard is not shrunk again for this long")
    aging_s: float = Field(60.0, ge=0, description="a request waiting this long goes first")
    rotate_s: float = Field(120.0, ge=0, description="with more pipelines wanting a shard than GPUs, a "
                                                     "pipeline keeps its only shard this long before the "
                                                     "one waiting longest takes it")
    report_stale_s: float | None = Field(None, gt=0, description="a progress report older than this counts "
                                                                 "as none (full demand); null: never stale")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve the scheduler's Prometheus "
                                                                       "metrics on 127.0.0.1 at this port "
                                                                       "(0: a free one, named in the run "
                                                                       "log); null: not served")
    dashboard_port: int | None = Field(None, ge=0, le=65535, description="serve the live dashboard (GPU "
                                                                         "timeline, pipelines table) on "
                                                                         "127.0.0.1 at this port (0: a "
                                                                         "free one, printed by rlix run); "
                                                                         "null: not served")
    move_costs: MoveCosts = Field(default_factory=MoveCosts, description="seconds each move of a GPU "
                                  "costs (sleep_s, wake_sync_s, sync_s, recapture_s, trainer_reload_s, "
                                  "trainer_offload_s, cold_start_s) and the margin by which the work "
                                  "a move buys must exceed it (rlix.scheduler.costs.MoveCosts), inline, "
                                  "or the path of a measured table (YAML/JSON with `costs:`)")

    @field_validator("move_costs", mode="before")
    @classmethod
    def _cost_table(cls, value: object) -> object:
        """A path names a measured table: read here, so a bad one is refused with the config."""
        if isinstance(value, str):
            try:
                return load_move_costs(value)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("dashboard_port")
    @classmethod
    def _own_port(cls, port: int | None, info: ValidationInfo) -> int | None:
        """Two servers cannot share one port (0 picks a free one for each)."""
        if port and port == info.data.get("metrics_port"):
            raise ValueError("the same port as scheduler.metrics_port; give each its own (or 0)")
        return port

    def params(self, resident_engines: bool = False) -> PlannerParams:
        """The planner's knobs as this config sets them. `resident_engines`: every shard process
        is started at set-up (cluster.resident_engines on real GPUs), so no move starts one and
        the planner plans with no cold start."""
        costs = self.move_costs
        if resident_engines:
            costs = costs.model_copy(update={"cold_start_s": 0.0})
        return PlannerParams(dwell_s=self.dwell_s, aging_s=self.aging_s, rotate_s=self.rotate_s,
                             report_stale_s=self.report_stale_s, move_costs=costs)


class LengthTail(_Strict):
    """Each sample's generation limit drawn from a heavy-tailed distribution, as RL response
    lengths vary (most short, a few very long): `lognormal` is median x exp(sigma x N(0, 1));
    `pareto` has shape `alpha` (smaller: heavier) and scale median / 2^(1/alpha), so that its
    median is `median`. A draw is rounded, then kept within [min, rollout.max_new_tokens]."""

    dist: Literal["lognormal", "pareto"] = Field(description="lognormal (needs sigma) or pareto (needs alpha)")
    median: float = Field(gt=0, description="the draws' median, in tokens")
    sigma: float | None = Field(None, gt=0, description="lognormal: sigma of the underlying normal "
                                                        "(1.0: p99 is ~10x the median)")
    alpha: float | None = Field(None, gt=0, description="pareto: the tail index (1.0: p99 is ~50x the median)")
    min: int = Field(1, ge=1, description="the shortest limit drawn, in tokens")

    @model_validator(mode="after")
    def _its_shape(self) -> "LengthTail":
        need, other = ("sigma", "alpha") if self.dist == "lognormal" else ("alpha", "sigma")
        if getattr(self, need) is None:
            raise ValueError(f"dist {self.dist} needs {need}")
        if getattr(self, other) is not None:
            raise ValueError(f"{other} is not a parameter of dist {self.dist} (it takes {need})")
        if self.min > self.median:
            raise ValueError(f"min ({self.min}) must not exceed median ({self.median:g})")
        return self


class RolloutConfig(_Strict):
    """How a pipeline generates: GRPO groups of samples per prompt."""

    groups_per_step: int = Field(8, ge=1, description="prompts (groups) trained on per step")
    group_size: int = Field(8, ge=2, description="samples per prompt; advantages are normalised within a group")
    max_new_tokens: int = Field(16, ge=1, description="tokens generated per sample at most")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (must be > 0 for GRPO to explore)")
    concurrency: int = Field(8, ge=1, description="groups in flight at once")
    max_model_len: int = Field(256, ge=16, description="the shards' context length (prompt + response)")
    max_num_seqs: int = Field(64, ge=1, description="sequences one shard decodes at once")
    length_tail: LengthTail | None = Field(None, description="draw each sample's token limit (its request's "
                                                             "max_tokens) from a heavy-tailed distribution, "
                                                             "capped at max_new_tokens, reproducibly from the "
                                                             "pipeline's seed; null: every sample may run to "
                                                             "max_new_tokens. Agent episodes (`env:`) ignore it")
    ignore_eos: bool = Field(False, description="samples run to their token limit whatever the model samples "
                                                "(benchmarks of random-weight models, whose end-of-text "
                                                "tokens would cut every length short at random; not for "
                                                "real training). Agent episodes (`env:`) ignore it")

    @model_validator(mode="after")
    def _tail_within_limit(self) -> "RolloutConfig":
        tail = self.length_tail
        if tail is not None and tail.min > self.max_new_tokens:
            raise ValueError(f"length_tail.min ({tail.min}) must not exceed max_new_tokens ({self.max_new_tokens})")
        if tail is not None and tail.median > self.max_new_tokens:
            raise ValueError(f"length_tail.median ({tail.median:g}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        return self


class VllmOptions(_Strict):
    """vLLM's own settings for a pipeline whose shards are vLLM servers (`engine: vllm`)."""

    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs (default: rollout.max_num_seqs)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM --gpu-memory-utilization "
                                                                              "(default: vLLM's)")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager: no CUDA graphs (faster start)")
    cpu_kvcache_gib: int = Field(1, ge=1, description="on CPU: KV cache of each server in GiB "
                                                      "(VLLM_CPU_KVCACHE_SPACE)")
    startup_timeout_s: float = Field(600.0, gt=0, description="a server not healthy within this fails "
                                                             "(cold start is ~85 s on a 2-core CPU)")
    extra_args: list[str] = Field(default_factory=list, description="more arguments for vLLM's server, as is")


class TrainConfig(_Strict):
    """The trainer's optimiser and loss settings (see rlix.training)."""

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(16, ge=1, description="samples per forward/backward (gradients accumulate)")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the initial model (0 = no reference model)")
    aggregation: Literal["token", "sequence"] = Field("token", description="loss mean over tokens or sequences")
    max_grad_norm: float = Field(1.0, gt=0)
    bucket_mib: int | None = Field(None, ge=1, description="weight-sync bucket size in MiB (null: 256 on "
                                                         "CUDA, where each bucket's fixed cost, a "
                                                         "message and a copy launch, outweighs its "
                                                         "bytes at 64; 64 on CPU)")


class PipelineConfig(_Strict):
    """One RL pipeline: what the scheduler sees, and what it trains."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    priority: int = Field(0, description="strict tiers: a higher priority is always served first")
    weight: float = Field(1.0, gt=0, description="share of rollout GPUs within its tier")
    model: str = Field("tiny", min_length=1, description="model preset name or local checkpoint path")
    train_gpus: int = Field(1, ge=1, description="GPUs the trainer needs for one step")
    tp: int = Field(1, ge=1, description="GPUs per inference shard (tensor parallel size)")
    min_shards: int = Field(1, ge=0, description="shards kept whenever it has rollout demand")
    max_shards: int = Field(1, ge=1, description="most inference shards it can use")
    partial_overlap: bool = Field(True, description="its shards may sleep on its training GPUs")
    max_staleness: int = Field(1, ge=0, description="oldest weight version a trained trajectory may use, in steps")
    seqs_per_shard: int = Field(8, ge=1, description="trajectories one shard should carry; converts demand to shards")
    steps: int = Field(20, ge=1, description="training steps to run")
    seed: int = Field(0, description="seeds prompts, sampling and the trainer")
    task: TaskConfig = Field(default_factory=TaskConfig, description="what the policy is rewarded for")
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    gpus: list[int] | None = Field(None, description="standalone mode: the fixed GPUs this pipeline uses "
                                                     "(default: all); ignored when time-sharing")
    checkpoint_every: int = Field(10, ge=0, description="save a checkpoint every N steps (0: only at "
                                                        "the end); one is also saved on Ctrl-C and "
                                                        "when the pipeline fails, if its trainer lives")
    max_failed_groups: int = Field(32, ge=0, description="stop the pipeline when this many groups in a row "
                                                        "fail (a verifier that raises, no shard "
                                                        "answering); 0: never")
    restart: Literal["never", "on_failure"] = Field(
        "never", description="on_failure: a failed pipeline (error, dead process, hang) is started "
                             "again from its last checkpoint, up to max_restarts times")
    max_restarts: int = Field(2, ge=0, description="restarts of this pipeline at most (restart: on_failure)")
    audit_weights: bool = Field(False, description="after every sync, compare each shard's weight "
                                                   "checksums with the trainer's (a pass over the "
                                                   "weights on both sides: for tests and benchmarks)")
    cpu_threads: int | None = Field(1, ge=1, description="torch threads of its trainer and of each shard "
                                                         "process on CPU (None: torch's default)")
    engine: Literal["embedded", "vllm"] = Field("embedded", description="what its shards run: rlix's "
                                                                      "embedded engine, or real vLLM servers")
    vllm: VllmOptions = Field(default_factory=VllmOptions, description="vLLM's settings (engine: vllm)")
    record_rollouts: bool = Field(False, description="write what the shards sampled (their own record, "
                                                     "generations/) and every training batch (batches.jsonl) "
                                                     "under run_dir/<name>/: audits that training used exactly "
                                                     "the sampled tokens (embedded engine)")
    env: EnvConfig | None = Field(None, description="an HTTP agent environment: each trajectory is a "
                                                    "multi-turn episode its agent server runs (null: one "
                                                    "generate per trajectory, rewarded by `task`)")

    @model_validator(mode="after")
    def _shard_bounds(self) -> "PipelineConfig":
        if self.min_shards > self.max_shards:
            raise ValueError(f"min_shards ({self.min_shards}) must not exceed max_shards ({self.max_shards})")
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus must not repeat a GPU, got {self.gpus}")
            if len(self.gpus) < max(self.train_gpus, self.tp):
                raise ValueError(f"gpus {self.gpus} are fewer than train_gpus={self.train_gpus} / tp={self.tp}")
        return self

    def spec(self, frees_memory: bool = True) -> PipelineSpec:
        """For the scheduler. `frees_memory`: its shards give GPU memory back when preempted
        (false for vLLM where sleep mode is refused: its shards only pause)."""
        return PipelineSpec(
            name=self.name, priority=self.priority, weight=self.weight, train_gpus=self.train_gpus,
            tp=self.tp, min_shards=self.min_shards, max_shards=self.max_shards,
            partial_overlap=self.partial_overlap, seqs_per_shard=self.seqs_per_shard,
            fixed_trainer=True,  # its trainer is a process bound to GPUs (rlix.placement)
            frees_memory=frees_memory,
        )


class WandbConfig(_Strict):
    """Per-step metrics to Weights & Biases (needs `pip install wandb`, or the `wandb` extra)."""

    project: str = Field("rlix", min_length=1, description="wandb project")
    entity: str | None = Field(None, description="wandb entity (user or team); null: wandb's default")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline: written under run_dir/<pipeline>/wandb/ without a network (upload "
                               "later with `wandb sync`); online: sent as it runs; disabled: nothing")
    group: str | None = Field(None, description="groups the run's pipelines (default: run_dir's folder name)")
    tags: list[str] = Field(default_factory=list, description="tags of every pipeline's wandb run")


class LoggingConfig(_Strict):
    """Experiment logging: every pipeline's per-step metrics (the rows of metrics.jsonl) to trackers."""

    tensorboard: bool = Field(False, description="TensorBoard event files in run_dir/<pipeline>/tensorboard/")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases, one wandb run per pipeline "
                                                        "(null: off)")


Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "bfloat16", "float16", "float32"]


class RlixConfig(_Strict):
    """A whole `rlix run` file."""

    cluster: ClusterConfig = ClusterConfig()
    device: Device = Field("auto", description="where trainers and shards compute: cuda when the Ray "
                                               "cluster has real GPUs (auto), else cpu with the "
                                               "cluster's GPUs as fake ones")
    dtype: DType = Field("auto", description="weights and compute dtype (auto: bfloat16 on cuda, the "
                                             "checkpoint's on cpu)")
    release_timeout_s: float = Field(60.0, gt=0, description="how long a GPU's holder may take to "
                                                             "confirm its memory is free before the "
                                                             "pipeline is failed and the GPU taken back")
    heartbeat_timeout_s: float = Field(60.0, gt=0, description="a pipeline whose actor does not answer "
                                                               "a progress call for this long is "
                                                               "failed as hung (and its processes ended)")
    setup_timeout_s: float = Field(900.0, gt=0, description="a pipeline not set up (trainer and model "
                                                            "loaded, answering) within this is failed")
    scheduler: SchedulerConfig = SchedulerConfig()
    control_plane: Literal["rlix", "standalone"] = Field(
        "rlix", description="rlix: pipelines time-share GPUs through the scheduler; standalone: each "
                            "runs on fixed GPUs (env RLIX_CONTROL_PLANE overrides)")
    run_dir: str = Field("runs/latest", description="where logs, metrics and checkpoints go")
    vllm_python: str | None = Field(None, description="Python of an environment with vLLM, for pipelines "
                                                      "with engine: vllm (default: RLIX_VLLM_PYTHON, else "
                                                      "the one scripts/setup-vllm.sh linked into the venv)")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="per-step metrics to "
                                                                              "TensorBoard and wandb")
    pipelines: list[PipelineConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _fits(self) -> "RlixConfig":
        names = [p.name for p in self.pipelines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pipeline names must be unique; repeated: {', '.join(dupes)}")
        if self.cluster.gpu_slices > 1:
            wide = [p.name for p in self.pipelines if p.tp > 1]
            if wide:
                raise ValueError(f"pipelines {wide}: tp > 1 with gpu_slices > 1 could put one shard on "
                                 f"two slices of the same GPU; use tp: 1 or gpu_slices: 1")
        if not self.cluster.is_auto:
            total = self.cluster.scheduled_gpus
            for p in self.pipelines:
                if p.train_gpus > total:
                    raise ValueError(f"pipeline {p.name!r}: train_gpus={p.train_gpus} exceeds the cluster's {total} GPUs")
                if p.tp > int(self.cluster.gpus_per_node):
                    raise ValueError(f"pipeline {p.name!r}: tp={p.tp} exceeds gpus_per_node={self.cluster.gpus_per_node}")
                bad = [g for g in p.gpus or [] if not 0 <= g < total]
                if bad:
                    raise ValueError(f"pipeline {p.name!r}: gpus {bad} are not in the cluster's 0..{total - 1}")
        return self
