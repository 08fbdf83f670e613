"""Sampling: the right distribution after temperature / top-k / top-p; rows independent."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from rlix.inference.engine.sampling import RowSampling, sample

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS = PROBS.log()


def frequencies(row: RowSampling, logits: torch.Tensor = LOGITS, draws: int = 4000) -> list[float]:
    """One batch of `draws` rows with row's settings, each row with its own random stream."""
    seed = row.rng.randrange(1 << 30)
    rows = [RowSampling(row.temperature, row.top_k, row.top_p, random.Random(seed + i))
            for i in range(draws)]
    counts = Counter(sample(logits.expand(draws, -1), rows)[0])
    return [counts[i] / draws for i in range(logits.shape[0])]


def test_plain_sampling_follows_the_softmax():
    freq = frequencies(RowSampling(1.0, 0, 1.0, random.Random(0)))
    assert freq == pytest.approx(PROBS.tolist(), abs=0.03)


def test_temperature_sharpens():
    freq = frequencies(RowSampling(0.5, 0, 1.0, random.Random(1)))
    expected = torch.softmax(LOGITS / 0.5, -1).tolist()
    assert freq == pytest.approx(expected, abs=0.03)


def test_top_k_and_top_p_cut_the_tail():
    assert frequencies(RowSampling(1.0, 2, 1.0, random.Random(2))) == pytest.approx(
        [0, 0, 3 / 7, 4 / 7], abs=0.03)
    # top_p: keep the smallest prefix reaching p; 0.4 alone reaches 0.4, 0.4+0.3 reaches 0.5.
    assert frequencies(RowSampling(1.0, 0, 0.4, random.Random(3)), draws=200) == [0, 0, 0, 1]
    assert frequencies(RowSampling(1.0, 0, 0.5, random.Random(4))) == pytest.approx(
        [0, 0, 3 / 7, 4 / 7], abs=0.03)


def test_greedy_rows_and_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0]])
    rows = [RowSampling(0.0, 0, 1.0, random.Random(0)), RowSampling(0.3, 1, 0.9, random.Random(0))]
    tokens, logprobs = sample(logits, rows)
    assert tokens == [1, 0]
    raw = torch.log_softmax(logits, -1)
    assert logprobs == pytest.approx([raw[0, 1].item(), raw[1, 0].item()])  # unscaled, unfiltered


def test_a_row_draws_the_same_tokens_whatever_its_neighbours():
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(5, 50, generator=gen) for _ in range(30)]

    def run(with_neighbours: bool) -> list[int]:
        me = RowSampling(0.8, 20, 0.9, random.Random(42))
        others = [RowSampling(1.0, 0, 1.0, random.Random(i)) for i in range(4)]
        out = []
        for logits in steps:
            if with_neighbours:
                out.append(sample(logits, [others[0], me, *others[1:]])[0][1])
            else:
                out.append(sample(logits[1:2], [me])[0][0])
        return out

    assert run(True) == run(False)
