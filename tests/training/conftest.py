"""Shared helpers for the trainer tests: synthetic GRPO samples on the tiny preset."""

from __future__ import annotations

import random

import pytest

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


@pytest.fixture
def samples_factory():
    return make_samples
