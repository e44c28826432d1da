"""Losses against hand-computed values."""

import math

import pytest
import torch

from trainer.losses import (
    agg_loss,
    agg_weights,
    approx_kl,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    value_loss,
)


def test_grpo_advantages_hand_computed():
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    std = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))


def test_grpo_identical_rewards_give_zero_advantage():
    assert torch.equal(grpo_advantages(torch.full((4,), 0.7)), torch.zeros(4))


def test_agg_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError):
        agg_loss(loss, mask, "nope")


def test_decoupled_ppo_hand_computed():
    # Two tokens. Token 0: A=+1, ratio pi/prox = e^0.5 (clipped to 1.2), behav weight e^0.1.
    # Token 1: A=-1, ratio = e^-0.5 (clipped to 0.8 -> -A*0.8 = 0.8 > -A*r = 0.607, so clipped is max),
    #          behaviour weight e^(1.0) capped at 2.0.
    logp = torch.tensor([[-0.5, -2.5]])
    prox = torch.tensor([[-1.0, -2.0]])
    behav = torch.tensor([[-1.1, -3.0]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, prox, behav, adv, mask, "decoupled_ppo", clip_eps=0.2, is_cap=2.0)
    t0 = max(-1 * math.exp(0.5), -1 * 1.2) * math.exp(0.1)  # = -1.2 * e^0.1
    t1 = max(1 * math.exp(-0.5), 1 * 0.8) * 2.0  # = 1.6
    assert loss.item() == pytest.approx((t0 + t1) / 2, rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(1.0)
    assert stats["is_weight_mean"] == pytest.approx((math.exp(0.1) + 2.0) / 2, rel=1e-5)


def test_decoupled_ppo_gradient_is_weighted_policy_gradient_on_policy():
    # At logp == prox (first step on a batch) the gradient is -A * w * d logp.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -2.5]])
    adv = torch.tensor([[2.0, 1.0]])
    loss, _ = policy_loss(logp, logp.detach(), behav, adv, torch.ones(1, 2), agg="seq-mean-token-sum")
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -1.0 * min(math.exp(0.5), 2.0)]]))


def test_ppo_uses_behaviour_policy_as_anchor():
    logp = torch.tensor([[-1.0]])
    behav = torch.tensor([[-1.5]])
    loss, stats = policy_loss(
        logp, torch.zeros(1, 1), behav, torch.tensor([[1.0]]), torch.ones(1, 1), "ppo", 0.2
    )
    assert loss.item() == pytest.approx(-1.2)  # ratio e^0.5 clipped to 1.2
    assert stats["is_weight_mean"] == 1.0


def test_tis_hand_computed_and_masking():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.2, -5.0]])
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = policy_loss(logp, logp.detach(), behav, adv, mask, "tis", is_cap=2.0)
    assert loss.item() == pytest.approx(-math.exp(0.2) * -1.0)
    loss.backward()
    assert logp.grad[0, 1] == 0.0  # masked token gets no gradient


def test_approx_kl_zero_when_equal_positive_otherwise():
    lp = torch.tensor([[-1.0, -2.0]])
    assert approx_kl(lp, lp, torch.ones(1, 2)) == 0.0
    assert approx_kl(lp, lp - 0.3, torch.ones(1, 2)) == pytest.approx(math.exp(-0.3) - 1 + 0.3)


def test_dual_clip_bounds_negative_advantage_tokens():
    # A = -1, ratio e^1.5 = 4.48: PPO-clip gives max(4.48, 1.2) = 4.48; dual clip c=3 bounds it to 3.
    # A = +1 tokens are untouched by the dual clip.
    logp = torch.tensor([[0.5, 0.5]])
    prox = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = policy_loss(
        logp, prox, prox, adv, torch.ones(1, 2), "decoupled_ppo", 0.2, 2.0, "seq-mean-token-sum", 3.0
    )
    assert loss.item() == pytest.approx(3.0 + -1.2)
    assert stats["dual_clip_fraction"] == pytest.approx(0.5)
    plain, _ = policy_loss(logp, prox, prox, adv, torch.ones(1, 2), "decoupled_ppo", agg="seq-mean-token-sum")
    assert plain.item() == pytest.approx(math.exp(1.5) - 1.2, rel=1e-5)


def test_truncation_stats():
    # Behaviour weights e^0.1, e^2 (truncated to 2), e^-1 over three masked tokens, one masked-out.
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behav = torch.tensor([[-1.1, -3.0, 0.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, stats = policy_loss(logp, logp, behav, torch.ones(1, 4), mask, "decoupled_ppo", is_cap=2.0)
    assert stats["is_weight_mean"] == pytest.approx((math.exp(0.1) + 2.0 + math.exp(-1.0)) / 3, rel=1e-5)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_weights_reproduce_agg_loss(mode):
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    w = agg_weights(mask.sum(-1).tolist(), mode)
    weighted = sum(w[i] * (loss[i] * mask[i]).sum() for i in range(3))
    assert weighted.item() == pytest.approx(agg_loss(loss, mask, mode).item())
    assert w[2] == 0.0
    # hand values: token-mean 1/4 each, seq-mean-token-sum 1/2, seq-mean-token-mean 1/(3*2), 1/(1*2)
    expected = {
        "token-mean": [0.25, 0.25],
        "seq-mean-token-sum": [0.5, 0.5],
        "seq-mean-token-mean": [1 / 6, 0.5],
    }
    assert w[:2] == pytest.approx(expected[mode])


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log pi - log ref = 0.5
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    # far off-policy token: k3 = e^30 - 31, low_var_kl clamps log ratio to 20 and the value to 10
    far = kl_penalty(torch.tensor([-31.0]), torch.tensor([-1.0]), "low_var_kl")
    assert far.item() == 10.0
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k9")


def test_entropy_hand_computed():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    p = torch.tensor([0.7, 0.2, 0.1])
    assert entropy_from_logits(p.log()).item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6)


def test_clipped_value_loss_hand_computed():
    # V_old 1.0, V 2.0, R 0.0, eps 0.5: unclipped (2-0)^2 = 4; clipped V 1.5 -> 2.25; max -> 4; 0.5 * 4.
    # V 0.2 (moved down 0.8 toward R=0): clipped 0.5 -> 0.25, unclipped 0.04 -> max 0.25 -> 0.125.
    v = torch.tensor([2.0, 0.2])
    out = value_loss(v, torch.tensor([1.0, 1.0]), torch.zeros(2), clip_eps=0.5)
    assert out.tolist() == pytest.approx([2.0, 0.125])
    assert value_loss(v, torch.ones(2), torch.zeros(2), None).tolist() == pytest.approx([2.0, 0.02])
