"""GRPO maths against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlix.errors import TrainingError
from rlix.training.grpo import group_advantages, policy_loss


def test_group_advantages_tensor_by_hand():
    # Group [1, 0, 0]: mean 1/3, population std sqrt(2)/3 -> [sqrt2, -1/sqrt2, -1/sqrt2].
    # Group [3, 3, 3]: all equal -> zeros.
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]]))
    s = math.sqrt(2)
    assert adv.shape == (2, 3)
    assert torch.allclose(adv[0], torch.tensor([s, -1 / s, -1 / s]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(3))


def test_group_advantages_ragged_lists_and_no_std():
    adv = group_advantages([[0.0, 1.0], [1.0, 0.0, 0.0], [0.7, 0.7]])
    assert adv[0] == pytest.approx([-1.0, 1.0], abs=1e-5)  # mean .5, std .5
    assert adv[1] == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert adv[2] == [0.0, 0.0]
    centered = group_advantages([[1.0, 0.0, 0.0]], normalize_std=False)
    assert centered[0] == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_group_advantages_rejects_empty():
    with pytest.raises(TrainingError):
        group_advantages([[1.0], []])
    with pytest.raises(TrainingError):
        group_advantages(torch.zeros(3))


def _case(eps_high=None):
    """Seq 0: A=+1, ratios [1.5, 0.9]. Seq 1: A=-2, ratios [0.5, (2.0 masked out)]."""
    behaviour = torch.full((2, 2), -1.0)
    ratios = torch.tensor([[1.5, 0.9], [0.5, 2.0]])
    logprobs = (behaviour + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    return logprobs, behaviour, adv, mask


def test_token_and_sequence_aggregation_by_hand():
    lp, b, a, m = _case()
    # Per token: r=1.5,A=1 -> clipped to 1.2 -> -1.2; r=0.9,A=1 -> -0.9;
    # r=0.5,A=-2 -> min(-1.0, 0.8*-2=-1.6) = -1.6 -> +1.6 (clipped).
    loss, metrics = policy_loss(lp, b, a, m, aggregation="token")
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 1.6) / 3, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["ratio"] == pytest.approx(2.9 / 3, abs=1e-6)
    assert metrics["num_tokens"] == 3 and "kl" not in metrics
    seq_loss, _ = policy_loss(lp, b, a, m, aggregation="sequence")
    assert seq_loss.item() == pytest.approx(((-1.2 - 0.9) / 2 + 1.6) / 2, abs=1e-6)  # 0.275
    assert seq_loss.item() != pytest.approx(loss.item())


def test_asymmetric_clip_high():
    lp, b, a, m = _case()
    loss, metrics = policy_loss(lp, b, a, m, clip_eps_high=0.6)  # 1.5 is inside [0.8, 1.6] now
    assert loss.item() == pytest.approx((-1.5 - 0.9 + 1.6) / 3, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_gradient_flows_only_through_logprobs_and_not_through_clipped_tokens():
    lp, b, a, m = _case()
    b.requires_grad_(True)
    a.requires_grad_(True)
    loss, _ = policy_loss(lp, b, a, m)
    loss.backward()
    assert b.grad is None and a.grad is None
    # d(-r*A)/d(lp) = -r*A for the one unclipped token (r=0.9, A=1), over 3 tokens.
    expected = torch.tensor([[0.0, -0.9 / 3], [0.0, 0.0]])
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def test_kl_zero_when_reference_equals_policy_and_k3_by_hand():
    lp, b, a, m = _case()
    base, _ = policy_loss(lp, b, a, m)
    same, metrics = policy_loss(lp, b, a, m, ref_logprobs=lp.detach().clone(), kl_coef=0.5)
    assert metrics["kl"] == 0.0 and same.item() == pytest.approx(base.item())
    ref = lp.detach() + math.log(2.0)  # ref - lp = ln 2 -> k3 = 2 - ln 2 - 1
    k3 = 1.0 - math.log(2.0)
    kl_loss, metrics = policy_loss(lp, b, a, m, ref_logprobs=ref, kl_coef=0.5)
    assert metrics["kl"] == pytest.approx(k3, abs=1e-6)
    assert kl_loss.item() == pytest.approx(base.item() + 0.5 * k3, abs=1e-6)


def test_normalizer_lets_micro_batches_sum_to_the_whole_batch():
    lp, b, a, m = _case()
    for agg, denom in (("token", 3.0), ("sequence", 2.0)):
        whole, _ = policy_loss(lp, b, a, m, aggregation=agg)
        parts = sum(policy_loss(lp[i:i + 1], b[i:i + 1], a[i:i + 1], m[i:i + 1],
                                      aggregation=agg, normalizer=denom)[0].item() for i in range(2))
        assert parts == pytest.approx(whole.item(), abs=1e-6)


def test_bad_shapes_are_typed_errors():
    lp, b, a, m = _case()
    with pytest.raises(TrainingError):
        policy_loss(lp, b[:, :1], a, m)
    with pytest.raises(TrainingError):
        policy_loss(lp, b, a[:1], m)
    with pytest.raises(TrainingError):
        policy_loss(lp, b, a, m, aggregation="batch")  # type: ignore[arg-type]
