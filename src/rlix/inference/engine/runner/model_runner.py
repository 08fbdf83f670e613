"""The two forwards the engine needs, prefill and batched decode, over a transformers model.

Qwen2 / Llama / Mistral-style models run through `FusedDecoder` (fused_model.py: the same
maths over the same parameters, with a few kernels per layer instead of ~30). Other models run
through their own transformers modules: rlix then only supplies the KV cache (`SlotKVCache`), the
positions and an explicit mask per layer type (models whose attention layers call
`past_key_values.update(k, v, layer)` and take their mask from a per-layer-type dict). Either way
only full attention is supported, and the LM head runs on just the rows sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rlix.devices import DeviceMemory, measure
from rlix.errors import ConfigError, InvalidRequestError, WeightUpdateError
from rlix.inference.engine.runner import vmm
from rlix.inference.engine.runner.cuda_graphs import (PREFILL_GROUP_TOKENS, DecodeGraphs, DecodeLaunch, PrefillGraphs,
                                                      gather_inputs)
from rlix.inference.engine.runner.fused_model import FusedDecoder, unsupported_reason
from rlix.inference.engine.runner.kv_cache import DEFAULT_INITIAL_CAPACITY, SlotKVCache
from rlix.inference.engine.runner.memory import release_memory
from rlix.inference.engine.runner.profile import StepProfile
from rlix.inference.engine.runner.tp.plan import (ShardPlan, TensorParallel, gather_full, shard_state_dict,
                                                          unsharded_shape)
from rlix.inference.engine.sampling import RowSampling, Sampled, plain_inputs, sample, sample_plain
from rlix.inference.engine.weights import ServedWeights, WeightStaging
from rlix.models.init import is_seeded, load_causal_lm
from rlix.weights.wire import bucket_checksum


def load_model(path: Path, device: torch.device, dtype: torch.dtype | None):  # type: ignore[no-untyped-def]
    """Load a causal LM for inference (sdpa attention) and its tokenizer."""
    try:
        model = load_causal_lm(path, dtype, device, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load model from {path}: {exc}") from exc
    model = model.eval()
    model.requires_grad_(False)
    if device.type == "cpu" and not is_seeded(path):  # drawn weights are the engine's own already
        _own_host_weights(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _own_host_weights(model: torch.nn.Module) -> None:
    """Copy CPU weights out of the checkpoint's file mapping into memory the engine owns.

    transformers may leave CPU parameters as views of the mmapped safetensors file, with the
    loader's scratch buffers still held by the allocator; then neither RSS nor a sleep's freed
    bytes mean anything. Owned copies (and a trim after loading) make them honest.
    """
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            param.data = param.data.clone()
    release_memory(torch.device("cpu"))


@dataclass(frozen=True, eq=False)
class KeptRows:
    """Keys and values copied out of a row: [layers, 2, kv_heads, positions, head_dim] of this
    rank's KV heads. `key` names the copy the other ranks of a group keep of their heads."""

    key: int
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class ModelRunner:
    """Owns the model, its weights and its slot KV cache; cache rows 0..n-1 are the batch.

    On CUDA (unless cuda_graphs=False) decode runs through captured graphs (cuda_graphs.py);
    the KV cache is then allocated at full max_model_len capacity so it never moves.
    `fused` None: FusedDecoder whenever the model is supported; False: transformers' modules.
    `virtual_memory` (with CUDA graphs only; None: wherever the device supports it, vmm.py): the
    KV cache and the reload stores of the weights keep their device addresses across a sleep,
    so the graphs survive it (`graphs_survive_sleep`) instead of being captured again.
    `tp` (size > 1): this runner is one rank of a tensor-parallel group; `model` already holds
    this rank's slices (tp.plan.shard_model), the fused decoder joins the group's
    all-reduces, and the KV cache holds this rank's KV heads. Every rank must then make the same
    calls in the same order: rank 0's runner (tp/runner.py) sends each to the others.

    Everything that changes device state goes through this class's verbs (the forwards, the KV
    cache's rows, sleep, wake, a weight update's staging and commit), never through its parts:
    that is what lets rank 0 mirror them.
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device, num_rows: int,
                 max_model_len: int, kv_initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
                 cuda_graphs: bool = True, fused: bool | None = None,
                 virtual_memory: bool | None = None, tp: TensorParallel | None = None) -> None:
        config = model.config
        self.tp = tp if tp is not None else TensorParallel.single()
        #: this rank's cut of the model (ShardPlan refuses a size that does not divide it)
        self.plan = ShardPlan.of(config, self.tp)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "use_sliding_window", False):
            raise ConfigError(f"{type(model).__name__}: only full-attention layers are supported, "
                              f"got layer types {sorted(layer_types)}")
        self.model = model
        self.device = device
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        if self.decoder is None or self.lm_head is None:
            raise ConfigError(f"{type(model).__name__} has no decoder / output embeddings")
        self.vocab_size = int(config.vocab_size)
        self.dtype = next(model.parameters()).dtype
        use_graphs = cuda_graphs and device.type == "cuda"
        if virtual_memory and not (use_graphs and vmm.available(device)):
            raise ConfigError(f"virtual memory needs CUDA graphs on a CUDA device whose driver "
                              f"supports virtual memory management; not so for {device}")
        #: KV cache and weight stores at fixed device addresses (vmm.py)
        self.virtual = use_graphs and (virtual_memory if virtual_memory is not None
                                       else vmm.available(device))
        self.weights = ServedWeights(model, device, virtual=self.virtual)
        if use_graphs:
            kv_initial_capacity = max_model_len
        self.cache = SlotKVCache(
            num_layers=config.num_hidden_layers, num_rows=num_rows,
            num_kv_heads=self.plan.local_kv_heads, head_dim=self.plan.head_dim,
            max_len=max_model_len, dtype=self.dtype, device=device,
            initial_capacity=kv_initial_capacity, virtual=self.virtual)
        self.mask_min = torch.finfo(self.dtype).min
        why_not = unsupported_reason(model)
        if fused and why_not:
            raise ConfigError(f"{type(model).__name__}: the fused decoder does not support {why_not}")
        if self.tp.size > 1 and (fused is False or why_not):
            raise ConfigError(f"{type(model).__name__}: tensor parallelism runs on the fused decoder "
                              f"only ({why_not or 'fused: false was asked'})")
        self.fused = (FusedDecoder(model, self.weights, self.cache, tp=self.tp)
                      if fused is not False and why_not is None else None)
        self.graphs = DecodeGraphs(self) if use_graphs else None
        self.prefill_graphs = PrefillGraphs(self) if use_graphs and self.fused is not None else None
        #: decode attention reads each row's own keys only (no key-span buckets needed)
        self.reads_live_keys = self.fused is not None and self.fused.kernels
        #: cap on a prefill group's padded tokens (None: the engine's prefill budget decides)
        self.prefill_group_tokens = PREFILL_GROUP_TOKENS if self.prefill_graphs is not None else None
        #: prompts prefilled back to back without padding (fused decoder on CPU): groups need
        #: no padding bound
        self.packs_prefill = self.fused is not None and device.type == "cpu"
        #: a prefill can start mid-prompt over keys already in the row (the prefix cache): the
        #: fused decoder's packed prefill, eager where prefills are otherwise padded graphs; on
        #: one rank (the prefix cache copies rows of this rank's cache only)
        self.reuses_prefixes = self.fused is not None
        self._kept_count = 0  # keys handed to KeptRows (the same on every rank of a group)

    def capture_graphs(self) -> None:
        """Capture the decode and common prefill CUDA graphs now instead of at first use (a
        benchmark's or a server's start). Only while no sequence is running."""
        if self.fused is not None:
            self.fused.refresh()
        if self.graphs is not None:
            self.graphs.capture_all()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all()

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids, position_ids=position_ids,
                           attention_mask={"full_attention": mask},
                           past_key_values=self.cache, use_cache=False)
        return out.last_hidden_state

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], first_row: int,
                every_position: frozenset[int] = frozenset()) -> torch.Tensor:
        """Run prompts (right-padded) into rows first_row..; return last-position logits [R, V].
        With `every_position` (indices into `prompts`), see prefill_all."""
        return self.prefill_all(prompts, first_row, every_position)[0]

    @torch.inference_mode()
    def prefill_all(self, prompts: list[list[int]], first_row: int,
                    every_position: frozenset[int] = frozenset(), offsets: list[int] | None = None
                    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """prefill, plus the logits of every position [L_i, V] of the prompts in
        `every_position` (their prompt logprobs); the LM head runs on those positions only.
        `offsets` (where `reuses_prefixes`): prompt i's first offsets[i] positions are already in
        its row (a prefix-cache hit) and only the rest is run, packed (on a GPU eagerly, not
        through the padded prefill graphs)."""
        if self.packs_prefill or (offsets and any(offsets)):
            if self.fused is None:
                raise ValueError("prefix offsets need the fused decoder's packed prefill")
            offsets = offsets or [0] * len(prompts)
            rest = [p[o:] for p, o in zip(prompts, offsets)]
            return self._prefill_packed(rest, [len(p) for p in rest], first_row, every_position, offsets)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        if self.prefill_graphs is not None and not every_position:
            shape = self.prefill_graphs.shape(len(prompts), width, first_row)
            if shape is not None:
                assert self.fused is not None
                self.fused.refresh()
                return self.prefill_graphs.prefill(prompts, first_row, shape), {}
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(self.device, non_blocking=True)
        # No mask: plain causal attention is exact for every valid (non-padding) query, and the
        # padding's keys land past each row's length, where decode overwrites them before use.
        if self.fused is not None:
            self.fused.refresh()
            hidden = self.fused.prefill(ids, first_row)
            head = self.fused.logits
        else:
            positions = torch.arange(width, device=self.device).expand(len(prompts), width)
            self.cache.set_prefill(first_row, len(prompts))
            hidden = self.hidden(ids, positions, None)
            head = self.lm_head
        last = torch.tensor(lengths, device=self.device) - 1
        rows = torch.arange(len(prompts), device=self.device)
        full = {i: head(hidden[i, : lengths[i]]) for i in sorted(every_position)}
        return head(hidden[rows, last]), full

    def _prefill_packed(self, prompts: list[list[int]], lengths: list[int], first_row: int,
                        every_position: frozenset[int], offsets: list[int]
                        ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        assert self.fused is not None
        self.fused.refresh()
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        hidden = self.fused.prefill_packed(ids, lengths, first_row, offsets)
        ends = torch.tensor(lengths, device=self.device).cumsum(0)
        full = {i: self.fused.logits(hidden[int(ends[i]) - lengths[i]: int(ends[i])]) for i in sorted(every_position)}
        return self.fused.logits(hidden[ends - 1]), full

    def release_graphs(self) -> None:
        """Drop the CUDA graphs and the fused weight buffers (before the storage goes)."""
        if self.graphs is not None:
            self.graphs.release()
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
        if self.fused is not None:
            self.fused.release()

    def graphs_survive_sleep(self) -> bool:
        """Whether a sleep may keep the CUDA graphs: every address they hold comes back where it
        is. The KV cache is virtual, and every parameter is a view of a virtual weight store
        (the fused q/k/v and gate/up matrices too: where fusing had to copy, the parameters are
        views of the copy, so they are not in the store), or a sleep already parked them there."""
        return self.graphs is not None and self.cache.virtual and self.weights.keeps_addresses()

    def release_moved_graphs(self) -> None:
        """Drop only the graphs captured over addresses that have moved since (a reload that
        landed elsewhere): their next use would capture them again, and a sleep that keeps
        graphs would keep their memory pools for nothing."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release_if_moved()

    def decode_logits(self, ids: torch.Tensor, pos: torch.Tensor, kv_len: int,
                      rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one decode step over device tensors, keys read over [0, kv_len):
        what a decode CUDA graph captures."""
        if self.fused is not None:
            self.fused.refresh()
            return self.fused.decode(ids, pos, kv_len, rows)
        keep = torch.arange(kv_len, device=self.device)[None, :] <= pos[:, None]
        mask = torch.zeros(keep.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~keep, self.mask_min)[:, None, None, :]
        self.cache.set_decode(pos, kv_len, row_index=rows)
        hidden = self.hidden(ids[:, None], pos[:, None], mask)
        return self.lm_head(hidden[:, 0])

    @torch.inference_mode()
    def decode_sample(self, tokens: list[int], positions: list[int], rows: list[RowSampling],
                      profile: StepProfile | None = None) -> Sampled:
        """One decode step for rows 0..n-1 and its picks. Rows that only use temperature are
        sampled inside the CUDA graph; a batch with any other row samples the logits here."""
        if self.graphs is not None and all(r.plain for r in rows):
            uniforms, temperatures = plain_inputs(rows)
            launched = self.launch_plain(tokens, positions, uniforms, temperatures, None)
            if profile is not None:
                profile.mark("decode")
            return launched.result()
        return sample(self.decode(tokens, positions), rows)

    def launch_decode(self, tokens: list[int], positions: list[int], rows: list[RowSampling],
                      after: DecodeLaunch | None = None) -> DecodeLaunch:
        """Start one decode step of plain rows (temperature or greedy only) without waiting for
        it. With `after` (a step not read yet), a negative tokens[i] = -(r + 1) is the token
        `after` sampled for its row r, taken on the device. Without CUDA graphs the step runs
        now (same picks; the engine's overlap logic then runs, gaining nothing)."""
        uniforms, temperatures = plain_inputs(rows)  # the rows' random draws, taken here once
        return self.launch_plain(tokens, positions, uniforms, temperatures, after)

    @torch.inference_mode()
    def launch_plain(self, tokens: list[int], positions: list[int], uniforms: list[float],
                     temperatures: list[float], after: DecodeLaunch | None) -> DecodeLaunch:
        """launch_decode with the rows' draws taken: what every rank of a group runs alike."""
        if self.graphs is not None:
            return self.graphs.launch(tokens, positions, uniforms, temperatures, after)
        ids = torch.tensor(tokens, dtype=torch.float64)
        if after is not None:
            ids = gather_inputs(ids.to(after.picks.device), after.picks[0])
        ids = ids.long()
        ids, pos = ids.to(self.device), torch.tensor(positions, dtype=torch.long).to(self.device)
        logits = self.decode_logits(ids, pos, max(positions) + 1, torch.arange(len(tokens), device=self.device))
        picked, logprobs = sample_plain(logits, torch.tensor(uniforms, device=self.device),
                                        torch.tensor(temperatures, device=self.device))
        picks = torch.stack((picked.double(), logprobs.double())).cpu()
        return DecodeLaunch(picks, picks)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of rows 0..n-1 at its own position; return logits [n, V]."""
        if self.graphs is not None:
            return self.graphs.decode(tokens, positions)[0]
        both = torch.tensor([tokens, positions], dtype=torch.long).to(self.device)
        ids, pos = both[0], both[1]
        return self.decode_logits(ids, pos, max(positions) + 1,
                                  torch.arange(len(tokens), device=self.device))

    # -- the KV cache's rows -------------------------------------------------------------
    def allocate_cache(self) -> None:
        self.cache.allocate()

    def ensure_capacity(self, length: int, live_rows: int, live_len: int) -> None:
        self.cache.ensure_capacity(length, live_rows=live_rows, live_len=live_len)

    def copy_rows(self, src: int, dsts: list[int], length: int) -> None:
        self.cache.copy_rows(src, dsts, length)

    def move_rows(self, srcs: list[int], dsts: list[int], length: int) -> None:
        self.cache.move_rows(srcs, dsts, length)

    # -- rows kept for later prompts (the prefix cache) -----------------------------------
    def keep_rows(self, row: int, length: int, key: int | None = None) -> KeptRows:
        """A copy of row `row`'s first `length` positions of keys and values."""
        assert self.cache.kv is not None
        if key is None:
            self._kept_count += 1
            key = self._kept_count
        return KeptRows(key, self.cache.kv[:, :, row, :, :length].clone())

    def load_rows(self, kept: KeptRows, row: int, length: int) -> None:
        """Kept keys and values (their first `length` positions) into row `row`."""
        assert self.cache.kv is not None
        self.cache.kv[:, :, row, :, :length].copy_(kept.kv[..., :length, :])

    def forget_rows(self, kept: KeptRows) -> None:
        """`kept` is no longer needed (its copy goes with the last reference to it)."""

    # -- sleep and wake ------------------------------------------------------------------
    def free_for_sleep(self, level: int) -> bool:
        """Drop the graphs (unless they survive the sleep), free the KV cache, offload (1) or
        drop (2) the weights; whether the graphs were kept."""
        keep = self.graphs_survive_sleep()
        if keep:
            self.release_moved_graphs()
        else:
            self.release_graphs()
        self.cache.free()
        if level == 2:
            self.weights.discard()
        elif self.weights.on_device:
            self.weights.offload()
        return keep

    def release_memory(self, keep_workspaces: bool) -> None:
        """Hand what was freed back to the device (or the host's allocator)."""
        release_memory(self.device, keep_workspaces=keep_workspaces)

    def wake(self, weights: bool, kv_cache: bool) -> None:
        if weights:
            self.weights.wake()
        if kv_cache:
            self.cache.allocate()

    # -- weight updates ------------------------------------------------------------------
    def open_update(self, version: int, allow_partial: bool) -> WeightStaging:
        return WeightStaging(self.weights, version, allow_partial)

    def stage(self, staging: WeightStaging, named: dict[str, torch.Tensor]) -> None:
        """Validate and stage full tensors (checkpoint names); this rank keeps its slices."""
        try:
            mine = shard_state_dict(self.plan, named)
        except ValueError as exc:  # not the whole tensor: nothing to cut this rank's slice from
            raise WeightUpdateError(str(exc)) from None
        staging.add(mine)

    def abandon_update(self, staging: WeightStaging) -> None:
        staging.abandon()

    def commit_update(self, staging: WeightStaging) -> None:
        """Serve the staged tensors (raises WeightUpdateError when an update that must be
        complete is not, leaving the old weights served)."""
        complete = staging.check_complete()
        self.weights.swap_in(staging.staged, complete)

    def full_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Canonical parameter name -> (shape, dtype) of the whole model (what a sender sends;
        a rank's own slices are smaller)."""
        return {n: (unsharded_shape(self.plan, n, s.shape), s.dtype) for n, s in self.weights.specs.items()}

    @torch.inference_mode()
    def weight_checksums(self) -> dict[str, int]:
        """Per-tensor checksums of the whole model's served weights by canonical name (the
        weight audit): a split tensor is gathered from every rank, one tensor at a time, and
        summed on rank 0 (the other ranks return nothing)."""
        out: dict[str, int] = {}
        for name, param in self.weights.params.items():
            if param.numel() == 0:
                raise InvalidRequestError("weights are not loaded (asleep at level 2)")
            full = gather_full(self.tp, name, param.data)
            if self.tp.rank == 0:
                out[name] = bucket_checksum(full.contiguous().reshape(-1).view(torch.uint8))
        return out

    def measure_memory(self) -> DeviceMemory:
        """This runner's device memory, measured (the hand-off check of a sleep)."""
        return measure(self.device)

    def failure(self) -> str | None:
        """Why this runner cannot go on (a tensor-parallel rank gone), None while it can."""
        return None

    def close(self) -> None:
        """Nothing to end on one rank (rank 0 of a group ends the others)."""
