"""Sampling: the right distribution after temperature / top-k / top-p; rows independent."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from rlix.inference.engine.sampling import LogitShaping, RowSampling, sample

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
    tokens, logprobs, top = sample(logits, rows)
    assert top is None  # no row asked for alternatives
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


def test_presence_frequency_and_repetition_penalties_shape_the_logits_exactly():
    """OpenAI's presence/frequency over the generated tokens, vLLM's repetition over prompt and
    output (positive logits divided, negative multiplied), bias added first."""
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5, 3.0])
    shaping = LogitShaping(presence=0.5, frequency=0.25, repetition=2.0, bias=((3, 1.0),),
                           prompt_ids=[2])
    shaping.apply(logits.clone())  # sets up the counts
    for token in (0, 0, 1):  # the output so far: token 0 twice, token 1 once
        shaping.observe(token)
    row = logits.clone()
    shaping.apply(row)
    assert row.tolist() == pytest.approx([2.0 / 2 - 0.25 * 2 - 0.5,   # output x2: repetition, freq, presence
                                          1.0 / 2 - 0.25 - 0.5,       # output x1
                                          -1.0 * 2,                   # prompt only: repetition
                                          0.5 + 1.0,                  # biased
                                          3.0])                       # untouched


def test_a_large_presence_penalty_turns_greedy_away_from_repeated_tokens():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    plain = RowSampling(0.0, 0, 1.0, random.Random(0))
    penalised = RowSampling(0.0, 0, 1.0, random.Random(0), shaping=LogitShaping(presence=2.0))
    picks = [sample(logits, [penalised]).tokens[0] for _ in range(2)]
    assert [sample(logits, [plain]).tokens[0] for _ in range(2)] == [0, 0]
    assert picks == [0, 1]  # token 0 seen once: 5 - 2 < 4
    # reported logprobs stay the raw model's, whatever shaped the pick
    out = sample(logits, [penalised])
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[out.tokens[0]].item())


def test_logit_bias_of_100_forces_a_token():
    logits = torch.tensor([[5.0, 4.0, -3.0, 0.0]])
    row = RowSampling(0.0, 0, 1.0, random.Random(0), shaping=LogitShaping(bias=((2, 100.0),)))
    sampled_row = RowSampling(1.0, 0, 1.0, random.Random(1), shaping=LogitShaping(bias=((2, 100.0),)))
    assert sample(logits.expand(2, -1), [row, sampled_row]).tokens == [2, 2]


def test_top_logprobs_are_the_k_best_of_the_raw_distribution_sorted():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    rows = [RowSampling(1.0, 0, 1.0, random.Random(i), top_logprobs=k) for i, k in enumerate((5, 0, 20))]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.top is not None and out.top[1] is None
    for i, k in ((0, 5), (2, 20)):
        alts = out.top[i]
        assert len(alts) == k and len({t for t, _ in alts}) == k
        assert [t for t, _ in alts] == raw[i].topk(k).indices.tolist()
        values = [v for _, v in alts]
        assert values == sorted(values, reverse=True)
        if out.tokens[i] in dict(alts):
            assert dict(alts)[out.tokens[i]] == pytest.approx(out.logprobs[i])
