"""Batched token sampling whose result for a row never depends on the other rows.

Every request owns a random stream (Python's Mersenne Twister, seeded with the request's seed
or with fresh OS entropy) and draws exactly one uniform number per sampled token. The token is
then picked by inverse CDF over the row's filtered distribution (temperature, then top-k, then
top-p). So a seeded request yields the same tokens alone, in any batch, after a pause, and on any
device, up to float rounding of the logits; and the whole batch is sampled with a few tensor ops
instead of one torch.Generator call per row.

Logprobs are those of the model's raw distribution: log_softmax of the unscaled, unfiltered
logits, evaluated at the sampled token (what a trainer recomputes from the same weights).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


def new_rng(seed: int | None) -> random.Random:
    """The per-request random stream (fresh entropy when unseeded)."""
    return random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))


@dataclass
class RowSampling:
    """The sampling settings of one running row."""

    temperature: float
    top_k: int
    top_p: float
    rng: random.Random

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, V]; return (token ids, raw logprobs)."""
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    greedy = [r.greedy for r in rows]
    tokens = logits.argmax(dim=-1)
    if not all(greedy):
        # Only sampled rows draw, one number per token, whatever their neighbours do.
        uniforms = torch.tensor([0.5 if g else max(r.rng.random(), 1e-12)
                                 for g, r in zip(greedy, rows)], device=device)
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows],
                             device=device)
        scaled = logits / temps[:, None]
        use_top_k = any(0 < r.top_k < vocab for r in rows)
        use_top_p = any(r.top_p < 1.0 for r in rows)
        if use_top_k or use_top_p:
            sampled = _sample_filtered(scaled, rows, uniforms, use_top_k, use_top_p)
        else:
            probs = torch.softmax(scaled, dim=-1)
            sampled = _inverse_cdf(probs, uniforms)
        greedy_mask = torch.tensor(greedy, device=device)
        tokens = torch.where(greedy_mask, tokens, sampled)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first cumulative probability >= u * total (never a zero-probability entry)."""
    cdf = probs.cumsum(dim=-1)
    targets = uniforms * cdf[:, -1]
    index = (cdf < targets[:, None]).sum(dim=-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _sample_filtered(scaled: torch.Tensor, rows: list[RowSampling], uniforms: torch.Tensor,
                     use_top_k: bool, use_top_p: bool) -> torch.Tensor:
    """Top-k then top-p (on the top-k renormalised distribution), over logits sorted once."""
    device = scaled.device
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if use_top_k:
        ks = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows],
                          device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    if use_top_p:
        ps = torch.tensor([r.top_p for r in rows], device=device)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
        probs = probs.masked_fill(mass_before >= ps[:, None], 0.0)
    picked = _inverse_cdf(probs, uniforms)
    return order.gather(1, picked[:, None])[:, 0]
