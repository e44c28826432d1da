"""Losses against hand-computed values."""

import math

import pytest
import torch
from oracles import agg_loss, policy_loss

from trainer.losses import agg_weights, grpo_advantages, kl_penalty, value_loss


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


def test_clipped_value_loss_hand_computed():
    # V_old 1.0, V 2.0, R 0.0, eps 0.5: unclipped (2-0)^2 = 4; clipped V 1.5 -> 2.25; max -> 4; 0.5 * 4.
    # V 0.2 (moved down 0.8 toward R=0): clipped 0.5 -> 0.25, unclipped 0.04 -> max 0.25 -> 0.125.
    v = torch.tensor([2.0, 0.2])
    out = value_loss(v, torch.tensor([1.0, 1.0]), torch.zeros(2), clip_eps=0.5)
    assert out.tolist() == pytest.approx([2.0, 0.125])
    assert value_loss(v, torch.ones(2), torch.zeros(2), None).tolist() == pytest.approx([2.0, 0.02])


# --- the verl-compatible loss family (float64, hand-computed) ----------------------------------------
from trainer.losses import behav_kl, policy_loss_terms, seq_sum  # noqa: E402

F64 = torch.float64


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-15)


def t64(*rows, grad=False):
    return torch.tensor(rows, dtype=F64, requires_grad=grad)


def test_asymmetric_clip_values_and_gradients():
    # ppo, low 0.2, high 0.28. Token 0: A=+1, r=e^0.5 -> clipped at 1.28 (no gradient).
    # Token 1: A=-1, r=e^-0.5=0.607 -> clipped at 0.8: loss 0.8 (no gradient).
    # Token 2: A=+1, r=e^0.2=1.221 < 1.28: unclipped, loss -r, d/dlogp = -r. With symmetric 0.2 it clips.
    behav = t64([-1.0, -1.0, -1.0])
    logp = (behav + t64([0.5, -0.5, 0.2])).detach().requires_grad_(True)
    adv = t64([1.0, -1.0, 1.0])
    mask = torch.ones(1, 3, dtype=F64)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        behav,
        adv,
        mask,
        "ppo",
        0.2,
        agg="seq-mean-token-sum",
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    assert loss.item() == pytest.approx(-1.28 + 0.8 - math.exp(0.2), rel=1e-12)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -math.exp(0.2)]])
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    sym, sym_stats = policy_loss(logp, logp.detach(), behav, adv, mask, "ppo", 0.2, agg="seq-mean-token-sum")
    assert sym.item() == pytest.approx(-1.2 + 0.8 - 1.2, rel=1e-12)
    assert sym_stats["clip_fraction"] == pytest.approx(1.0)
    # decoupled_ppo takes the same bounds on pi/pi_prox
    prox = behav
    lo_hi, _ = policy_loss(
        logp,
        prox,
        behav,
        adv,
        mask,
        "decoupled_ppo",
        0.2,
        2.0,
        "seq-mean-token-sum",
        clip_eps_low=0.1,
        clip_eps_high=0.3,
    )
    assert lo_hi.item() == pytest.approx(-1.3 + 0.9 - math.exp(0.2), rel=1e-12)


def test_ppo_log_ratio_is_clamped_at_20():
    # A=-1 and log(pi/pi_behav)=25 with dual clip off: e^20 (finite, verl's clamp), not e^25; no gradient.
    behav = t64([-30.0, -1.0])
    logp = t64([-5.0, -26.0], grad=True)
    adv = t64([-1.0, 1.0])
    loss, _ = policy_loss(
        logp, logp.detach(), behav, adv, torch.ones(1, 2, dtype=F64), "ppo", agg="seq-mean-token-sum"
    )
    # token 1: log-ratio -25 -> e^-20, A=+1: max(-e^-20, -0.8) = -e^-20
    assert loss.item() == pytest.approx(math.exp(20) - math.exp(-20), rel=1e-12)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    # fp32 at a log-ratio of 100: finite (was inf)
    t = policy_loss_terms(
        torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([-100.0]), torch.tensor([-1.0]), "ppo"
    )
    assert torch.isfinite(t.loss).all() and t.loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    # dual clip still bounds it to -A * c
    d, _ = policy_loss(
        logp,
        logp.detach(),
        behav,
        adv,
        torch.ones(1, 2, dtype=F64),
        "ppo",
        agg="seq-mean-token-sum",
        dual_clip_c=3.0,
    )
    assert d.item() == pytest.approx(3.0 - math.exp(-20), rel=1e-12)


