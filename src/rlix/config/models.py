"""Typed configuration: the cluster, the scheduler's knobs and each pipeline.

Pure pydantic (no torch, no Ray) so a bad file is refused before anything heavy starts.
Unknown keys are errors: a typo must not silently fall back to a default. Every value that would
fail or misbehave after start is refused here, each rule in one place: every float of every
model is finite (`_Strict`), no number is a boolean (`Int`, `Float`), every int and float has a
range (its Field), names are safe path components (`Name`), paths are not empty (`PathStr`).
docs/CONFIG.md lists the bounds.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlix.envs.agent_config import EnvConfig
from rlix.errors import ConfigError
from rlix.envs.config import TaskConfig
from rlix.scheduler.costs import MoveCosts, load_move_costs
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Topology


#: counts without a smaller natural bound (steps, intervals, failures in a row): int32
MAX_COUNT = 2**31 - 1
#: a seed: what torch.manual_seed takes (random.Random takes any int)
MAX_SEED = 2**63 - 1
#: every duration, in seconds (~116 days; threading and asyncio refuse timeouts past ~292 years)
MAX_SECONDS = 1e7
#: GPUs (or slices) a count of GPUs or shards may name; nodes of a cluster
MAX_GPUS, MAX_NODES = 4096, 1024
#: GPUs on one node; GPUs of one tensor-parallel shard
MAX_GPUS_PER_NODE = 64
#: tokens of a context or a response
MAX_TOKENS = 1 << 20
#: sequences or samples in one batch, group or step
MAX_SEQS = 1 << 16
#: a pipeline's name is a folder under run_dir and part of Ray actor names
MAX_NAME = 64
#: sampling temperature: logits / temperature overflows (then NaN) below MIN, flattens past MAX
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
#: a path in the config
MAX_PATH = 4096
#: step-numbered checkpoints one pipeline keeps (keep_last, keep_best): each holds the model and
#: its optimizer state, so a few are already many gigabytes
MAX_CHECKPOINTS = 1000


def _number(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean (YAML reads true/false/yes/no/on/off as one)")
    return value


def _at_least(minimum: float, why: str) -> AfterValidator:
    """A lower bound tighter than the field's own (`gt=0` keeps its message for 0 and below)."""
    def check(value: float) -> float:
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g} ({why})")
        return value
    return AfterValidator(check)


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    return value


def _path(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return _no_nul(value)


def _name(value: str) -> str:
    if value in (".", ".."):
        raise ValueError("must not be '.' or '..': a pipeline's metrics, checkpoint and logs go in the "
                         "folder of its name under run_dir")
    return value


#: an int that is not a boolean (bounds: each field's own)
Int = Annotated[int, BeforeValidator(_number)]
#: a float that is not a boolean (finite: every model's allow_inf_nan=False; bounds: each field's own)
Float = Annotated[float, BeforeValidator(_number)]
#: a duration in seconds, at most MAX_SECONDS (the lower bound: each field's own)
Seconds = Annotated[float, BeforeValidator(_number), Field(le=MAX_SECONDS)]
#: a path: not empty, no NUL
PathStr = Annotated[str, Field(max_length=MAX_PATH), AfterValidator(_path)]
#: a name that is safe as one path component: letters, digits, '.', '_', '-'; not '.' or '..'
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9_.-]+$"), AfterValidator(_name)]


