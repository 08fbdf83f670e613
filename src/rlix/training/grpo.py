"""GRPO maths as pure torch functions: group-relative advantages and the clipped policy loss.

Kept free of models and optimizers so the numbers can be checked by hand (tests/training).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from rlix.errors import TrainingError

Aggregation = Literal["token", "sequence"]


def _normalize_group(r: torch.Tensor, eps: float, normalize_std: bool) -> torch.Tensor:
    centered = r - r.mean(dim=-1, keepdim=True)
    if normalize_std:
        # Population std: a group of n equally good answers is a group of size n, not a sample.
        centered = centered / (r.std(dim=-1, keepdim=True, unbiased=False) + eps)
    # All-equal groups carry no signal; make that exactly zero rather than rounding noise / eps.
    flat = (r.amax(dim=-1, keepdim=True) == r.amin(dim=-1, keepdim=True))
    return torch.where(flat, torch.zeros_like(centered), centered)


def group_advantages(rewards: torch.Tensor | Sequence[Sequence[float]], eps: float = 1e-6,
                     normalize_std: bool = True) -> torch.Tensor | list[list[float]]:
    """Reward minus its group's mean, divided by the group's (population) std + eps.

    `rewards` is a [G, n] tensor (returns a tensor of that shape) or a list of groups, which may
    differ in size (returns lists of floats). A group whose rewards are all equal gets zeros.
    """
    if isinstance(rewards, torch.Tensor):
        if rewards.dim() != 2 or rewards.shape[1] == 0:
            raise TrainingError(f"rewards must be a [groups, samples] tensor, got shape "
                                f"{tuple(rewards.shape)}")
        r = rewards.to(torch.float64) if not rewards.is_floating_point() else rewards
        return _normalize_group(r, eps, normalize_std)
    out: list[list[float]] = []
    for i, group in enumerate(rewards):
        values = [float(x) for x in group]
        if not values:
            raise TrainingError(f"reward group {i} is empty")
        adv = _normalize_group(torch.tensor(values, dtype=torch.float64), eps, normalize_std)
        out.append(adv.tolist())
    return out


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None,
                aggregation: Aggregation = "token", ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0, normalizer: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped GRPO surrogate over response tokens, with an optional k3 KL to a reference.

    logprobs / behaviour_logprobs / ref_logprobs / mask are [B, T]; advantages is [B]. Only
    `logprobs` carries gradient. Per token: -min(r*A, clip(r, 1-eps, 1+eps_high)*A) + kl_coef*k3
    with r = exp(logprobs - behaviour), k3 = exp(ref-lp) - (ref-lp) - 1.

    aggregation "token": sum over masked tokens / their count; "sequence": mean over sequences
    (with at least one token) of each one's masked token mean. `normalizer`, if given, replaces
    that count (of tokens, or of sequences) so micro-batches and data-parallel ranks can divide
    by the whole batch's count and sum up to the loss of the whole batch.

    Metrics (python floats, token-weighted over this call's masked tokens): loss, clip_fraction
    (tokens whose gradient the clip removed: r > 1+eps_high with A > 0, or r < 1-eps with A < 0),
    ratio (mean), kl (only with ref_logprobs), and num_tokens.
    """
    if logprobs.dim() != 2:
        raise TrainingError(f"logprobs must be [batch, tokens], got shape {tuple(logprobs.shape)}")
    for name, t in (("behaviour_logprobs", behaviour_logprobs), ("mask", mask),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise TrainingError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise TrainingError(f"advantages must be [batch]={logprobs.shape[0]}, got {tuple(advantages.shape)}")
    if aggregation not in ("token", "sequence"):
        raise TrainingError(f"aggregation must be 'token' or 'sequence', got {aggregation!r}")
    eps_low = float(clip_eps)
    eps_high = eps_low if clip_eps_high is None else float(clip_eps_high)

    m = mask.to(logprobs.dtype)
    behaviour = behaviour_logprobs.detach().to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)
    # Masked positions may hold padding garbage; zero the exponent there so exp stays finite.
    log_ratio = torch.where(m > 0, logprobs - behaviour, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None:
        diff = torch.where(m > 0, ref_logprobs.detach().to(logprobs.dtype) - logprobs,
                           torch.zeros_like(logprobs))
        kl = torch.exp(diff) - diff - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl

    tokens_per_seq = m.sum(dim=-1)
    if aggregation == "token":
        denom = float(normalizer) if normalizer is not None else tokens_per_seq.sum().clamp_min(1)
        loss = (per_token * m).sum() / denom
    else:
        has_tokens = tokens_per_seq > 0
        seq_mean = (per_token * m).sum(dim=-1) / tokens_per_seq.clamp_min(1)
        denom = float(normalizer) if normalizer is not None else has_tokens.sum().clamp_min(1)
        loss = (seq_mean * has_tokens.to(seq_mean.dtype)).sum() / denom

    with torch.no_grad():
        n = float(m.sum())
        scale = 1.0 / max(n, 1.0)
        clipped_mask = ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0))
        metrics = {
            "loss": float(loss.detach()),
            "clip_fraction": float((clipped_mask.to(m.dtype) * m).sum()) * scale,
            "ratio": float((ratio * m).sum()) * scale,
            "num_tokens": n,
        }
        if kl is not None:
            metrics["kl"] = float((kl * m).sum()) * scale
    return loss, metrics