def _gspo_case():
    # Two sequences in one packed row of 6 positions; position 4 is masked out with a wild log-ratio.
    # seq 0 (ids 0): log(pi/pi_behav) 0.3, 0.1 -> mean 0.2 -> s = e^0.2 = 1.2214 > 1.2; A=+1: clipped -1.2
    # seq 1 (ids 1): -0.1, -0.3, [5.0 masked], 0.1 -> mean -0.1 -> s = e^-0.1 = 0.9048 in range; A=-1: +s
    behav = t64(-1.0, -2.0, -1.0, -1.5, -2.0, -1.0)
    lr = t64(0.3, 0.1, -0.1, -0.3, 5.0, 0.1)
    logp = (behav + lr).detach().requires_grad_(True)
    adv = t64(1.0, 1.0, -1.0, -1.0, -1.0, -1.0)
    mask = t64(1.0, 1.0, 1.0, 1.0, 0.0, 1.0)
    ids = torch.tensor([0, 0, 1, 1, 1, 1])
    return logp, behav, adv, mask, ids


def test_gspo_sequence_ratio_hand_computed_with_gradient():
    logp, behav, adv, mask, ids = _gspo_case()
    t = policy_loss_terms(logp, logp.detach(), behav, adv, "gspo", 0.2, mask=mask, seq_ids=ids, num_seqs=2)
    s1 = math.exp(-0.1)
    expected = [-1.2, -1.2, s1, s1, s1, s1]  # the masked token's value is never used
    got = t.loss.tolist()
    for i in (0, 1, 2, 3, 5):
        assert got[i] == pytest.approx(expected[i], rel=1e-12)
    assert t.clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # seq-mean-token-mean as the trainer weights it: seq 0 weight 1/(2*2), seq 1 1/(3*2)
    w = t64(0.25, 0.25, 1 / 6, 1 / 6, 1 / 6, 1 / 6) * mask
    (t.loss * w).sum().backward()
    # d/dlogp_t of -A * s: s * -A per unclipped token (s = sg[s] * pi/sg[pi]); clipped tokens 0
    close(logp.grad, [0.0, 0.0, s1 / 6, s1 / 6, 0.0, s1 / 6])
    # padded [B, T] form (one row per sequence, no seq_ids) gives the same loss through policy_loss
    lp2 = t64([0.3 - 1, 0.1 - 2, 0.0], [-1.1, -1.8, -0.9])
    b2 = t64([-1.0, -2.0, -1.0], [-1.0, -1.5, -1.0])
    a2 = t64([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0])
    m2 = t64([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    loss, stats = policy_loss(
        lp2, lp2, b2, a2, m2, "gspo", 0.2, agg="token-mean"
    )  # gspo forces seq-mean-token-mean
    assert loss.item() == pytest.approx((-1.2 + s1) / 2, rel=1e-12)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)


def test_gspo_log_ratio_clamped_at_10():
    # mean log-ratio 12, A=-1: log s clamped to 10 -> loss e^10 per token, and no gradient through the clamp
    logp = t64([-1.0, -1.0], grad=True)
    behav = t64([-13.0, -13.0])
    loss, _ = policy_loss(logp, logp.detach(), behav, t64([-1.0, -1.0]), torch.ones(1, 2, dtype=F64), "gspo")
    assert loss.item() == pytest.approx(math.exp(10), rel=1e-12)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]


def test_cispo_clipped_stop_gradient_weight():
    # low 0.2, high 0.28. Token 0: A=+1, r=e^0.5 -> w=1.28 (clipped): loss -1.28*logp, grad -1.28.
    # Token 1: A=-1, r=e^-0.05 in range: loss +r*logp, grad r. Token 2: A=+1, r=e^-1 -> w=0.8.
    behav = t64([-1.5, -0.95, 0.0])
    logp = t64([-1.0, -1.0, -1.0], grad=True)
    adv = t64([1.0, -1.0, 1.0])
    t = policy_loss_terms(logp, logp.detach(), behav, adv, "cispo", 0.2, clip_eps_low=0.2, clip_eps_high=0.28)
    r1 = math.exp(-0.05)
    close(t.loss, [[1.28, -r1, 0.8]])
    close(t.is_weight, [[1.28, r1, 0.8]])
    assert t.clipped.tolist() == [[1.0, 0.0, 1.0]]
    t.loss.sum().backward()
    close(logp.grad, [[-1.28, r1, -0.8]])


