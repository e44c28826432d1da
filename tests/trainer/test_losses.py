"""Losses against hand-computed values."""

import math

import pytest
import torch

from trainer.losses import agg_loss, approx_kl, grpo_advantages, policy_loss


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