class _Strict(BaseModel):
    # allow_inf_nan=False: no float field of any config model takes inf or nan (a `.inf`
    # temperature or timeout passed every check and failed, or hung, after start)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ClusterConfig(_Strict):
    """The GPUs rlix schedules. "auto" reads them from the Ray cluster's resources."""

    nodes: Int | Literal["auto"] = Field("auto", description=f"number of nodes (1..{MAX_NODES}), or auto")
    gpus_per_node: Int | Literal["auto"] = Field("auto", description=f"GPUs on each node (1..{MAX_GPUS_PER_NODE}), "
                                                                     f"or auto")
    gpu_slices: Int = Field(1, ge=1, le=8, description="the scheduler sees each GPU as this many GPUs "
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
        for field, most in (("nodes", MAX_NODES), ("gpus_per_node", MAX_GPUS_PER_NODE)):
            value = getattr(self, field)
            if value != "auto" and value < 1:
                raise ValueError(f"{field} must be >= 1 or 'auto', got {value}")
            if value != "auto" and value > most:
                raise ValueError(f"{field} must be <= {most} or 'auto', got {value}")
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

    dwell_s: Seconds = Field(30.0, ge=0, description="a woken shard is not shrunk again for this long")
    aging_s: Seconds = Field(60.0, ge=0, description="a request waiting this long goes first")
    rotate_s: Seconds = Field(120.0, ge=0, description="with more pipelines wanting a shard than GPUs, a "
                                                     "pipeline keeps its only shard this long before the "
                                                     "one waiting longest takes it")
    report_stale_s: Seconds | None = Field(None, gt=0, description="a progress report older than this counts "
                                                                 "as none (full demand); null: never stale")
    metrics_port: Int | None = Field(None, ge=0, le=65535, description="serve the scheduler's Prometheus "
                                                                       "metrics on 127.0.0.1 at this port "
                                                                       "(0: a free one, named in the run "
                                                                       "log); null: not served")
    dashboard_port: Int | None = Field(None, ge=0, le=65535, description="serve the live dashboard (GPU "
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
        """A path names a measured table: read here (by the config's own bounded YAML loader),
        so a bad one is refused with the config."""
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
    median: Float = Field(gt=0, le=MAX_TOKENS, description="the draws' median, in tokens")
    sigma: Float | None = Field(None, gt=0, le=10, description="lognormal: sigma of the underlying normal "
                                                              "(1.0: p99 is ~10x the median; above 10 a draw "
                                                              "overflows)")
    alpha: Annotated[Float, Field(gt=0, le=100), _at_least(0.1, "a heavier tail overflows a draw")] | None = Field(
        None, description="pareto: the tail index, 0.1..100 (1.0: p99 is ~50x the median)")
    min: Int = Field(1, ge=1, le=MAX_TOKENS, description="the shortest limit drawn, in tokens")

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


#: rollout.stop: strings per pipeline, and characters per string, at most
MAX_STOP, MAX_STOP_CHARS = 16, 64


class RolloutConfig(_Strict):
    """How a pipeline generates: GRPO groups of samples per prompt."""

    groups_per_step: Int = Field(8, ge=1, le=MAX_SEQS, description="prompts (groups) trained on per step")
    group_size: Int = Field(8, ge=2, le=MAX_SEQS,
                            description="samples per prompt; advantages are normalised within a group")
    max_new_tokens: Int = Field(16, ge=1, le=MAX_TOKENS, description="tokens generated per sample at most")
    temperature: Annotated[Float, _at_least(MIN_TEMPERATURE, "logits / temperature overflows below it")] = Field(
        1.0, gt=0, le=MAX_TEMPERATURE, description="sampling temperature (must be > 0 for GRPO to explore)")
    concurrency: Int = Field(8, ge=1, le=MAX_SEQS,
                             description="groups in flight at once per awake shard (one shard's worth while "
                                         "none is awake): a pipeline given more shards keeps them all busy; "
                                         "max_staleness still bounds the total")
    max_model_len: Int = Field(256, ge=16, le=MAX_TOKENS, description="the shards' context length (prompt + response)")
    max_num_seqs: Int = Field(64, ge=1, le=MAX_SEQS, description="sequences one shard decodes at once")
    capture_graphs: bool = Field(False, description="on CUDA, each shard of the embedded engine captures all "
                                                    "its decode and prefill CUDA graphs when it starts (during "
                                                    "set-up), so that no step captures one on its path; the "
                                                    "start takes longer. Off: a graph is captured the first "
                                                    "time its batch shape is seen")
    length_tail: LengthTail | None = Field(None, description="draw each sample's token limit (its request's "
                                                             "max_tokens) from a heavy-tailed distribution, "
                                                             "capped at max_new_tokens, reproducibly from the "
                                                             "pipeline's seed; null: every sample may run to "
                                                             "max_new_tokens. Agent episodes (`env:`) ignore it")
    ignore_eos: bool = Field(False, description="samples run to their token limit whatever the model samples "
                                                "(benchmarks of random-weight models, whose end-of-text "
                                                "tokens would cut every length short at random; not for "
                                                "real training). Agent episodes (`env:`) ignore it")
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP,
        description=f"stop strings (at most {MAX_STOP}, each of 1 to {MAX_STOP_CHARS} characters): a sample ends "
                    "once its text holds one; the reward sees the text before it (as vLLM's `stop`), the "
                    "trainer the tokens sampled, through the one that completed it. Agent episodes (`env:`) "
                    "ignore it")

    @model_validator(mode="after")
    def _tail_within_limit(self) -> "RolloutConfig":
        tail = self.length_tail
        if tail is not None and tail.min > self.max_new_tokens:
            raise ValueError(f"length_tail.min ({tail.min}) must not exceed max_new_tokens ({self.max_new_tokens})")
        if tail is not None and tail.median > self.max_new_tokens:
            raise ValueError(f"length_tail.median ({tail.median:g}) must not exceed max_new_tokens "
                             f"({self.max_new_tokens})")
        return self


#: eval: prompts of one evaluation, and samples per prompt for pass@k, at most
MAX_EVAL_PROMPTS, MAX_EVAL_K = 4096, 256


def _bounded_task(task: TaskConfig) -> TaskConfig:
    """Bounds TaskConfig (rlix.envs.config) does not set on its fields itself."""
    if task.length > MAX_TOKENS:
        raise ValueError(f"length must be <= {MAX_TOKENS} (characters scored), got {task.length}")
    if task.max_operand > MAX_COUNT:
        raise ValueError(f"max_operand must be <= {MAX_COUNT}, got {task.max_operand}")
    if task.path is not None:
        _path(task.path)
    return task


class EvalConfig(_Strict):
    """A held-out evaluation of the pipeline's current weights every `every` steps (docs/ENVIRONMENTS.md,
    "Evaluation"): a greedy response and `k` sampled ones per prompt of its own `task`, scored
    by that task; a response passes when its reward reaches `threshold`."""

    every: Int = Field(0, ge=0, le=MAX_COUNT, description="evaluate every N steps, and after the last step; "
                                                          "0: never (`rlix eval` still can)")
    task: TaskConfig | None = Field(None, description="the held-out set: a task config of its own (the schema "
                                                      "of a pipeline's task:, e.g. a dataset task on a held-out "
                                                      "JSONL); needed when every > 0")
    samples: Int = Field(64, ge=1, le=MAX_EVAL_PROMPTS,
                         description="prompts evaluated: the first N rows of a dataset, jsonl or reasoning_gym "
                                     "task (all of them if fewer), or N drawn with a fixed seed from pattern / "
                                     "arithmetic; the same prompts at every evaluation")
    k: Int = Field(4, ge=0, le=MAX_EVAL_K, description="samples per prompt at `temperature`, for pass@k (any of "
                                                       "the k passes); 0: the greedy pass@1 only")
    temperature: Annotated[Float, _at_least(MIN_TEMPERATURE, "logits / temperature overflows below it")] = Field(
        1.0, gt=0, le=MAX_TEMPERATURE, description="temperature of the k sampled responses (the pass@1 "
                                                    "response is greedy)")
    threshold: Float = Field(1.0, gt=0, le=1, description="a response passes when its reward (in [0, 1]) is "
                                                          "at least this")

    @field_validator("task")
    @classmethod
    def _task_bounds(cls, task: TaskConfig | None) -> TaskConfig | None:
        return None if task is None else _bounded_task(task)

    @model_validator(mode="after")
    def _task_given(self) -> "EvalConfig":
        if self.every and self.task is None:
            raise ValueError(f"task (the held-out set) is needed with every: {self.every}, e.g. "
                             "{name: dataset, path: heldout.jsonl, reward: ...}")
        return self


class VllmOptions(_Strict):
    """vLLM's own settings for a pipeline whose shards are vLLM servers (`engine: vllm`)."""

    max_num_seqs: Int | None = Field(None, ge=1, le=MAX_SEQS,
                                     description="vLLM --max-num-seqs (default: rollout.max_num_seqs)")
    gpu_memory_utilization: Float | None = Field(None, gt=0, le=1, description="vLLM --gpu-memory-utilization "
                                                                              "(default: vLLM's)")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager: no CUDA graphs (faster start)")
    cpu_kvcache_gib: Int = Field(1, ge=1, le=4096, description="on CPU: KV cache of each server in GiB "
                                                      "(VLLM_CPU_KVCACHE_SPACE)")
    startup_timeout_s: Seconds = Field(600.0, gt=0, description="a server not healthy within this fails "
                                                             "(a cold start on a small CPU takes minutes)")
    extra_args: list[Annotated[str, AfterValidator(_no_nul)]] = Field(
        default_factory=list, description="more arguments for vLLM's server, as is")


class TrainConfig(_Strict):
    """The trainer's optimiser and loss settings (see rlix.training)."""

    lr: Float = Field(1e-3, gt=0, le=1, description="AdamW learning rate")
    weight_decay: Float = Field(0.0, ge=0, le=100)
    micro_batch_size: Int = Field(16, ge=1, le=MAX_SEQS,
                                  description="padded tokens per forward/backward, in samples "
                                  "of the batch's longest (samples are grouped by length; gradients accumulate)")
    clip_eps: Float = Field(0.2, gt=0, le=10, description="PPO ratio clip")
    kl_coef: Float = Field(0.0, ge=0, le=1e6, description="KL penalty to the initial model (0 = no reference model)")
    aggregation: Literal["token", "sequence"] = Field("token", description="loss mean over tokens or sequences")
    max_grad_norm: Float = Field(1.0, gt=0, le=1e12)
    bucket_mib: Int | None = Field(None, ge=1, le=16384, description="weight-sync bucket size in MiB (null: 256 on "
                                                         "CUDA, where each bucket's fixed cost, a "
                                                         "message and a copy launch, outweighs its "
                                                         "bytes at 64; 64 on CPU)")
    fsdp: bool = Field(False, description="shard the parameters and AdamW state over the train_gpus ranks "
                                          "(FSDP2; float32 master state, compute in the model's dtype); "
                                          "one rank trains unsharded. The ranks must share a node")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer's activations "
                                                              "in the backward pass (fsdp only): less memory, "
                                                              "about a third more compute")

    @model_validator(mode="after")
    def _sharding(self) -> "TrainConfig":
        if self.activation_checkpointing and not self.fsdp:
            raise ValueError("activation_checkpointing applies to fsdp: true only")
        return self


