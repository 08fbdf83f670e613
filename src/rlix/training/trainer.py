"""PolicyTrainer: one GRPO policy, its AdamW state and the hooks a time-shared trainer needs.

Plain class, no Ray (ranks.py's TrainerActor wraps it). Besides the train step it does what the scheduler's
time sharing asks of a trainer between steps: snapshot the weights into the CPU bucket cache
under the engine's names, offload everything to CPU and back, checkpoint and resume bit-exactly,
and data-parallel steps whose process group lives only for the step (a fresh rendezvous per
step, destroyed at its end) so no communicator holds GPU memory while the GPUs serve inference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlix.config.models import TrainConfig
from rlix.devices import DeviceMemory, cap_process_memory, measure, release_and_measure, wait_for_free
from rlix.errors import GpuMemoryError, TrainingError
from rlix.models.init import load_causal_lm
from rlix.models.presets import SEEDED_FILE, resolve_model
from rlix.tcp_store import join_store, serve_store
from rlix.training.grpo import Aggregation, policy_loss
from rlix.training.offload import HostOffload, StateTensor, module_tensors, optimizer_tensors, state_bytes
from rlix.training.types import GroupSpec, GroupStats, TrainSample
from rlix.weights.api import PublishedVersion
from rlix.weights.buckets import DEFAULT_BUCKET_BYTES, default_bucket_bytes, fusion_order, plan_layout
from rlix.weights.cache import BucketCache, HostMemory
from rlix.weights.device_copy import DeviceCopy, copy_to_host

# All-reduce gradients in flat buckets of at most this many bytes: few collectives, bounded copy.
_GRAD_BUCKET_BYTES = 64 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: not copied into a checkpoint: it writes its own config; a seeded recipe beside weights would mislead
_MODEL_FILES = {"config.json", "generation_config.json", SEEDED_FILE}
#: room a reload asks for beyond the state itself (the first micro-batch's activations start there)
RELOAD_MARGIN_BYTES = 256 << 20
HOST_ALIGN = 256  # bytes: each tensor carved out of the pinned host slab starts on this boundary


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise TrainingError(f"unknown dtype {dtype!r}")
    return value


class PolicyTrainer:
    """GRPO trainer for one causal LM: micro-batched, optionally data parallel."""

    def __init__(self, model: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                 lr: float = 1e-3, weight_decay: float = 0.0, micro_batch_size: int = 8,
                 clip_eps: float = 0.2, clip_eps_high: float | None = None,
                 aggregation: Aggregation = "token", kl_coef: float = 0.0, seed: int = 0,
                 max_grad_norm: float | None = 1.0, dtype: torch.dtype | str | None = None,
                 temperature: float = 1.0, rank: int = 0, world_size: int = 1,
                 cache_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 cache_host: HostMemory = "auto", offloaded: bool = False,
                 memory_share: float = 1.0) -> None:
        if micro_batch_size < 1:
            raise TrainingError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if aggregation not in ("token", "sequence"):
            raise TrainingError(f"aggregation must be 'token' or 'sequence', got {aggregation!r}")
        if not 0 <= rank < world_size:
            raise TrainingError(f"rank {rank} is not in a world of size {world_size}")
        if temperature <= 0:
            raise TrainingError(f"temperature must be > 0, got {temperature}")
        self.model_path = resolve_model(model)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:  # pin "cuda" to one GPU: set_device/synchronize need it
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            cap_process_memory(self.device, memory_share)  # a slice of a shared GPU: its part only
        self.micro_batch_size = int(micro_batch_size)
        self.clip_eps, self.clip_eps_high = clip_eps, clip_eps_high
        self.aggregation: Aggregation = aggregation
        self.kl_coef = float(kl_coef)
        self.max_grad_norm = max_grad_norm
        self.temperature = float(temperature)
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed = int(seed)
        self.cache_bucket_bytes, self.cache_host = cache_bucket_bytes, cache_host
        self.device_copy: DeviceCopy | None = None  # the newest version packed on the GPU
        torch.manual_seed(self.seed)

        # `offloaded`: built in host memory, the GPU untouched until the first reload() (a
        # time-shared trainer starts before it is granted its GPU)
        self._offload = HostOffload(self.device)
        self.on_device = not offloaded
        # The engines serve the run's dtype when one is given, else the checkpoint's; sync in it.
        saved = json.loads((self.model_path / "config.json").read_text())
        self.sync_dtype = _as_dtype(dtype) or _as_dtype(saved.get("dtype") or saved.get("torch_dtype"))
        self.step = 0
        self.cache: BucketCache | None = None
        self.ref_model: torch.nn.Module | None = None
        self.model = self._build_state(_as_dtype(dtype), torch.device("cpu") if offloaded else self.device)
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab_size else 0
        self.optimizer = torch.optim.AdamW(self._trained_tensors(), lr=lr, weight_decay=weight_decay)
        if offloaded and self.device.type == "cuda":
            self._pin_host_state()

    def _build_state(self, dtype: torch.dtype | None, start: torch.device) -> torch.nn.Module:
        """The policy (and the reference model, with a KL term) on `start`: whole on every rank.
        (training/fsdp.py's trainer keeps a shard of each parameter instead.)"""
        model = self._load(dtype).to(start)
        model.train()
        if self.kl_coef > 0:
            self.ref_model = self._load(dtype).to(start).eval().requires_grad_(False)
        return model

    def _trained_tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps."""
        return list(self.model.parameters())

    def _pin_host_state(self) -> None:
        """(CUDA, offloaded) The host side of every offload, made now, during set-up, while no
        GPU is held: one page-locked slab carved into the parameters, buffers and the AdamW
        moments that the first step will create (`zeros_like` each trainable parameter: its
        shape and dtype). Made at the first offload instead, it cost seconds of pinning per
        pipeline on a GPU that was held and idle; and the first reload copies from page-locked
        memory (several times faster than pageable). The parameters move into the slab here."""
        specs: list[tuple[tuple, torch.Size, torch.dtype, torch.Tensor | None, Callable[[torch.Tensor], None] | None]]
        specs = [(key, t.shape, t.dtype, t, put) for key, t, put in self._state_tensors()]
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    specs += [(("opt", id(param), k), param.shape, param.dtype, None, None)
                              for k in ("exp_avg", "exp_avg_sq")]
        sizes = [-(-math.prod(shape) * dtype.itemsize // HOST_ALIGN) * HOST_ALIGN for _, shape, dtype, _, _ in specs]
        slab = torch.empty(max(1, sum(sizes)), dtype=torch.uint8, pin_memory=True)
        offset = 0
        for (key, shape, dtype, source, put), size in zip(specs, sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            host = slab[offset:offset + nbytes].view(dtype).view(shape)
            offset += size
            if source is not None and put is not None:
                host.copy_(source)
                put(host)
            self._offload.host[key] = host

    @classmethod
    def from_config(cls, model: str | os.PathLike[str], train: TrainConfig, **kwargs: Any) -> PolicyTrainer:
        """A trainer with a pipeline's `train:` settings; `kwargs` add the rest (seed, device...)."""
        return cls(model, lr=train.lr, weight_decay=train.weight_decay,
                   micro_batch_size=train.micro_batch_size, clip_eps=train.clip_eps,
                   kl_coef=train.kl_coef, aggregation=train.aggregation,
                   max_grad_norm=train.max_grad_norm,
                   cache_bucket_bytes=(train.bucket_mib << 20 if train.bucket_mib
                                       else default_bucket_bytes(kwargs.get("device", "cpu"))),
                   **kwargs)

    def _load(self, dtype: torch.dtype | None) -> torch.nn.Module:
        return load_causal_lm(self.model_path, dtype)

    # -- batches ----------------------------------------------------------------------------
    def _check(self, samples: Sequence[TrainSample]) -> None:
        if not samples:
            raise TrainingError("empty batch")
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise TrainingError(f"sample {i}: empty prompt (a response token needs a context)")
            if len(s.behaviour_logprobs) != len(s.response_ids):
                raise TrainingError(f"sample {i}: {len(s.behaviour_logprobs)} behaviour logprobs for "
                                    f"{len(s.response_ids)} response tokens")
            if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
                raise TrainingError(f"sample {i}: {len(s.loss_mask)} loss-mask entries for "
                                    f"{len(s.response_ids)} response tokens")
            ids = list(s.prompt_ids) + list(s.response_ids)
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise TrainingError(f"sample {i}: token id out of the vocabulary [0, {self.vocab_size})")

    def _chunks(self, samples: Sequence[TrainSample]) -> Iterator[list[int]]:
        """Micro-batches, as indices into `samples`: the samples in order of length, each
        micro-batch as many as fit `micro_batch_size` x the batch's longest sample in padded
        tokens. A micro-batch is padded to its longest sample, so taken in the batch's order a
        few long samples (RL's response lengths are long-tailed) padded most micro-batches to
        their length; sorted, short samples go together, many to a micro-batch, and a
        micro-batch never holds more tokens (the memory it needs) than `micro_batch_size` of
        the longest did before. The loss does not depend on the split (one normalizer for the
        whole batch), so neither does the step."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        budget = self.micro_batch_size * max(lengths, default=0)
        chunk: list[int] = []
        for i in sorted(range(len(samples)), key=lambda i: lengths[i]):
            if chunk and (len(chunk) + 1) * lengths[i] > budget:
                yield chunk
                chunk = []
            chunk.append(i)
        if chunk:
            yield chunk

    def _logprobs(self, model: torch.nn.Module, chunk: Sequence[TrainSample], entropy: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs [B, T] of each response under `model`, the loss mask (the
        response tokens, less those a sample's `loss_mask` leaves out), and with `entropy` the
        entropy [B, T] of the policy's next-token distribution at each of those positions (at
        the sampling temperature; no gradient, masked like the logprobs), else None.

        Right-padded [B, L] inputs; the logit at position p predicts token p+1, so response
        token j of a sample with prompt length P is scored by the logit at P+j-1. Only logits
        from the shortest prompt's last position on are materialised.
        """
        dev = self.device
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in chunk]
        width, t_max = max(lengths), max(len(s.response_ids) for s in chunk)
        ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, :lengths[i]] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
            attn[i, :lengths[i]] = 1
        start = min(len(s.prompt_ids) for s in chunk) - 1
        cols = torch.zeros((len(chunk), max(t_max, 1)), dtype=torch.long)
        mask = torch.zeros((len(chunk), max(t_max, 1)))
        for i, s in enumerate(chunk):
            n = len(s.response_ids)
            cols[i, :n] = torch.arange(n) + len(s.prompt_ids) - 1 - start
            mask[i, :n] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=mask.dtype)
        ids, attn, cols, mask = ids.to(dev), attn.to(dev), cols.to(dev), mask.to(dev)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False,
                       logits_to_keep=width - start).logits  # positions start .. width-1
        logits = logits[:, :-1].float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        picked = torch.gather(logits, 1, cols.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        targets = torch.gather(ids[:, 1:], 1, cols + start)
        logsm = torch.log_softmax(picked, dim=-1)
        logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = None
        if entropy:  # from the log-softmax the loss needs anyway: one more pass over the vocabulary
            with torch.no_grad():
                ent = -(logsm.exp() * logsm).sum(dim=-1) * mask
        return logp * mask, mask, ent

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Logprobs of each sample's response under the current policy (no grad)."""
        self._require_on_device()
        self._check(samples)
        out: list[list[float]] = [[] for _ in samples]
        for idx in self._chunks(samples):
            chunk = [samples[i] for i in idx]
            logp, _, _ = self._logprobs(self.model, chunk)
            for i, row in zip(idx, logp.cpu().tolist()):
                out[i] = row[:len(samples[i].response_ids)]
        return out

    # -- the step ---------------------------------------------------------------------------
    @contextmanager
    def _step_group(self, group: GroupSpec | None) -> Iterator[GroupStats | None]:
        """A process group for this step only: fresh rendezvous in, destroy_process_group out.
        Yields its stats (filled in as it is destroyed), None when one rank needs no group."""
        if self.world_size == 1 and (group is None or group.world_size == 1):
            yield None
            return
        if group is None:
            raise TrainingError(f"rank {self.rank} of {self.world_size}: a data-parallel step needs a "
                                "GroupSpec (fresh master address and port) for its process group")
        if (group.rank, group.world_size) != (self.rank, self.world_size):
            raise TrainingError(f"group is rank {group.rank} of {group.world_size}, trainer is rank "
                                f"{self.rank} of {self.world_size}")
        if dist.is_initialized():
            raise TrainingError("a default torch.distributed process group already exists; the "
                                "trainer creates and destroys its own for each step")
        backend = group.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        t0 = time.perf_counter()
        # the rendezvous served on the master address alone (rlix.tcp_store says why)
        store = (serve_store(group.master_addr, group.master_port, group.world_size, group.timeout_s)
                 if group.rank == 0 else
                 join_store(group.master_addr, group.master_port, group.world_size, group.timeout_s))
        dist.init_process_group(backend, store=store, rank=group.rank, world_size=group.world_size,
                                timeout=timedelta(seconds=group.timeout_s))
        stats = GroupStats(setup_s=time.perf_counter() - t0)
        try:
            yield stats
        finally:
            t0 = time.perf_counter()
            dist.destroy_process_group()
            stats.teardown_s = time.perf_counter() - t0
            stats.destroyed = not dist.is_initialized()

    def _all_reduce_mean_grads(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must reduce the same tensors
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for g in [p.grad for p in params] + [None]:
            if bucket and (g is None or g.dtype != bucket[0].dtype
                           or size + g.numel() * g.element_size() > _GRAD_BUCKET_BYTES):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat)
                flat.div_(self.world_size)
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
                bucket, size = [], 0
            if g is not None:
                bucket.append(g)
                size += g.numel() * g.element_size()

    def train_step(self, samples: Sequence[TrainSample], group: GroupSpec | None = None
                   ) -> dict[str, float]:
        """One optimizer step on `samples` (this rank's share of the batch); see module doc."""
        self._require_on_device()
        self._check(samples)
        started = time.perf_counter()
        dev = self.device
        with self._step_group(group) as group_stats:
            distributed = group_stats is not None
            model = self._step_model()
            reference = self._step_reference()
            local = torch.tensor([sum(s.trained_tokens() for s in samples),
                                  sum(1 for s in samples if s.trained_tokens()), len(samples)],
                                 dtype=torch.float64, device=dev)
            if distributed:
                dist.all_reduce(local)
            num_tokens, num_seqs, num_samples = (float(x) for x in local.tolist())
            if num_tokens == 0:
                raise TrainingError("the batch has no response tokens")
            # Divide by the whole batch's count on every micro-batch and rank (then the ranks'
            # gradients are averaged), so the step does not depend on how the batch is split.
            normalizer = (num_tokens if self.aggregation == "token" else num_seqs) / self.world_size
            self.optimizer.zero_grad(set_to_none=True)
            # loss, clipped tokens, ratio sum, kl sum, entropy sum
            sums = torch.zeros(5, dtype=torch.float64)
            for idx, scale in self._step_chunks(samples):
                chunk = [samples[i] for i in idx]
                logp, mask, ent = self._logprobs(model, chunk, entropy=True)
                behaviour = torch.zeros(logp.shape)  # built on the host, copied once
                for i, s in enumerate(chunk):
                    behaviour[i, :len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
                behaviour = behaviour.to(dev)
                adv = torch.tensor([float(s.advantage) for s in chunk], device=dev)
                ref = None
                if reference is not None:
                    with torch.no_grad():
                        ref, _, _ = self._logprobs(reference, chunk)
                loss, m = policy_loss(logp, behaviour, adv, mask, clip_eps=self.clip_eps,
                                      clip_eps_high=self.clip_eps_high, aggregation=self.aggregation,
                                      ref_logprobs=ref, kl_coef=self.kl_coef, normalizer=normalizer)
                (loss * scale).backward()
                n = m["num_tokens"] * scale
                ent_sum = float(ent.sum()) * scale if ent is not None else 0.0
                sums += torch.tensor([m["loss"] * scale, m["clip_fraction"] * n, m["ratio"] * n,
                                      m.get("kl", 0.0) * n, ent_sum], dtype=torch.float64)
            if distributed:
                self._reduce_grads(model)
                reduced = sums.to(dev)
                dist.all_reduce(reduced)
                sums = reduced.cpu()
            limit = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else float("inf")
            grad_norm = self._optimizer_step(model, limit)
            del model, reference
        self.step += 1
        loss_sum, clipped, ratio_sum, kl_sum, entropy_sum = sums.tolist()
        metrics = {
            "loss": loss_sum / self.world_size, "grad_norm": float(grad_norm),
            "clip_fraction": clipped / num_tokens, "ratio": ratio_sum / num_tokens,
            "entropy": entropy_sum / num_tokens,
            "num_samples": num_samples, "num_tokens": num_tokens, "step": float(self.step),
            "seconds": time.perf_counter() - started,
        }
        if self.kl_coef > 0:
            metrics["kl"] = kl_sum / num_tokens
        if group_stats is not None:  # made and destroyed inside the step
            metrics.update(ranks=float(self.world_size), group_setup_s=group_stats.setup_s,
                           group_teardown_s=group_stats.teardown_s, group_destroyed=float(group_stats.destroyed))
        return metrics

    # step hooks: what a sharded trainer (training/fsdp.py) does differently inside a step
    def _step_model(self) -> torch.nn.Module:
        """The module the step runs forward and backward through."""
        return self.model

    def _step_reference(self) -> torch.nn.Module | None:
        """The reference model the step's KL term reads (None without one: kl_coef 0)."""
        return self.ref_model

    def _step_chunks(self, samples: Sequence[TrainSample]) -> Iterator[tuple[list[int], float]]:
        """The step's micro-batches and each one's weight in the loss (1: all of them count)."""
        for idx in self._chunks(samples):
            yield idx, 1.0

    def _reduce_grads(self, model: torch.nn.Module) -> None:
        """Average the gradients over the ranks (a data-parallel step)."""
        self._all_reduce_mean_grads()

    def _optimizer_step(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the gradients to `max_norm` (the whole model's norm), step; the norm before."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- weights out ------------------------------------------------------------------------
    def state_for_sync(self) -> dict[str, torch.Tensor]:
        """The weights under the checkpoint's (= the engine's canonical) names: tied tensors once,
        under their first name (no `lm_head.weight` when embeddings are tied), plus persistent
        buffers; in the checkpoint's dtype. Shares storage with the model where no cast is needed.
        Works offloaded too (the tensors are then the host copies)."""
        return weights_for_sync(self.model, self.sync_dtype)

    def build_cache(self, version: int, on_device: bool = False) -> BucketCache:
        """Snapshot the weights into the host bucket cache as `version` (the cache is allocated
        once, pinned with CUDA else shared memory, and reused for every later version).
        `on_device`: pack them on the GPU first (`build_device_copy`) and fill the cache from
        that copy, which stays for the shards on this GPU until `offload`."""
        state = self.state_for_sync()
        if self.cache is None:
            self.cache = BucketCache.for_model(state, bucket_bytes=self.cache_bucket_bytes,
                                               host=self.cache_host)
        copied = self.build_device_copy(version, state) if on_device else None
        if copied is None:
            self.cache.build_latest(int(version), state)
        else:
            self.cache.write_version(int(version), lambda host: copy_to_host(copied, host))
        return self.cache

    def publish(self, version: int, on_device: bool = False) -> PublishedVersion:
        """Build `version` into the cache (`build_cache`) and make it the version shards are
        refitted to; the answer says where its buckets lie, in the host cache and (`on_device`,
        where the GPU had room) in this rank's device copy."""
        started = time.perf_counter()
        cache = self.build_cache(version, on_device)
        cache.promote_active(int(version))
        published = cache.published(version, time.perf_counter() - started)
        copy = self.device_copy
        if on_device and copy is not None and copy.version == int(version):
            published = dataclasses.replace(published, device_refs={self.rank: copy.refs(version)})
        return published

    def build_device_copy(self, version: int, state: dict[str, torch.Tensor] | None = None
                          ) -> list[torch.Tensor] | None:
        """Pack the weights as `version` into a buffer on this trainer's GPU (weights/device_copy),
        from which a shard on the same GPU is synced before the trainer offloads. None (no copy)
        off CUDA, offloaded, or where the GPU has no room for it and a shard's staging beside it."""
        if self.device.type != "cuda" or not self.on_device:
            return None
        state = self.state_for_sync() if state is None else state
        if self.device_copy is None:
            layout = self.cache.layout if self.cache is not None else plan_layout(fusion_order(state), self.cache_bucket_bytes)
            self.device_copy = DeviceCopy(layout, self.device)
        if not self.device_copy.nbytes and not DeviceCopy.fits(self.device_copy.layout, self.device):
            return None
        return self.device_copy.build(version, state)

    # -- offload ----------------------------------------------------------------------------
    def _require_on_device(self) -> None:
        if not self.on_device:
            raise TrainingError("the trainer is offloaded; call reload() first")

    def _state_tensors(self) -> Iterator[StateTensor]:
        """Every tensor that lives on the device between steps: parameters (tied ones once),
        buffers, the reference model's, AdamW's moments."""
        yield from module_tensors(self.model, "model")
        if self.ref_model is not None:
            yield from module_tensors(self.ref_model, "ref")
        yield from optimizer_tensors(self.optimizer)

    def state_bytes(self) -> int:
        """Bytes the trainer's state takes on the device (what a reload allocates)."""
        return state_bytes(self._state_tensors())

    def reload_bytes(self) -> int:
        """What a reload waits to find free on the device: the state and a margin."""
        return self.state_bytes() + RELOAD_MARGIN_BYTES

    def _move(self, device: torch.device) -> None:
        """Move the state; with CUDA through the pinned host buffers (HostOffload)."""
        if self.device.type != "cuda":
            self.model.to(device)
            if self.ref_model is not None:
                self.ref_model.to(device)
            return
        self._offload.move(self._state_tensors(), device)

    def offload(self) -> DeviceMemory:
        """Model, reference model and AdamW state to (pinned) CPU memory, the freed GPU memory
        given back to the driver; returns the device memory measured afterwards, so the caller
        can confirm the GPU is free before anyone else is given it."""
        if self.device_copy is not None:  # before the memory is measured free
            self.device_copy.free()
        if self.on_device:
            self.optimizer.zero_grad(set_to_none=True)
            self._move(torch.device("cpu"))
            self.on_device = False
        return release_and_measure(self.device)

    def reload(self, timeout_s: float = 60.0, gpu: str | None = None) -> DeviceMemory:
        """Back to `device` after offload(); a no-op when already there. On CUDA it first waits
        (up to `timeout_s`) until the device has room for the whole state, measured: the GPU's
        previous holder must have let go of it. Raises GpuMemoryError naming the GPU otherwise."""
        if self.on_device:
            return measure(self.device)
        report = wait_for_free(self.device, self.reload_bytes(),
                               holder="the trainer", gpu=gpu or str(self.device), timeout_s=timeout_s)
        try:
            self._move(self.device)
        except torch.OutOfMemoryError as exc:
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
            raise GpuMemoryError(f"GPU {gpu or self.device}: the trainer ran out of memory reloading its "
                                 f"state ({self.state_bytes() / 2**30:.2f} GiB): {exc}") from None
        self.on_device = True
        return report

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str], group: GroupSpec | None = None) -> Path:
        """`path/model` (a servable transformers checkpoint, tokenizer copied), optimizer state,
        RNG state and step counter. (`group`: for a sharded trainer's ranks, which save together.)"""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(root / "model")
        self._copy_model_files(root / "model")
        torch.save(self.optimizer.state_dict(), root / "optimizer.pt")
        self._save_trainer_state(root)
        return root

    def _copy_model_files(self, dest: Path) -> None:
        """The checkpoint's tokenizer and other files that are neither weights nor model config."""
        for f in self.model_path.iterdir():
            if f.is_file() and f.name not in _MODEL_FILES and not f.name.endswith(_WEIGHT_SUFFIXES) \
                    and not f.name.endswith(".index.json"):
                shutil.copy2(f, dest / f.name)

    def _save_trainer_state(self, root: Path) -> None:
        """RNG state and step counter (`rng.pt`, `trainer.json`)."""
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, root / "rng.pt")
        (root / "trainer.json").write_text(json.dumps(
            {"step": self.step, "seed": self.seed, "model": str(self.model_path),
             "world_size": self.world_size}, indent=2))

    def _load_rng(self, root: Path) -> None:
        rng = torch.load(root / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def load_checkpoint(self, path: str | os.PathLike[str], group: GroupSpec | None = None) -> None:
        """Resume from save_checkpoint(path): weights in place, optimizer, RNG, step. The
        reference model (if any) stays the one this trainer was built with. (`group`: as for
        save_checkpoint.)"""
        root = Path(path)
        files = sorted((root / "model").glob("*.safetensors"))
        if not files or not (root / "trainer.json").is_file():
            raise TrainingError(f"{root} is not a trainer checkpoint (no model/*.safetensors or trainer.json)")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        canonical = {n for n, _ in self.model.named_parameters()}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [n for n in missing if n in canonical]
        if missing or unexpected:
            raise TrainingError(f"checkpoint {root} does not fit the model: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(torch.load(root / "optimizer.pt", map_location="cpu",
                                                  weights_only=True))
        if not self.on_device:  # load_state_dict put the optimizer state beside the CPU params
            self._move(torch.device("cpu"))
        self._load_rng(root)
        self.step = int(json.loads((root / "trainer.json").read_text())["step"])


def weights_for_sync(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`model`'s weights as shards are synced to: parameters under the checkpoint's names (tied
    ones once, under their first name), persistent buffers, floating ones cast to `dtype`."""
    saved = set(model.state_dict().keys())
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update({n: b.detach() for n, b in model.named_buffers() if n in saved and n not in out})
    if dtype is not None:
        out = {n: t if t.dtype == dtype or not t.is_floating_point() else t.to(dtype) for n, t in out.items()}
    return out
