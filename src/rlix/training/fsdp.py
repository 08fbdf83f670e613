"""ShardedPolicyTrainer: one rank of a policy trained with FSDP2, each rank holding a shard.

Why a trainer of its own: `train_gpus: N` otherwise keeps the whole model and its AdamW state on
every rank, so nothing much larger than ~3B trains on an 80 GB GPU. Here rank r keeps only its
rows of every parameter (the dim-0 chunk `torch.chunk` gives it, FSDP2's own split), kept in
float32 (the master copy) with their AdamW moments, read from the checkpoint's safetensors (only
those rows) or drawn for a seeded preset, never the whole model in one process; compute runs in the checkpoint's dtype (or
the run's `dtype`) with gradients reduced in float32 (FSDP2's MixedPrecisionPolicy).

Why the model is wrapped anew every step: a time-shared trainer's process group lives only for
its step (trainer.py: no communicator holds GPU memory while the GPUs serve inference), and an
FSDP2 module keeps the process group it was wrapped with. So each step builds the model's
skeleton on the meta device (nothing allocated), applies `fully_shard` per decoder layer and to
the root over the step's group, allocates the sharded parameters and copies this rank's shards
into them (the kept shards then alias that storage: one copy of them during the step); the
optimizer steps the kept shards, and the wrapped module is dropped with the group. The cost:
the wrap (milliseconds a layer) and the copy in.

Offload and reload move the shards, the buffers and the moments as the unsharded trainer moves
its state (pinned host memory on CUDA). Publishing a version needs no collective: a dim-0 shard
is one contiguous byte range of the full tensor, so each rank writes its rows straight into rank
0's shared-memory cache (`open_version` on rank 0, `write_shard` on every rank, `close_version`
on rank 0: ranks.py's TrainerGroup drives it). The ranks must therefore share rank 0's host.
A checkpoint is written by all ranks at once with torch.distributed.checkpoint (each rank its
rows; it resumes on any number of ranks) plus, from rank 0, the published weights as a plain
Hugging Face folder (`export`). With `kl_coef` > 0 each rank also keeps its rows of the initial
policy in the compute dtype (the reference), wrapped the same way each step for a forward only,
moved with the rest at offload and reload, read again from the checkpoint folder on resume as the
unsharded trainer reloads its reference. Not yet: a device copy for shards beside the trainer
(they sync from the host cache), and `compute_logprobs` outside a step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlix.errors import TrainingError, WeightCacheError, one_line
from rlix.models.slices import host_buffers, row_reader
from rlix.training.offload import StateTensor, optimizer_tensors
from rlix.training.trainer import PolicyTrainer, weights_for_sync
from rlix.training.types import GroupSpec, TrainSample
from rlix.weights.api import PublishedVersion, VersionRefs
from rlix.weights.buckets import fusion_order, pack_rows, plan_layout, unpack
from rlix.weights.cache import BucketCache
from rlix.weights.transport.pinning import PinnedRange, page_lock_tensor
from rlix.weights.wire import Layout, ShmMapper

MASTER_DTYPE = torch.float32


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, end) of a dim-0 split over `world_size` ranks, as torch.chunk
    (and so FSDP2) splits: chunks of ceil(rows / world_size), the last ones short or empty."""
    size = -(-rows // world_size) if rows else 0
    start = min(rows, rank * size)
    return start, min(rows, start + size)


class ShardedPolicyTrainer(PolicyTrainer):
    """A PolicyTrainer rank whose parameters and AdamW state are this rank's FSDP2 shards."""

    def __init__(self, model: str | os.PathLike[str], *, activation_checkpointing: bool = False,
                 **kwargs: Any) -> None:
        self.activation_checkpointing = bool(activation_checkpointing)
        # rank 0's cache segments, mapped (and on CUDA page-locked) once: the cache reuses them
        self._mapper = ShmMapper()
        self._pinned: dict[str, PinnedRange | None] = {}
        super().__init__(model, **kwargs)
        if self.world_size < 2:
            raise TrainingError("a sharded trainer needs at least 2 ranks (one rank trains unsharded)")

    # -- state ------------------------------------------------------------------------------
    def _build_state(self, dtype: torch.dtype | None, start: torch.device) -> torch.nn.Module:
        """Keep this rank's rows of every parameter (float32) and the model's buffers; the model
        itself stays a skeleton on the meta device. The rows are read from the checkpoint's
        safetensors files, or drawn for a seeded preset, without the whole model in memory."""
        config = AutoConfig.from_pretrained(self.model_path)
        stored = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
        self.compute_dtype = dtype or stored
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=MASTER_DTYPE)
        rows = row_reader(self.model_path)
        self.rows: dict[str, tuple[int, int]] = {}
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.shards: dict[str, torch.Tensor] = {}
        self.ref_shards: dict[str, torch.Tensor] = {}  # with kl_coef > 0: the initial policy's rows
        for name, p in skeleton.named_parameters():
            self.rows[name] = shard_rows(p.shape[0], self.world_size, self.rank)
            self.full_shapes[name] = tuple(p.shape)
            lo, hi = self.rows[name]
            # rounded through the compute dtype, as the unsharded trainer holds the checkpoint
            part = rows(name, lo, hi).to(self.compute_dtype)
            self.shards[name] = part.to(MASTER_DTYPE).to(start).requires_grad_(True)
            if self.kl_coef > 0:  # the reference: the same rows, frozen, in the compute dtype (a tensor
                # of its own: in float32 `.to` would return `part`, the policy's shard itself)
                self.ref_shards[name] = part.to(start, copy=True)
        self.buffers = {n: b.to(start) for n, b in host_buffers(skeleton).items()}
        # what a version is made of: names, full shapes and dtypes as shards are synced to
        self.sync_specs = {n: (tuple(t.shape), t.dtype) for n, t in weights_for_sync(skeleton, self.sync_dtype).items()}
        skeleton.train()
        return skeleton

    def _trained_tensors(self) -> list[torch.Tensor]:
        return list(self.shards.values())

    def _state_tensors(self) -> Iterator[StateTensor]:
        for name, t in self.shards.items():
            yield StateTensor(("model", "p", name), t.data, lambda v, t=t: setattr(t, "data", v))
        for name, b in self.buffers.items():
            yield StateTensor(("model", "b", name), b, lambda v, name=name: self.buffers.__setitem__(name, v))
        for name, t in self.ref_shards.items():
            yield StateTensor(("ref", "p", name), t, lambda v, name=name: self.ref_shards.__setitem__(name, v))
        yield from optimizer_tensors(self.optimizer)

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cuda":  # off CUDA nothing ever leaves the host
            super()._move(device)

    # -- the step ---------------------------------------------------------------------------
    def _step_model(self) -> torch.nn.Module:
        """The model wrapped with FSDP2 over this step's process group, this rank's shards in it."""
        model = copy.deepcopy(self.model)  # the meta skeleton: nothing allocated
        if self.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = MixedPrecisionPolicy(param_dtype=None if self.compute_dtype == MASTER_DTYPE else self.compute_dtype,
                                      reduce_dtype=MASTER_DTYPE)
        return self._wrap(model, self.shards, policy)

    def _step_reference(self) -> torch.nn.Module | None:
        """With kl_coef > 0, the reference model wrapped as the policy is, over the same group:
        its frozen rows in the compute dtype, gathered layer by layer for a forward only."""
        if not self.ref_shards:
            return None
        model = copy.deepcopy(self.model).to(self.compute_dtype).requires_grad_(False)
        return self._wrap(model, self.ref_shards, MixedPrecisionPolicy()).eval()

    def _wrap(self, model: torch.nn.Module, shards: dict[str, torch.Tensor],
              policy: MixedPrecisionPolicy) -> torch.nn.Module:
        """`model` (a meta skeleton) sharded with FSDP2 per decoder layer and at the root over
        the step's group, this rank's `shards` copied in; each kept shard then aliases that
        storage (one copy of the rank's rows during the step, not two). FSDP2 re-pads a shard
        of uneven rows at its first forward; the kept one stays the unpadded copy, same values."""
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        layers = model.get_decoder().layers
        if not isinstance(layers, torch.nn.ModuleList):
            raise TrainingError(f"{type(model).__name__}: no list of decoder layers to shard")
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                local = p.to_local()
                if tuple(local.shape) != tuple(shards[name].shape):
                    raise TrainingError(f"internal: FSDP2 gives rank {self.rank} {tuple(local.shape)} of {name}, "
                                        f"this trainer keeps {tuple(shards[name].shape)}")
                local.copy_(shards[name])
                shards[name].data = local
            for name, b in model.named_buffers():
                b.copy_(self.buffers[name])
        return model

    def _step_chunks(self, samples: Sequence[TrainSample]) -> Iterator[tuple[list[int], float]]:
        """Every rank runs as many micro-batches as the rank with most (each forward and backward
        is a collective under FSDP2); a rank with fewer repeats one sample at weight 0."""
        chunks = list(self._chunks(samples))
        count = torch.tensor([len(chunks)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        for idx in chunks:
            yield idx, 1.0
        for _ in range(int(count.item()) - len(chunks)):
            yield chunks[0][:1], 0.0

    def _reduce_grads(self, model: torch.nn.Module) -> None:
        """Nothing left to do: FSDP2 reduce-scatters (averages) every backward's gradients."""

    def _optimizer_step(self, model: torch.nn.Module, max_norm: float) -> float:
        params = list(model.named_parameters())
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], max_norm)  # the whole model's norm
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        for name, p in params:
            grad = p.grad
            self.shards[name].grad = (torch.zeros_like(self.shards[name]) if grad is None
                                      else grad.to_local() if isinstance(grad, DTensor) else grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        raise TrainingError("compute_logprobs needs every rank's shards, which meet only inside a "
                            "step's process group; a sharded trainer has none between steps")

    # -- weights out ------------------------------------------------------------------------
    def state_for_sync(self) -> dict[str, torch.Tensor]:
        raise TrainingError("a sharded trainer has no whole copy of its weights; publish a version "
                            "(every rank writes its rows into rank 0's cache) and read the cache")

    def build_cache(self, version: int, on_device: bool = False) -> BucketCache:
        raise TrainingError("a sharded trainer's versions are built by all its ranks at once "
                            "(TrainerGroup.publish: open_version, write_shard, close_version)")

    def build_device_copy(self, version: int, state: dict[str, torch.Tensor] | None = None
                          ) -> list[torch.Tensor] | None:
        return None  # no rank holds the whole model; shards beside it sync from the host cache

    def layout(self) -> Layout:
        """The buckets a version is packed into, planned from the full shapes alone."""
        specs = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in self.sync_specs.items()}
        return plan_layout(fusion_order(specs), self.cache_bucket_bytes)

    def open_version(self, version: int) -> VersionRefs:
        """(Rank 0) Open `version`'s slot of the cache for every rank to write its rows into."""
        if self.rank != 0:
            raise TrainingError(f"rank {self.rank}: the cache is rank 0's")
        if self.cache is None:
            self.cache = BucketCache(self.layout(), host=self.cache_host)
        return self.cache.begin_version(version)

    def write_shard(self, refs: VersionRefs) -> None:
        """This rank's rows of every parameter (rank 0: the buffers too), cast to the sync dtype,
        into the buckets `refs` names (rank 0's shared memory, on this host)."""
        layout = Layout.from_json(refs.layout_json)
        buckets = [self._mapper.bucket(str(m["shm"]), int(m["offset"]), int(m["nbytes"])) for m in refs.messages]
        if self.device.type == "cuda":  # the GPU's copies into the segment run at pinned speed
            for m in refs.messages:
                name = str(m["shm"])
                if name not in self._pinned:
                    self._pinned[name] = page_lock_tensor(self._mapper.bucket(name, 0, 1))  # the whole mapping
        with torch.no_grad():
            for name, (_, dtype) in self.sync_specs.items():
                if name in self.shards:
                    pack_rows(layout, buckets, name, self.shards[name].to(dtype), self.rows[name][0])
                elif self.rank == 0:
                    buffer = self.buffers[name]
                    pack_rows(layout, buckets, name, buffer.to(dtype) if buffer.is_floating_point() else buffer, 0)

    def close_version(self, version: int, seconds: float = 0.0) -> PublishedVersion:
        """(Rank 0) Every rank wrote its rows: `version` becomes the one shards are refitted to."""
        if self.cache is None:
            raise WeightCacheError("no version is being written (open_version first)")
        self.cache.end_version(version, ok=True)
        self.cache.promote_active(int(version))
        return self.cache.published(version, seconds)

    def drop_version(self, version: int) -> None:
        """(Rank 0) A rank failed to write: `version` is dropped, the versions before it stay."""
        if self.cache is not None:
            self.cache.end_version(version, ok=False)

    def cached_weights(self, version: int) -> dict[str, torch.Tensor]:
        """(Rank 0) The tensors of a published version, read back from the cache: views of its
        buckets (split tensors copied), valid while the version stays in the cache."""
        if self.cache is None:
            raise WeightCacheError("no weight cache yet: publish a version first")
        return unpack(self.cache.layout, self.cache.buckets(version))

    # -- checkpoints ------------------------------------------------------------------------
    def _checkpoint_state(self, mesh: DeviceMesh, template: bool) -> dict[str, Any]:
        """The trainer's state as torch.distributed.checkpoint sees it: every parameter and
        AdamW moment as a DTensor of the full tensor, this rank's rows its local part (host
        copies), so a checkpoint written by n ranks loads on any number. `template`: empty
        tensors for a load to fill. AdamW's moments are saved even before the first step (zeros,
        step 0: an update from them is the update from fresh state)."""
        def full(name: str, local: torch.Tensor) -> DTensor:
            shape = self.full_shapes[name]
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

        model, optim = {}, {}
        for name, t in self.shards.items():
            state = self.optimizer.state.get(t, {})
            if template:
                local = torch.empty(t.shape, dtype=MASTER_DTYPE)
                moments = (torch.empty_like(local), torch.empty_like(local))
                step = torch.zeros((), dtype=torch.float32)
            else:
                local = t.detach().cpu()
                moments = tuple(state[k].detach().cpu() if k in state else torch.zeros_like(local)
                                for k in ("exp_avg", "exp_avg_sq"))
                step = state["step"].detach().cpu().float() if "step" in state else torch.zeros(())
            model[name] = full(name, local)
            optim[name] = {"exp_avg": full(name, moments[0]), "exp_avg_sq": full(name, moments[1]), "step": step}
        return {"model": model, "optim": optim, "trainer_step": torch.tensor(self.step)}

    def save_checkpoint(self, path: str | os.PathLike[str], group: GroupSpec | None = None) -> Path:
        """All ranks at once, over `group` (a gloo rendezvous of their own): the shards and AdamW
        state with torch.distributed.checkpoint in `dcp/` (each rank writes its rows), rank 0 the
        step and RNG state, and the published weights as a Hugging Face folder in `model/` when
        the version published last is this step (after every step of a run)."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        with self._step_group(self._checkpoint_group(group)):
            mesh = init_device_mesh("cpu", (self.world_size,))
            dcp.save(self._checkpoint_state(mesh, template=False), checkpoint_id=root / "dcp")
        if self.rank == 0:
            self._save_trainer_state(root)
            if self.cache is not None and self.cache.active_version == self.step:
                self.export(root / "model", self.step)
        return root

    def load_checkpoint(self, path: str | os.PathLike[str], group: GroupSpec | None = None) -> None:
        """All ranks at once, over `group`: each reads its rows of what `save_checkpoint` wrote,
        whatever the number of ranks that wrote it."""
        root = Path(path)
        if not (root / "dcp" / ".metadata").is_file() or not (root / "trainer.json").is_file():
            raise TrainingError(f"{root} is not a sharded trainer checkpoint (no dcp/.metadata or trainer.json)")
        with self._step_group(self._checkpoint_group(group)):
            mesh = init_device_mesh("cpu", (self.world_size,))
            state = self._checkpoint_state(mesh, template=True)
            try:
                dcp.load(state, checkpoint_id=root / "dcp")
            except Exception as exc:  # noqa: BLE001 - one line naming the checkpoint
                raise TrainingError(f"checkpoint {root} does not fit this model: {one_line(exc)}") from None
        with torch.no_grad():
            for name, t in self.shards.items():
                t.copy_(state["model"][name].to_local())
                saved = state["optim"][name]
                self.optimizer.state[t] = {
                    "step": saved["step"].clone(),
                    "exp_avg": saved["exp_avg"].to_local().clone().to(t.device),
                    "exp_avg_sq": saved["exp_avg_sq"].to_local().clone().to(t.device)}
        self.step = int(state["trainer_step"])
        self._load_rng(root)

    def _checkpoint_group(self, group: GroupSpec | None) -> GroupSpec:
        """Checkpoints go through gloo whatever the device: the state is saved from host copies."""
        if group is None:
            raise TrainingError(f"rank {self.rank} of {self.world_size}: a sharded checkpoint is written by "
                                "every rank at once and needs a GroupSpec for their process group")
        return dataclasses.replace(group, backend="gloo")

    def export(self, dest: Path, version: int) -> None:
        """(Rank 0) Published `version` as a plain Hugging Face folder (safetensors shards of at
        most 5 GB, config, tokenizer) that transformers, `rlix serve` and vLLM load: the weights
        as shards are synced to, so in the served dtype. A checkpoint includes it when the
        version published last is the trainer's current step (after every step of a run)."""
        dest.mkdir(parents=True, exist_ok=True)
        tensors = self.cached_weights(version)  # views of the cache's buckets
        plan = split_torch_state_dict_into_shards(tensors)
        for filename, names in plan.filename_to_tensors.items():  # one file's copy in memory at a time
            save_file({n: tensors[n].clone() for n in names}, str(dest / filename), metadata={"format": "pt"})
        if plan.is_sharded:
            (dest / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}, indent=2))
        config = json.loads((self.model_path / "config.json").read_text())
        if self.sync_dtype is not None:
            config["dtype" if "dtype" in config else "torch_dtype"] = str(self.sync_dtype).removeprefix("torch.")
        (dest / "config.json").write_text(json.dumps(config, indent=2))
        generation = self.model_path / "generation_config.json"
        if generation.is_file():
            shutil.copy2(generation, dest / generation.name)
        self._copy_model_files(dest)