@pytest.mark.parametrize("kind", ["decoupled_ppo", "tis"])
def test_sequence_level_truncated_is(kind):
    # Row 0: log(pi_prox/pi_behav) 0.2, 0.3 -> product e^0.5 = 1.6487 < cap 2: every token weighs e^0.5.
    # Row 1: 0.5, 0.4 -> e^0.9 > 2: truncated to 2. Row 2: sum 30 (clamped to 20 first): truncated to 2.
    # logp == prox: the PPO ratio is 1 (unclipped), so the token loss is -A * w and d/dlogp = -A * w.
    prox = t64([-1.0, -1.0], [-2.0, -1.0], [-1.0, -1.0])
    behav = prox - t64([0.2, 0.3], [0.5, 0.4], [15.0, 15.0])
    logp = prox.clone().requires_grad_(True)
    adv = t64([1.0, 1.0], [-1.0, -1.0], [1.0, 1.0])
    mask = torch.ones(3, 2, dtype=F64)
    loss, stats = policy_loss(
        logp, prox, behav, adv, mask, kind, is_cap=2.0, agg="seq-mean-token-sum", is_level="sequence"
    )
    w = [[math.exp(0.5)] * 2, [2.0, 2.0], [2.0, 2.0]]
    # decoupled_ppo: -A * w * r with r = 1; tis: -A * w * log pi
    x = prox if kind == "tis" else torch.ones(3, 2, dtype=F64)
    expected = sum(-adv[r, c].item() * w[r][c] * x[r, c].item() for r in range(3) for c in range(2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["is_truncated_fraction"] == pytest.approx(4 / 6)
    assert stats["is_weight_max"] == pytest.approx(2.0)
    loss.backward()
    expected_grad = [[-w[r][c] * adv[r, c].item() / 3 for c in range(2)] for r in range(3)]
    close(logp.grad, expected_grad)


def test_masked_is_token_edges_and_gradient():
    # rho = pi_prox/pi_behav per token: 2 (edge, kept), 2 * (1 + 1e-9) (dropped), 0.5 (edge, kept),
    # 0.5 * (1 - 1e-9) (dropped), 1 (kept); bounds [1/2, 2] (low defaults to 1/high).
    log_rho = [math.log(2.0), math.log(2.0) + 1e-9, math.log(0.5), math.log(0.5) - 1e-9, 0.0]
    behav = torch.zeros(1, 5, dtype=F64)
    prox = t64(log_rho)
    logp = prox.clone().requires_grad_(True)
    adv = torch.ones(1, 5, dtype=F64)
    mask = torch.ones(1, 5, dtype=F64)
    loss, stats = policy_loss(
        logp, prox, behav, adv, mask, "ppo", 0.2, agg="token-mean", is_mask="token", is_mask_high=2.0
    )
    # ppo on pi/pi_behav = rho, A=+1: kept tokens contribute max(-rho, -clip(rho)) = -1.2, -0.5, -1
    # (rho=2 clipped to 1.2; rho=0.5: -0.5 > -0.8); dropped ones 0; the denominator stays 5 tokens
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0) / 5, rel=1e-12)
    assert stats["is_masked_fraction"] == pytest.approx(2 / 5)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -0.5 / 5, 0.0, -1.0 / 5]])
    # an explicit lower bound: 0.6 drops the rho=0.5 token too
    _, st = policy_loss(
        logp, prox, behav, adv, mask, "ppo", is_mask="token", is_mask_low=0.6, is_mask_high=2.0
    )
    assert st["is_masked_fraction"] == pytest.approx(3 / 5)


@pytest.mark.parametrize(("mode", "dropped_rows"), [("sequence", [0]), ("geometric", [])])
def test_masked_is_sequence_and_geometric(mode, dropped_rows):
    # Row 0: log rho 0.5, 0.4: product e^0.9 = 2.46 > 2 (sequence drops it); geometric mean e^0.45 = 1.57 keeps.
    # Row 1: 0.1, -0.1: kept either way. Row 2: 0.2 and a masked-out token at 5.0, which must not count.
    prox = t64([0.5, 0.4], [0.1, -0.1], [0.2, 5.0])
    behav = torch.zeros(3, 2, dtype=F64)
    logp = prox.clone().requires_grad_(True)
    adv = torch.ones(3, 2, dtype=F64)
    mask = t64([1.0, 1.0], [1.0, 1.0], [1.0, 0.0])
    t = policy_loss_terms(
        logp, prox, behav, adv, "decoupled_ppo", is_cap=10.0, mask=mask, is_mask=mode, is_mask_high=2.0
    )
    keep_rows = [r not in dropped_rows for r in range(3)]
    masked = [[0.0 if keep_rows[r] else 1.0] * 2 for r in range(3)]
    masked[2][1] = 0.0  # outside the loss mask: never counted as dropped
    assert t.masked.tolist() == masked
    (t.loss * mask).sum().backward()
    # decoupled_ppo with logp == prox: d/dlogp = -A * w, w = min(rho, cap) = rho
    rho = torch.exp(prox).tolist()
    expected = [[(-rho[r][c] if keep_rows[r] and mask[r, c] else 0.0) for c in range(2)] for r in range(3)]
    close(logp.grad, expected)


