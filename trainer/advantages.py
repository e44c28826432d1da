"""Advantage estimators: pure functions from rewards (and critic values) to advantages, no I/O.

Outcome rewards only: a sample's reward arrives at its last model token. The group estimators (GRPO,
Dr.GRPO, RLOO) give one advantage per sample from the rewards of its group; REINFORCE++ whitens over the
whole batch; GAE runs backwards over a sample's model tokens with a critic's values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GRPO_EPS = 1e-6
"""Added to the group std so a group with identical rewards gets zero advantage, not NaN."""

WHITEN_EPS = 1e-8
"""Added to the variance before the rsqrt in batch whitening (verl's masked_whiten)."""

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def grpo_advantages(rewards: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """Group-normalised advantages: rewards [G] of one prompt -> (r - mean) / (std + eps), [G].

    std is the unbiased sample std, as in DeepSeekMath's GRPO; a group whose samples all got the same
    reward carries no signal and gets all-zero advantages.
    """
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): r - mean, no std division, which biases towards easy/hard prompts.
    (Its other half, no per-sequence length normalisation, is `loss_agg: seq-mean-token-sum`.)"""
    return rewards - rewards.mean()


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r)), [G]."""
    g = rewards.numel()
    if g < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) * (g / (g - 1))


def group_advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """One advantage per sample of one group [G] with a group estimator (grpo | dr_grpo | rloo)."""
    if kind == "grpo":
        return grpo_advantages(rewards)
    if kind == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if kind == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"unknown group advantage estimator {kind!r}")


def reinforce_pp_advantages(rewards: torch.Tensor, token_counts: Sequence[int]) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) for outcome rewards, gamma = 1: every model token's return is its sample's
    reward, and returns are whitened over all model tokens of the batch (verl's masked_whiten: token-
    weighted mean, unbiased variance). rewards [N] of every sample in the batch -> advantages [N]."""
    counts = torch.as_tensor(token_counts, dtype=rewards.dtype)
    n = counts.sum()
    if n < 2:
        return torch.zeros_like(rewards)
    mean = (rewards * counts).sum() / n
    var = (counts * (rewards - mean) ** 2).sum() / (n - 1)
    return (rewards - mean) * torch.rsqrt(var + WHITEN_EPS)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one sample's model tokens (tool tokens left out).

    rewards [T] per token (outcome reward: 0 except the last token), values [T] = V(state before token t).
    delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lam A_{t+1}; returns = A + V.
    """
    r, v = rewards.tolist(), values.tolist()  # a Python loop over floats: ~100x faster than tensor indexing
    adv = [0.0] * len(v)
    last = 0.0
    for t in range(len(v) - 1, -1, -1):
        next_v = v[t + 1] if t + 1 < len(v) else 0.0
        last = r[t] + gamma * next_v - v[t] + gamma * lam * last
        adv[t] = last
    a = torch.tensor(adv, dtype=values.dtype)
    return a, a + values.cpu()


def whiten(values: torch.Tensor, total: float, total_sq: float, count: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean/var from sums over the whole batch (all ranks): the
    distributed form of verl's masked_whiten (unbiased variance)."""
    if count < 2:
        return values - total / max(count, 1.0)
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1)
    return (values - mean) * (max(var, 0.0) + WHITEN_EPS) ** -0.5
