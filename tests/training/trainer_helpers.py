"""Helpers for the trainer tests (imported by tests and by dp_worker.py): synthetic GRPO samples
on the tiny preset, and gradient/weight comparisons that tolerate float noise correctly."""

from __future__ import annotations

import random

import torch

from rlix.training.types import TrainSample


def make_samples(n: int, seed: int = 0, vocab: int = 300, logprob_noise: float = 0.3,
                 trainer=None) -> list[TrainSample]:  # type: ignore[no-untyped-def]
    """`n` samples with varied prompt/response lengths; behaviour logprobs are the trainer's own
    (if given) plus noise, so ratios differ from 1 and some clip."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 7))]
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        out.append(TrainSample(prompt, response, [-5.0] * len(response), rng.uniform(-1.5, 1.5), 0))
    if trainer is not None:
        for s, lp in zip(out, trainer.compute_logprobs(out)):
            s.behaviour_logprobs = [x + rng.uniform(-logprob_noise, logprob_noise) for x in lp]
    return out


def capture_grads(trainer) -> list[dict]:  # type: ignore[no-untyped-def]
    """Record the gradients each optimizer step applies (after accumulation and all-reduce).

    Comparing these, not the weights after AdamW, is the tight check: Adam divides by sqrt(v),
    so on elements whose true gradient is ~0 (k_proj biases: softmax ignores them) float noise
    in the summation order becomes an update of up to lr."""
    seen: list[dict] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({n: p.grad.detach().cpu().clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return seen


def grads_close(a: dict, b: dict, rel: float = 1e-4) -> bool:
    """Every tensor within `rel` of the largest gradient element of the whole step."""
    scale = max(t.abs().max().item() for t in a.values())
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=0, atol=rel * scale) for n in a)


def weights_close(a: dict, b: dict, lr: float, steps: int) -> bool:
    """Almost every element (99%, model-wide) within 1e-6; the rest (Adam on ~0 gradients)
    within 2 lr per step."""
    off = total = 0
    for n in a:
        diff = (a[n] - b[n]).abs()
        if diff.max().item() > 2 * lr * steps:
            return False
        off += int((diff > 1e-6).sum())
        total += diff.numel()
    return off <= 0.01 * total
