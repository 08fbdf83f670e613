"""What crosses between a framework's loop (rlix.client) and its pipeline's actor: typed, small,
picklable answers, so neither side reads the other's dictionaries."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlix.devices import DeviceMemory


@dataclass(frozen=True)
class PipelineInfo:
    """The pipeline a client drives, as rlix set it up.

    `base_url` is its router: OpenAI's routes under /v1 and rlix's token-level
    /inference/v1/generate, answered by whichever of its shards hold GPUs now (a request cut by a
    preemption is sent again to another); `api_key` is the router's bearer token. `model_path`
    is the checkpoint folder the shards serve at version 0: load the policy from it so that the
    first weights published match what was generated with. `served_dtype`: the dtype the shards
    compute in, the one after_training sends the weights in. `steps`: the config's `steps`.
    `start_version`: the version the shards serve before the first after_training.
    `beside_trainer`: the shards asleep on the training GPUs take each new version from a copy
    on the program's GPU (CUDA IPC), so after_training packs one there. `release_timeout_s`: how
    long before_training waits for the GPU's previous holders to let go (measured)."""

    name: str
    base_url: str
    api_key: str
    model_path: str
    served_dtype: str
    device: str  # cuda | cpu: where the trainer's GPUs are real
    steps: int
    start_version: int = 0
    audit_weights: bool = False
    beside_trainer: bool = False
    release_timeout_s: float = 60.0


@dataclass(frozen=True)
class TrainingGrant:
    """before_training's answer: the step may train now on `gpus` (the run's GPU ids; on a
    CUDA machine the process sees them as its CUDA_VISIBLE_DEVICES said at start)."""

    step: int
    gpus: list[int]
    waited_s: float  # until the scheduler had freed them (shards of this and other pipelines slept)


@dataclass(frozen=True)
class VersionSlot:
    """open_version's answer: version `version` may be written into the client's cache now (no
    shard reads the slot it will overwrite)."""

    version: int
    waited_s: float


@dataclass(frozen=True)
class StepDone:
    """after_training's answer: the step's weights are version `version`, the training GPUs are
    released, and `refit` shards that kept generating moved to it (others move when woken)."""

    step: int
    version: int
    publish_s: float  # the weights into the pinned cache, in the client's process
    refit_s: float  # the active shards moved to the version, after the release
    refit: list[int] = field(default_factory=list)  # ranks moved inside the call
    beside: list[int] = field(default_factory=list)  # ranks synced from the GPU copy (CUDA IPC) before the release
    handoff: Handoff | None = None  # the training state's moves this step (None: nothing moved)


@dataclass(frozen=True)
class Handoff:
    """How the program's training state left its GPU after a step and came back for it: the GPU
    measured once the state left (what the next holder found), and the seconds each move took."""

    released: DeviceMemory
    release_s: float  # to host memory, the GPU freed and measured
    reload_s: float  # back, after waiting for the GPU's previous holders (this step's before_training)
