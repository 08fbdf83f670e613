"""Triton kernels for the fused decode step on CUDA: one launch where torch needs several.

A decode step through torch ops at few rows spends its time in ~25 small kernels per layer, not
in reading the layer's weights (docs/BENCHMARKS.md has the profile). These kernels cut a layer to nine
launches: residual add + RMSNorm in one kernel, rotary on q and k with the new key and value
written straight into the slot cache, decode attention that reads only each row's live keys
(grid: rows x KV heads; the KV head's query group shares each key block; online softmax), and
SiLU x up. Numerics: fp32 inside each kernel, one rounding to the model's dtype at each output
(transformers rounds after every op), so tokens may differ from transformers' in near-ties.

`available(device)` is False without Triton or off CUDA; the fused decoder then uses torch ops.
(Triton's own interpreter, TRITON_INTERPRET=1, runs them on CPU tensors for checking.)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    """True where these kernels can run on `device` (CUDA with Triton)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, y_ptr, w_ptr, out_ptr, n_cols, eps,
                             BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_Y:
            y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, out, mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, qkv_stride, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                        row_stride, head_stride, pos_stride,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        pos = tl.load(pos_ptr + b)
        base = qkv_ptr + b * qkv_stride + h * D
        x = tl.load(base + d).to(tl.float32)
        rolled = tl.load(base + (d + D // 2) % D).to(tl.float32)
        c = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        y = x * c + rolled * s
        if h < HQ:
            tl.store(q_ptr + (b * HQ + h) * D + d, y.to(q_ptr.dtype.element_ty))
        else:
            kh = h - HQ
            offset = b * row_stride + kh * head_stride + pos * pos_stride + d
            tl.store(k_ptr + offset, y.to(k_ptr.dtype.element_ty))
            v = tl.load(qkv_ptr + b * qkv_stride + (HQ + HKV + kh) * D + d)
            tl.store(v_ptr + offset, v)

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale,
                                 row_stride, head_stride, pos_stride,
                                 HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                 D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = b * HQ + kh * G + g
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        length = tl.load(pos_ptr + b) + 1
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        k_base = k_ptr + b * row_stride + kh * head_stride
        v_base = v_ptr + b * row_stride + kh * head_stride
        for start in range(0, length, BLOCK):
            n = start + tl.arange(0, BLOCK)
            live = n < length
            k = tl.load(k_base + n[:, None] * pos_stride + d[None, :], mask=live[:, None], other=0.0)
            if IEEE:  # fp32 models: no TF32 rounding
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * pos_stride + d[None, :], mask=live[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + heads[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x + y) * weight, x [B, N] contiguous; with y, x becomes x + y in place (the
    residual stream)."""
    rows, cols = x.shape
    out = torch.empty_like(x) if out is None else out
    _add_rms_norm_kernel[(rows,)](x, y if y is not None else x, weight, out, cols, eps,
                                  BLOCK=_pow2(cols), HAS_Y=y is not None)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [B, 2I] gate-up output: [B, I]."""
    rows, width = gate_up.shape
    cols = width // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block)
    return out


def rope_kv_write(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, heads: int, kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """Rotary on the q and k heads of qkv [B, (H + 2 Hkv) * D] at positions pos [B]; the
    rotated keys and the values go into cache row b (keys/values [rows, Hkv, cap, D]) at
    pos[b]; returns the rotated queries [B, H, D]. cos / sin: [max_len, D] tables (sin's
    first half negated: rotate_half as a roll)."""
    batch = qkv.shape[0]
    q = torch.empty(batch, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(batch, heads + kv_heads)](
        qkv, qkv.stride(0), pos, cos, sin, q, keys, values,
        keys.stride(0), keys.stride(1), keys.stride(2), HQ=heads, HKV=kv_heads, D=head_dim)
    return q


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, H, D] (one query per row) over cache row b's keys 0..pos[b]
    (keys/values [rows, Hkv, cap, D]); returns [B, H * D]."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(batch, kv_heads)](
        q, keys, values, pos, out, scale, keys.stride(0), keys.stride(1), keys.stride(2),
        HQ=heads, G=group, GP=max(16, _pow2(group)), D=dim, BLOCK=64,
        IEEE=q.dtype == torch.float32)
    return out