#: an external command's first word that means the Python rlix runs in (a PATH's `python` may lack rlix)
PYTHON_WORDS = ("python", "python3")


class ExternalConfig(_Strict):
    """A pipeline whose training loop is another program (a framework's GRPO loop, a plain
    PyTorch loop): rlix starts `command`, serves its generation through the pipeline's shards
    and router, and moves its GPUs; the program drives its steps through `rlix.client`."""

    command: list[Annotated[str, Field(min_length=1, max_length=MAX_PATH)]] = Field(
        min_length=1, max_length=256,
        description="the program and its arguments (no shell; a first word `python` or `python3` is the "
                    "Python rlix runs in); its environment names the pipeline's actor, so "
                    "`rlix.client.connect()` inside it needs no arguments")
    cwd: PathStr | None = Field(None, description="its working directory (default: the directory rlix runs in)")
    start_timeout_s: Seconds = Field(300.0, gt=0, description="how long it may take to call `start()` "
                                                              "(import, load its model) before it is failed")
    after_training_timeout_s: Seconds = Field(600.0, gt=0, description="a step that held its training GPUs "
                                                                       "this long without `after_training` "
                                                                       "fails the pipeline, with that reason")


class PipelineConfig(_Strict):
    """One RL pipeline: what the scheduler sees, and what it trains."""

    name: Name = Field(description=f"1..{MAX_NAME} letters, digits, '.', '_' or '-' (not '.' or '..'): its "
                                   f"folder under run_dir")
    priority: Int = Field(0, ge=-MAX_COUNT, le=MAX_COUNT,
                          description="strict tiers: a higher priority is always served first")
    weight: Float = Field(1.0, gt=0, le=1e6, description="share of rollout GPUs within its tier")
    model: PathStr = Field("tiny", description="model preset name or local checkpoint path")
    train_gpus: Int = Field(1, ge=1, le=MAX_GPUS, description="GPUs the trainer needs for one step")
    tp: Int = Field(1, ge=1, le=MAX_GPUS_PER_NODE,
                    description="GPUs per inference shard (tensor parallel size: on CUDA the shard's engine "
                                "splits the model across them; fake GPUs only schedule it)")
    min_shards: Int = Field(1, ge=0, le=MAX_GPUS, description="shards kept whenever it has rollout demand")
    max_shards: Int = Field(1, ge=1, le=MAX_GPUS, description="most inference shards it can use (x tp: at most "
                                                              "the cluster's GPUs)")
    partial_overlap: bool = Field(True, description="its shards may sleep on its training GPUs")
    max_staleness: Int = Field(1, ge=0, le=MAX_COUNT,
                               description="oldest weight version a trained trajectory may use, in steps")
    seqs_per_shard: Int = Field(8, ge=1, le=MAX_SEQS,
                                description="trajectories one shard should carry; converts demand to shards")
    steps: Int = Field(20, ge=1, le=MAX_COUNT, description="training steps to run")
    seed: Int = Field(0, ge=0, le=MAX_SEED, description="seeds prompts, sampling and the trainer")
    task: TaskConfig = Field(default_factory=TaskConfig, description="what the policy is rewarded for")
    rollout: RolloutConfig = RolloutConfig()
    eval: EvalConfig = Field(default_factory=EvalConfig, description="a held-out evaluation every N steps "
                                                                     "(greedy pass@1, pass@k): docs/ENVIRONMENTS.md")
    train: TrainConfig = TrainConfig()
    gpus: list[Annotated[Int, Field(ge=0, le=MAX_GPUS)]] | None = Field(
        None, description="standalone mode: the fixed GPUs this pipeline uses (default: all); ignored when "
                          "time-sharing")
    checkpoint_every: Int = Field(10, ge=0, le=MAX_COUNT, description="save a checkpoint every N steps (0: only at "
                                                        "the end); one is also saved on Ctrl-C and "
                                                        "when the pipeline fails, if its trainer lives")
    checkpoint_keep_last: Int = Field(2, ge=1, le=MAX_CHECKPOINTS,
                                      description="step-numbered checkpoints kept (checkpoint/step-NNNNNN/), "
                                                  "the newest ones; older ones are removed once a newer one "
                                                  "is complete. `--resume` continues from the newest")
    checkpoint_keep_best: Int = Field(0, ge=0, le=MAX_CHECKPOINTS,
                                      description="checkpoints kept besides the newest ones: those with the "
                                                  "best checkpoint_best_metric (0: none)")
    checkpoint_best_metric: str = Field("reward", min_length=1, max_length=128,
                                        description="the metrics.jsonl column that ranks checkpoints for "
                                                    "checkpoint_keep_best: the mean of that column over the "
                                                    "rows of the checkpoint's step (an eval metric ranks only "
                                                    "checkpoints of steps that were evaluated); a checkpoint "
                                                    "whose step has no value is not ranked")
    checkpoint_best_mode: Literal["max", "min"] = Field("max", description="max: a higher checkpoint_best_metric "
                                                                          "is better (reward); min: lower (loss)")
    max_failed_groups: Int = Field(32, ge=0, le=MAX_COUNT,
                                   description="stop the pipeline when this many groups in a row fail (a "
                                               "verifier that raises, no shard answering); 0: never")
    restart: Literal["never", "on_failure"] = Field(
        "never", description="on_failure: a failed pipeline (error, dead process, hang) is started "
                             "again from its last checkpoint, up to max_restarts times")
    max_restarts: Int = Field(2, ge=0, le=1000, description="restarts of this pipeline at most (restart: on_failure)")
    audit_weights: bool = Field(False, description="after every sync, compare each shard's weight "
                                                   "checksums with the trainer's (a pass over the "
                                                   "weights on both sides: for tests and benchmarks)")
    cpu_threads: Int | None = Field(1, ge=1, le=1024, description="torch threads of its trainer and of each shard "
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
    external: ExternalConfig | None = Field(None, description="the training loop is this program (through "
                                                              "rlix.client); rlix runs its shards and GPUs "
                                                              "(task, train, rollout's sampling: the program's)")

    @model_validator(mode="after")
    def _shard_bounds(self) -> "PipelineConfig":
        if self.min_shards > self.max_shards:
            raise ValueError(f"min_shards ({self.min_shards}) must not exceed max_shards ({self.max_shards})")
        if self.gpus is not None:
            if len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus must not repeat a GPU, got {self.gpus}")
            if len(self.gpus) < max(self.train_gpus, self.tp):
                raise ValueError(f"gpus {self.gpus} are fewer than train_gpus={self.train_gpus} / tp={self.tp}")
        if self.external is not None and self.env is not None:
            raise ValueError("external: the program runs its own episodes; env: is for rlix's own loop")
        return self

    @field_validator("task")
    @classmethod
    def _task_bounds(cls, task: TaskConfig) -> TaskConfig:
        return _bounded_task(task)

    @field_validator("env")
    @classmethod
    def _env_bounds(cls, env: EnvConfig | None) -> EnvConfig | None:
        """Bounds EnvConfig (rlix.envs.agent_config) does not set on its fields itself."""
        if env is None:
            return env
        for field in ("tool_latency_s", "episode_timeout_s", "startup_timeout_s"):
            value = getattr(env, field)
            if not math.isfinite(value) or value > MAX_SECONDS:
                raise ValueError(f"{field} must be a finite number of seconds <= {MAX_SECONDS:g}, got {value}")
        for field in ("max_turns", "max_restarts", "episode_retries"):
            if getattr(env, field) > 1000:
                raise ValueError(f"{field} must be <= 1000, got {getattr(env, field)}")
        return env

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

    project: str = Field("rlix", min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$",
                         description="wandb project (wandb refuses / \\ # ? % : and more than 128 characters)")
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
    samples_per_step: Int = Field(4, ge=0, le=64, description="trajectories of each step's batch kept "
                                  "readable (prompt and response text, reward, length): appended to "
                                  "run_dir/<pipeline>/samples.jsonl, shown as a table on the console and "
                                  "to the trackers chosen; 0: none")
    console_samples_every: Int = Field(1, ge=0, le=1_000_000, description="the samples table is printed "
                                       "on the console every this many steps (0: never; samples.jsonl "
                                       "and the trackers get every step's)")


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
    release_timeout_s: Seconds = Field(60.0, gt=0, description="how long a GPU's holder may take to "
                                                             "confirm its memory is free before the "
                                                             "pipeline is failed and the GPU taken back")
    heartbeat_timeout_s: Seconds = Field(60.0, gt=0, description="a pipeline whose actor does not answer "
                                                               "a progress call for this long is "
                                                               "failed as hung (and its processes ended)")
    setup_timeout_s: Seconds = Field(900.0, gt=0, description="a pipeline not set up (trainer and model "
                                                            "loaded, answering) within this is failed")
    scheduler: SchedulerConfig = SchedulerConfig()
    control_plane: Literal["rlix", "standalone"] = Field(
        "rlix", description="rlix: pipelines time-share GPUs through the scheduler; standalone: each "
                            "runs on fixed GPUs (env RLIX_CONTROL_PLANE overrides)")
    run_dir: PathStr = Field("runs/latest", description="where logs, metrics and checkpoints go (not empty: "
                                                        "'.' is the current directory)")
    vllm_python: PathStr | None = Field(None, description="Python of an environment with vLLM, for pipelines "
                                                      "with engine: vllm (default: RLIX_VLLM_PYTHON, else "
                                                      "the one scripts/setup-vllm.sh linked into the venv)")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="per-step metrics to "
                                                                              "TensorBoard and wandb")
    pipelines: list[PipelineConfig] = Field(min_length=1)

    def dtype_on(self, device: str) -> str | None:
        """The dtype models load in on `device`: `auto` is bfloat16 on cuda and the
        checkpoint's own (None) on cpu."""
        if self.dtype == "auto":
            return "bfloat16" if device == "cuda" else None
        return self.dtype

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
