"""The trainer's entropy metric: the policy's next-token entropy averaged over the trained tokens,
the same whatever the micro-batch split, and only over the tokens the loss mask keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlix.training.trainer import PolicyTrainer


def direct_entropy(trainer: PolicyTrainer, samples) -> float:  # type: ignore[no-untyped-def]
    """Mean over the trained response tokens of -sum p log p of the distribution that scores them."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            logits = trainer.model(input_ids=seq).logits[0].float()
            p = len(s.prompt_ids)
            mask = s.loss_mask or [1] * len(s.response_ids)
            for j, keep in enumerate(mask):
                if keep:
                    logp = torch.log_softmax(logits[p + j - 1], -1)
                    total += float(-(logp.exp() * logp).sum())
                    count += 1
    return total / count


def test_entropy_is_the_mean_over_trained_tokens_and_does_not_depend_on_the_split(tiny_model_dir, samples_factory):
    a = PolicyTrainer(str(tiny_model_dir), micro_batch_size=8)
    b = PolicyTrainer(str(tiny_model_dir), micro_batch_size=2)
    samples = samples_factory(6, seed=3, trainer=a)
    samples[0] = dataclasses.replace(samples[0], loss_mask=[1, 0] * (len(samples[0].response_ids) // 2)
                                     + [1] * (len(samples[0].response_ids) % 2))
    want = direct_entropy(a, samples)  # before the step: the weights the step's forward used
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert ma["entropy"] > 0
    assert ma["entropy"] == pytest.approx(want, rel=1e-4)
    assert mb["entropy"] == pytest.approx(ma["entropy"], rel=1e-5)
    assert "kl" not in ma  # no reference model without a KL term


def test_kl_is_reported_with_a_reference_model(tiny_model_dir, samples_factory):
    trainer = PolicyTrainer(str(tiny_model_dir), kl_coef=0.1)
    samples = samples_factory(4, seed=5, trainer=trainer)
    first = trainer.train_step(samples)
    second = trainer.train_step(samples)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference
    assert second["kl"] > 0 and second["entropy"] > 0
