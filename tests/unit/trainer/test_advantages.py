"""Advantage estimators against hand-computed values."""

import math

import pytest
import torch

from trainer.advantages import (
    dr_grpo_advantages,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)


def test_dr_grpo_is_mean_centred_without_std():
    assert dr_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0])).tolist() == [0.75, -0.25, -0.25, -0.25]


def test_rloo_is_leave_one_out_baseline():
    r = torch.tensor([1.0, 0.0, 2.0])
    # r_i - mean of the others: 1 - 1, 0 - 1.5, 2 - 0.5
    assert rloo_advantages(r).tolist() == pytest.approx([0.0, -1.5, 1.5])
    assert group_advantages(r, "rloo").tolist() == pytest.approx([0.0, -1.5, 1.5])
    with pytest.raises(ValueError):
        group_advantages(r, "nope")


def test_reinforce_pp_whitens_over_tokens():
    # Sample rewards 1 (3 tokens) and 0 (1 token): token returns [1,1,1,0], mean 0.75,
    # unbiased var = (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5.
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), [3, 1])
    assert adv.tolist() == pytest.approx([0.5, -1.5], rel=1e-6)
    assert reinforce_pp_advantages(torch.tensor([1.0]), [1]).tolist() == [0.0]


def test_gae_hand_computed():
    # Three tokens, reward 1 at the end, V = [0.5, 0.2, 0.4], gamma 0.9, lam 0.8.
    r = torch.tensor([0.0, 0.0, 1.0])
    v = torch.tensor([0.5, 0.2, 0.4])
    adv, ret = gae(r, v, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.4
    d1 = 0.9 * 0.4 - 0.2
    d0 = 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert adv.tolist() == pytest.approx([a0, a1, a2], rel=1e-6)
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.4], rel=1e-6)
    # gamma = lam = 1: every advantage is the Monte Carlo return minus the value
    adv1, ret1 = gae(r, v, 1.0, 1.0)
    assert adv1.tolist() == pytest.approx([0.5, 0.8, 0.6]) and ret1.tolist() == pytest.approx([1.0] * 3)


def test_whiten_from_global_sums():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    out = whiten(x, float(x.sum()), float((x * x).sum()), 4.0)
    assert out.tolist() == pytest.approx(((x - x.mean()) / x.std()).tolist(), rel=1e-6)
    assert math.isfinite(float(whiten(torch.tensor([2.0]), 2.0, 4.0, 1.0)[0]))
