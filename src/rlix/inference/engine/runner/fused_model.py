"""The decoder's forward written directly over the model's parameters, with few kernels a layer.

Why: on a GPU a decode step of a small model is bound by kernel launches and memory traffic, not
by FLOPs, and transformers' Qwen2 layer launches ~30 kernels (RMSNorm as six, rotary as ten, the
KV heads repeated 7x before attention). Here a layer is: RMSNorm, one QKV matmul, rotary on q
and k together, the new K/V written into the slot cache, attention, o_proj with the residual add
fused into the matmul, RMSNorm, one gate-up matmul, SiLU x up, down_proj with the residual fused.
Decode attention reads each KV head's span [0, kv_len) once for the query heads of its group
(rows' own lengths are masked): on CPU through SDPA over the cache in place, elsewhere as two
batched matmuls (what a CUDA graph captures without the Triton kernels); prefill attention is
SDPA, causal, over the right-padded prompts.

The q/k/v and gate/up weights are fused into one buffer each and the model's parameters become
views of it, so in-place weight updates land in the fused buffer; whenever the parameter storage
moves (wake, reload) the fusion is redone (`refresh`). On CPU in bf16 a decode step's few rows
go through rlix's own row kernels (`cpu_kernels`: they stream the weights near the memory's read
rate, which neither library path does at few rows). Larger matmuls, where the CPU has oneDNN's
bf16 path (AVX-512 or AMX), run on copies of the weights reordered once into oneDNN's blocked
layout (what vLLM's CPU backend and inductor's frozen linears do): plain bf16 `torch.mm`
re-blocks the weights on every call (several times slower a matmul on such a CPU).
There the gate and up projections are two matmuls, SiLU in the first's epilogue and the product
in the second's (oneDNN post-ops): 5-14% less time for the MLP's first half than one matmul and
two passes over its output (measured at 1-32 rows on the 0.5B shape). The copies are remade after every
weight update (`ServedWeights.values_version`) and cost a second copy of those weights in host
memory. Supported: Qwen2 / Llama / Mistral-style
layers (q/k/v/o and gate/up/down projections, RMSNorm, SiLU, rotary without dynamic rescaling);
`unsupported_reason` says why another model falls back to transformers' modules.

Tensor parallelism (`tp`, tp/plan.py): each of `tp.size` ranks holds its slice of the
q/k/v, gate/up (column-parallel) and o/down (row-parallel) weights (`shard_model`) and a KV
cache of its own KV heads; attention runs on the rank's heads, and the o_proj and down_proj
outputs are partial sums, all-reduced before the residual stream goes on. The residual is added
on rank 0 only, inside its matmul (the fused add of the single-rank path), before the
all-reduce: the sum then carries it exactly once, and no rank spends a separate pass on it.
Embeddings, norms and the LM head are replicated, so every rank computes the same full logits.
At size 1 nothing of this runs (the projections are the plain matmuls). The Triton decode
kernels fuse the residual add into the next norm: there the partial sums are all-reduced before
it (every rank then adds the same sum to the same residual stream); the CUDA graphs capture the
all-reduces (NCCL) with the rest. In
bf16 / fp16 on CUDA the partial sums are float32 through the all-reduce (`wide_partials`): each
rank rounding its half before the sum gave prompt logprobs 0.05 apart from one rank's at the
7.6B shape (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlix.errors import ConfigError
from rlix.inference.engine.runner import cpu_kernels, triton_ops
from rlix.inference.engine.runner.kv_cache import SlotKVCache
from rlix.inference.engine.runner.tp.plan import ShardPlan, TensorParallel
from rlix.inference.engine.weights import ServedWeights

_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when FusedDecoder can run `model`, else why not."""
    config = model.config
    decoder = model.get_decoder()
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") in _DYNAMIC_ROPE:
        return f"rope type {rotary.rope_type!r}"
    for attr in ("embed_tokens", "layers", "norm"):
        if not hasattr(decoder, attr):
            return f"decoder has no {attr}"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "layer without self_attn / mlp"
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention without q/k/v/o projections"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "q/k norms"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP without gate/up/down projections"
        if any(getattr(m, "bias", None) is not None
               for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "biases on o/gate/up/down projections"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if _eps(norm) is None or getattr(norm, "bias", None) is not None:
                return "a norm that is not RMSNorm"
    if _eps(decoder.norm) is None:
        return "a final norm that is not RMSNorm"
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return "an LM head with a bias"
    return None


def _eps(norm: torch.nn.Module) -> float | None:
    value = getattr(norm, "variance_epsilon", None)
    if value is None:
        value = getattr(norm, "eps", None)
    return float(value) if value is not None else None


def _fuse(modules: list[torch.nn.Module], attr: str) -> torch.Tensor | None:
    """The modules' `attr` (weight or bias) as one tensor, each parameter a view of its slice:
    a view of the memory they already share when they lie end to end in it (a reload into
    the sender's bucket layout), else a concatenated copy; None when they have no such parameter."""
    params = [getattr(m, attr) for m in modules]
    if any(p is None for p in params):
        return None
    fused = _end_to_end([p.data for p in params])
    if fused is None:
        fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = fused[start: start + p.shape[0]]
        start += p.shape[0]
    return fused


def _end_to_end(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over `parts` when they are contiguous, of one dtype and row shape, and each
    starts in the same storage where the previous one ends; else None."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for part in parts:
        if (not part.is_contiguous() or part.dtype != first.dtype or part.shape[1:] != first.shape[1:]
                or part.untyped_storage().data_ptr() != storage or part.data_ptr() != end):
            return None
        end += part.numel() * part.element_size()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


class _Step(NamedTuple):
    """What every layer of one decode step shares."""

    pos: torch.Tensor
    rows: torch.Tensor
    kv_len: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor  # additive: [B, 1, 1, kv_len] (sdpa_decode), else [B * kv_heads, 1, kv_len]


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matmuls run on oneDNN-reordered weight copies here (CPU, bf16; module docstring).
    oneDNN reorders bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an
    AVX2-only CPU the reorder raises, so the plain matmuls stay."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


#: on a CPU with oneDNN's bf16 path (AVX-512, AMX) the row kernels beat it up to this many rows
#: (measured on a Xeon with AMX, 2 threads: 0.57x of torch's time at 1 row, 0.96x at 4, 1.6x at 8)
KERNEL_ROWS_BESIDE_ONEDNN = 4


def _row_kernels(device: torch.device, dtype: torch.dtype,
                 onednn: bool) -> tuple[cpu_kernels.Bf16RowKernels | None, int | None]:
    """The row kernels and up to how many rows they run (None: every matmul), where they apply
    (CPU, bf16). On an AVX2-only CPU (no oneDNN bf16 path) torch's bf16 matmul is several times
    slower at every row count, prefill's included, so the kernels take all of them."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None, 0
    kernels = cpu_kernels.load()
    if kernels is None:
        return None, 0
    return kernels, KERNEL_ROWS_BESIDE_ONEDNN if onednn else None


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def _mm(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), on the reordered copy when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.addmm(bias, x, weight.t()) if bias is not None else torch.mm(x, weight.t())


def _mm_add(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
            packed: torch.Tensor | None) -> torch.Tensor:
    """residual + x @ weight.T, the add fused into the matmul."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    return torch.addmm(residual, x, weight.t())


def _mm_widens(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch multiplies `dtype` matrices into float32 on `device` (mm's out_dtype:
    cuBLAS, torch >= 2.8)."""
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class _Layer:
    """One layer's tensors, fused where the matmuls can share a launch."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_w = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "weight")
        self.qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
        self.o_w = attn.o_proj.weight
        self.gate_up_w = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.down_w = mlp.down_proj.weight
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps1, self.eps2 = _eps(layer.input_layernorm), _eps(layer.post_attention_layernorm)
        # reordered copies (packing); gate and up apart, so that SiLU and the product with up
        # run in their matmuls' epilogues instead of as two passes over [tokens, intermediate]
        self.qkv_p = self.o_p = self.gate_p = self.up_p = self.down_p = None

    def pack(self) -> None:
        half = self.gate_up_w.shape[0] // 2
        self.qkv_p, self.o_p = _pack(self.qkv_w), _pack(self.o_w)
        self.gate_p, self.up_p = _pack(self.gate_up_w[:half]), _pack(self.gate_up_w[half:])
        self.down_p = _pack(self.down_w)


def _fused_modules(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj


class FusedDecoder:
    """Prefill and decode forwards of one model over a SlotKVCache (see module docstring).

    With `tp` of size > 1 the model must already hold this rank's slices (`shard_model`) and
    the cache this rank's KV heads; the forwards then join the group's all-reduces, so every
    rank of the group must run the same forwards in the same order."""

    def __init__(self, model: torch.nn.Module, weights: ServedWeights, cache: SlotKVCache,
                 kernels: bool | None = None, tp: TensorParallel | None = None) -> None:
        config = model.config
        self.tp = tp if tp is not None else TensorParallel.single()
        #: decode through triton_ops (CUDA with Triton by default); else torch ops
        self.kernels = triton_ops.available(weights.device) if kernels is None else kernels
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.weights = weights
        self.cache = cache
        #: the model's counts and this rank's cut of them (refuses a tp size that does not
        #: divide the heads or the MLP)
        self.plan = ShardPlan.of(config, self.tp)
        self.head_dim = self.plan.head_dim
        #: this rank's heads and intermediate units (the model's own at size 1)
        self.num_heads = self.plan.local_heads
        self.num_kv_heads = self.plan.local_kv_heads
        self.group = self.num_heads // self.num_kv_heads
        self.intermediate = self.plan.local_intermediate
        if self.tp.size > 1:
            self._check_sharded(cache)
        #: o_proj / down_proj with the residual added: the plain matmul, or its partial sums
        #: all-reduced over the tp group
        self._project = self._matmul if self.tp.size == 1 else self._reduced_matmul
        #: tp > 1 on CUDA in bf16 / fp16: partial sums reduced in float32 (cuBLAS's float32
        #: output of half-precision inputs), so a split model rounds where one rank does
        self.wide_partials = (self.tp.size > 1 and weights.device.type == "cuda"
                              and self.head.weight.dtype in (torch.bfloat16, torch.float16)
                              and _mm_widens(weights.device, self.head.weight.dtype))
        attn = self.decoder.layers[0].self_attn
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.layers: list[_Layer] = []
        self._version: int | None = None
        #: decode attention through SDPA over the cache's span in place (CPU: 2-4x faster than
        #: batched matmuls over a copy of it, measured); CUDA graphs keep the batched matmuls
        self.sdpa_decode = weights.device.type == "cpu"
        #: matmuls on oneDNN-reordered copies (CPU, bf16), remade when the values change
        self.packed = packs_weights(weights.device, self.head.weight.dtype)
        self._head_p: torch.Tensor | None = None
        self._packed_values: int | None = None
        #: rlix's bf16 row kernels (CPU, bf16), for matmuls of up to kernel_rows rows (None: all)
        self.row_kernels, self.kernel_rows = _row_kernels(weights.device, self.head.weight.dtype,
                                                          self.packed)
        self._cos = self._sin = None
        self._span: torch.Tensor | None = None

    def _check_sharded(self, cache: SlotKVCache) -> None:
        q_rows = self.decoder.layers[0].self_attn.q_proj.weight.shape[0]
        if q_rows != self.num_heads * self.head_dim:
            raise ConfigError(f"tensor parallel rank {self.tp.rank} of {self.tp.size}: q_proj has "
                              f"{q_rows} rows, this rank's slice has {self.num_heads * self.head_dim} "
                              f"(shard the model first: tp.plan.shard_model)")
        if cache.num_kv_heads != self.num_kv_heads:
            raise ConfigError(f"tensor parallel rank {self.tp.rank} of {self.tp.size}: the KV cache "
                              f"holds {cache.num_kv_heads} KV heads, this rank serves {self.num_kv_heads}")

    def release(self) -> None:
        """Drop every reference to the fused buffers (before a sleep lets the parameters go)."""
        self.layers = []
        self._version = None
        self._head_p, self._packed_values = None, None

    def refresh(self) -> None:
        """(Re)fuse after the parameter storage moved; build the rotary tables once; remake the
        reordered copies after the values changed."""
        if self._version == self.weights.storage_version and self.layers:
            if self.packed and self._packed_values != self.weights.values_version:
                self._repack()
            return
        self.layers = []
        for layer in self.decoder.layers:  # layer by layer: the old tensors go as we go
            self.layers.append(_Layer(layer))
        fused = {id(p) for layer in self.decoder.layers for m in _fused_modules(layer)
                 for p in (m.weight, getattr(m, "bias", None)) if p is not None}
        store = self.weights.store
        for param in self.weights.params.values():
            # After a reload the other parameters are views of the staging buffers, which would
            # otherwise stay allocated for the q/k/v and gate/up slices that were fused away. A
            # store (the sender's layout) is the parameters' own storage: nothing to copy out.
            data = param.data
            if (id(param) not in fused and data.untyped_storage().nbytes() > data.nbytes
                    and not (store is not None and store.holds(data))):
                param.data = data.clone()
        self._version = self.weights.storage_version
        if self._cos is None or self._cos.device != self.weights.device:
            self._tables()
        if self.packed:
            self._repack()

    def _repack(self) -> None:
        for layer in self.layers:
            layer.pack()
        self._head_p = _pack(self.head.weight)
        self._packed_values = self.weights.values_version

    def _tables(self) -> None:
        """cos and sign-folded sin per position, computed as transformers computes them."""
        rotary = self.decoder.rotary_emb
        device, dtype = self.weights.device, self.head.weight.dtype
        positions = torch.arange(self.cache.max_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        half = self.head_dim // 2
        sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
        self._cos = (emb.cos() * scaling).to(dtype)
        self._sin = ((emb.sin() * scaling).to(dtype) * sign.to(dtype))
        self._span = torch.arange(self.cache.max_len, device=device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, with rotate_half as a roll and sin's sign folded in."""
        return torch.addcmul(x * cos, x.roll(self.head_dim // 2, dims=-1), sin)

    def _row_kernel(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self.row_kernels is not None
                and (self.kernel_rows is None or x.shape[0] <= self.kernel_rows)
                and self.row_kernels.fits(x, weight))

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) x @ weight.T (+ bias): rlix's row kernels for few rows where they are the
        faster path, else the reordered copy, else torch's matmul."""
        if self._row_kernel(x, weight):
            return self.row_kernels.linear(x, weight, bias, residual)
        if residual is not None:
            assert bias is None
            return _mm_add(residual, x, weight, packed)
        return _mm(x, weight, packed, bias)

    def _reduced_matmul(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                        residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T over the tp group: x and weight are this rank's heads' (or
        intermediate units') columns, their product a partial sum; rank 0 alone adds the
        residual (in its matmul), then one all-reduce sums the parts on every rank. With
        `wide_partials` the parts stay in float32 through the sum and are rounded once, as one
        rank's matmul rounds its float32 accumulation once."""
        if self.wide_partials:
            part = torch.mm(x, weight.t(), out_dtype=torch.float32)
            if self.tp.rank == 0:
                part += residual
            return self.tp.all_reduce(part).to(x.dtype)
        part = self._matmul(x, weight, packed, residual=residual if self.tp.rank == 0 else None)
        return self.tp.all_reduce(part)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), layer.ln2, layer.eps2)
        if self._row_kernel(h, layer.gate_up_w):
            act = self.row_kernels.silu_gate_up(h, layer.gate_up_w)
        elif layer.gate_p is not None:  # silu(h @ gate.T) * (h @ up.T), fused into the two matmuls
            gate = torch.ops.mkldnn._linear_pointwise(h, layer.gate_p, None, "swish", [], "")
            act = torch.ops.mkldnn._linear_pointwise.binary(h, gate, layer.up_p, None, "mul")
        else:
            gate_up = _mm(h, layer.gate_up_w, None)
            act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:]
        return self._project(act, layer.down_w, layer.down_p, residual=x)

    def _qkv(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), layer.ln1, layer.eps1)
        return self._matmul(h, layer.qkv_w, layer.qkv_p, layer.qkv_b)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.decoder.norm
        return F.rms_norm(x, (x.shape[-1],), norm.weight, _eps(norm))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over already-normalised hidden states."""
        return self._matmul(hidden, self.head.weight, self._head_p)

    def decode_context(self, ids: torch.Tensor, pos: torch.Tensor, kv_len: int,
                       rows: torch.Tensor) -> tuple[torch.Tensor, _Step]:
        """The embedded tokens and what every layer of this decode step shares."""
        assert self._cos is not None and self._sin is not None and self._span is not None
        batch, kv_heads = ids.shape[0], self.num_kv_heads
        x = F.embedding(ids, self.decoder.embed_tokens.weight)
        keep = self._span[None, :kv_len] <= pos[:, None]
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill_(
            ~keep, torch.finfo(x.dtype).min)[:, None, None, :]
        if not self.sdpa_decode:
            mask = mask.expand(batch, kv_heads, 1, kv_len).reshape(batch * kv_heads, 1, kv_len)
        return x, _Step(pos, rows, kv_len, self._cos[pos][:, None, :], self._sin[pos][:, None, :],
                        mask)

    def decode_attention(self, i: int, x: torch.Tensor, step: _Step) -> torch.Tensor:
        """Layer i's attention half of a decode step (norm .. o_proj + residual)."""
        layer = self.layers[i]
        batch, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads, kv_len = heads + kv_heads, step.kv_len
        qkv = self._qkv(layer, x)
        qk = self._rotate(qkv[:, : qk_heads * dim].view(batch, qk_heads, dim), step.cos, step.sin)
        keys, values = self.cache.keys[i], self.cache.values[i]
        keys[step.rows, :, step.pos] = qk[:, heads:]
        values[step.rows, :, step.pos] = qkv[:, qk_heads * dim:].view(batch, kv_heads, dim)
        if self.sdpa_decode:  # the cache's span read in place; a KV head's queries as its group
            q = qk[:, :heads].view(batch, kv_heads, self.group, dim)
            attn = F.scaled_dot_product_attention(q, keys[:batch, :, :kv_len], values[:batch, :, :kv_len],
                                                  attn_mask=step.mask, scale=self.scale)
            return self._project(attn.reshape(batch, heads * dim), layer.o_w, layer.o_p, residual=x)
        q = qk[:, :heads].reshape(batch * kv_heads, self.group, dim)
        k = keys[:batch, :, :kv_len].reshape(batch * kv_heads, kv_len, dim)
        v = values[:batch, :, :kv_len].reshape(batch * kv_heads, kv_len, dim)
        probs = torch.softmax(torch.baddbmm(step.mask, q, k.transpose(1, 2), alpha=self.scale), -1)
        attn = torch.bmm(probs, v).view(batch, heads * dim)
        return self._project(attn, layer.o_w, layer.o_p, residual=x)

    def decode_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP half (norm .. down_proj + residual)."""
        return self._mlp(self.layers[i], x)

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, kv_len: int,
               rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] for token ids[i] at position pos[i] of cache row rows[i] (= i); keys
        are read over [0, kv_len) of each row, positions past a row's own masked (with the
        Triton kernels: over each row's own 0..pos[i] whatever kv_len). Safe to capture in a
        CUDA graph (no host syncs, shapes fixed by B and kv_len)."""
        if self.kernels:
            x, h = self.kernel_start(ids)
            for i in range(len(self.layers)):
                h = self.kernel_mlp(i, x, self.kernel_attention(i, x, h, pos))
            return self.logits(h)
        x, step = self.decode_context(ids, pos, kv_len, rows)
        for i in range(len(self.layers)):
            x = self.decode_mlp(i, self.decode_attention(i, x, step))
        return self.logits(self.final(x))

    # -- the decode step through triton_ops: x is the residual stream (updated in place), h the
    # -- normalised input of the next half
    def kernel_start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.embedding(ids, self.decoder.embed_tokens.weight)
        first = self.layers[0]
        return x, triton_ops.add_rms_norm(x, None, first.ln1, first.eps1)

    def kernel_attention(self, i: int, x: torch.Tensor, h: torch.Tensor,
                         pos: torch.Tensor) -> torch.Tensor:
        """Layer i's attention half; returns the MLP's normalised input."""
        layer = self.layers[i]
        keys, values = self.cache.keys[i], self.cache.values[i]
        qkv = (torch.addmm(layer.qkv_b, h, layer.qkv_w.t()) if layer.qkv_b is not None
               else torch.mm(h, layer.qkv_w.t()))
        q = triton_ops.rope_kv_write(qkv, pos, self._cos, self._sin, keys, values,
                                     self.num_heads, self.num_kv_heads, self.head_dim)
        attn = triton_ops.decode_attention(q, keys, values, pos, self.scale)
        return triton_ops.add_rms_norm(x, self._kernel_projection(attn, layer.o_w), layer.ln2, layer.eps2)

    def kernel_mlp(self, i: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP half; returns the next layer's (or the final) normalised input."""
        layer = self.layers[i]
        down = self._kernel_projection(triton_ops.silu_mul(torch.mm(h, layer.gate_up_w.t())), layer.down_w)
        if i + 1 < len(self.layers):
            nxt = self.layers[i + 1]
            return triton_ops.add_rms_norm(x, down, nxt.ln1, nxt.eps1)
        norm = self.decoder.norm
        return triton_ops.add_rms_norm(x, down, norm.weight, _eps(norm))

    def _kernel_projection(self, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """a @ weight.T for the kernels' residual add (add_rms_norm adds it in float32): split
        over a group, this rank's partial sum all-reduced (in float32 with `wide_partials`)
        before the add, which every rank then makes alike on the same residual stream."""
        if self.tp.size == 1:
            return torch.mm(a, weight.t())
        if self.wide_partials:
            return self.tp.all_reduce(torch.mm(a, weight.t(), out_dtype=torch.float32))
        return self.tp.all_reduce(torch.mm(a, weight.t()))

    def prefill_packed(self, ids: torch.Tensor, lengths: list[int], first_row: int,
                       offsets: list[int] | None = None) -> torch.Tensor:
        """Prompts concatenated without padding (ids [T], T = sum(lengths)) into cache rows
        first_row, first_row + 1, ...: every matmul runs once over all T tokens (one pass over
        the weights, no padding computed), attention per prompt. Returns the final normalised
        hidden states [T, H]. The prefill for CPU, where padding is compute and a pass over the
        weights is a memory-bound floor; a GPU prefers fixed shapes (graphs).
        `offsets[j]`: prompt j's first offsets[j] positions are already in its cache row (a
        prefix-cache hit); its `lengths[j]` tokens are the rest, at positions from there on."""
        assert self._cos is not None and self._sin is not None
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads, total = heads + kv_heads, ids.shape[0]
        offsets = offsets or [0] * len(lengths)
        positions = torch.cat([torch.arange(o, o + n, device=ids.device) for o, n in zip(offsets, lengths)])
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        x = F.embedding(ids, self.decoder.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            qkv = self._qkv(layer, x).view(total, qk_heads + kv_heads, dim)
            qk = self._rotate(qkv[:, :qk_heads], cos, sin)
            q, k, v = qk[:, :heads].transpose(0, 1), qk[:, heads:].transpose(0, 1), qkv[:, qk_heads:].transpose(0, 1)
            keys, values = self.cache.keys[i], self.cache.values[i]
            parts = []
            for j, (start, n, o) in enumerate(zip(starts, lengths, offsets)):
                seg, row = slice(start, start + n), first_row + j
                keys[row, :, o: o + n] = k[:, seg]
                values[row, :, o: o + n] = v[:, seg]
                if o:  # the new queries see the cached prefix and, causally, each other
                    out = F.scaled_dot_product_attention(
                        q[None, :, seg], keys[row: row + 1, :, : o + n], values[row: row + 1, :, : o + n],
                        attn_mask=self._offset_causal(o, n, ids.device), scale=self.scale,
                        enable_gqa=self.group > 1)
                else:
                    out = F.scaled_dot_product_attention(q[None, :, seg], k[None, :, seg], v[None, :, seg],
                                                         is_causal=True, scale=self.scale,
                                                         enable_gqa=self.group > 1)
                parts.append(out[0].transpose(0, 1).reshape(n, heads * dim))
            x = self._mlp(layer, self._project(torch.cat(parts), layer.o_w, layer.o_p, residual=x))
        return self.final(x)

    @staticmethod
    def _offset_causal(offset: int, n: int, device: torch.device) -> torch.Tensor:
        """[n, offset + n] bool: query i (at position offset + i) sees keys 0 .. offset + i."""
        return torch.arange(offset + n, device=device)[None, :] <= (offset + torch.arange(n, device=device))[:, None]

    def prefill(self, ids: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ids [P, W] into cache rows `rows` (the first of P
        consecutive rows, or a device tensor [P] of rows: what a CUDA graph captures); return
        the final normalised hidden states [P, W, H] (padding positions hold garbage)."""
        assert self._cos is not None and self._sin is not None
        rows_index, (rows, width) = rows, ids.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_heads = heads + kv_heads
        x = F.embedding(ids, self.decoder.embed_tokens.weight).view(rows * width, -1)
        cos, sin = self._cos[:width][None, :, None, :], self._sin[:width][None, :, None, :]
        span = rows_index if isinstance(rows_index, torch.Tensor) else slice(
            rows_index, rows_index + rows)
        for i, layer in enumerate(self.layers):
            qkv = self._qkv(layer, x).view(rows, width, qk_heads + kv_heads, dim)
            qk = self._rotate(qkv[:, :, :qk_heads], cos, sin)
            q = qk[:, :, :heads].transpose(1, 2)
            k = qk[:, :, heads:].transpose(1, 2)
            v = qkv[:, :, qk_heads:].transpose(1, 2)
            self.cache.keys[i][span, :, :width] = k
            self.cache.values[i][span, :, :width] = v
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 enable_gqa=self.group > 1)
            attn = out.transpose(1, 2).reshape(rows * width, heads * dim)
            x = self._mlp(layer, self._project(attn, layer.o_w, layer.o_p, residual=x))
        return self.final(x).view(rows, width, -1)