def test_seq_sum_packed_rows():
    v = t64(1.0, 2.0, 3.0, 4.0, 5.0)
    m = t64(1.0, 1.0, 0.0, 1.0, 1.0)
    ids = torch.tensor([0, 0, 1, 1, 2])
    assert seq_sum(v, m, ids).tolist() == [3.0, 3.0, 4.0, 4.0, 5.0]
    assert seq_sum(v, m, ids, num_seqs=3).tolist() == [3.0, 3.0, 4.0, 4.0, 5.0]


def test_seq_mean_token_sum_norm_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # (6 + 4 + 0) / (3 sequences * 8): the empty sequence counts in the constant denominator (Dr.GRPO)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", 8).item() == pytest.approx(10 / 24)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 9)  # T = 3
    w = agg_weights([3, 1, 0], "seq-mean-token-sum-norm", 8)
    assert w == pytest.approx([1 / 24, 1 / 24, 0.0])
    assert sum(w[i] * float((loss[i] * mask[i]).sum()) for i in range(3)) == pytest.approx(10 / 24)
    with pytest.raises(ValueError):
        agg_weights([3, 1], "seq-mean-token-sum-norm")


def test_k3_is_verls_clamped_estimator_and_unclamped_keeps_a_name():
    x = 0.5  # log pi - log ref
    lp = torch.tensor([-1.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.0 - x], dtype=F64)
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.item() == pytest.approx(math.exp(-x) - 1 + x, rel=1e-12)
    k3.backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(-x), rel=1e-12)
    # log(ref/pi) = 30: k3 clamps log-ratio at 20 and the estimate at 10, like low_var_kl; no gradient
    far_lp = torch.tensor([-31.0], dtype=F64, requires_grad=True)
    far = kl_penalty(far_lp, torch.tensor([-1.0], dtype=F64), "k3")
    assert far.item() == 10.0
    far.backward()
    assert far_lp.grad.item() == 0.0
    unclamped = kl_penalty(torch.tensor([-31.0], dtype=F64), torch.tensor([-1.0], dtype=F64), "k3_unclamped")
    assert unclamped.item() == pytest.approx(math.exp(30) - 31, rel=1e-12)
    # fp32, log(ref/pi) = 100: k3 stays finite, the unclamped estimator overflows
    assert kl_penalty(torch.tensor([-101.0]), torch.tensor([-1.0]), "k3").item() == 10.0
    assert math.isinf(kl_penalty(torch.tensor([-101.0]), torch.tensor([-1.0]), "k3_unclamped").item())
    # verl's aliases
    a, b = torch.tensor([-1.0], dtype=F64), torch.tensor([-1.5], dtype=F64)
    assert kl_penalty(a, b, "kl").item() == kl_penalty(a, b, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(a, b, "mse").item() == kl_penalty(a, b, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(b, a, "abs").item() == pytest.approx(0.5)


def test_behav_kl_is_unbiased_for_kl_behav_to_trainer():
    # Exact expectation over tokens drawn from pi_behav of a 3-token vocabulary.
    pb = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    pt = torch.tensor([0.2, 0.5, 0.3], dtype=F64)
    est = behav_kl(pt.log(), pb.log())
    expectation = float((pb * est).sum())
    assert expectation == pytest.approx(float((pb * (pb / pt).log()).sum()), rel=1e-12)  # KL(pi_b || pi_t)
    # the direction reported before (ratio pi_behav / pi_theta) is not an estimate of either KL
    old = (pb / pt) - 1 - (pb / pt).log()
    assert float((pb * old).sum()) != pytest.approx(expectation, rel=1e-3)
    assert float((pb * old).sum()) != pytest.approx(float((pt * (pt / pb).log()).sum()), rel=1e-3)
    assert behav_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    assert torch.isfinite(behav_kl(torch.tensor([0.0]), torch.tensor([-200.0]))).all()
