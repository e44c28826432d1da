"""Policy losses and advantage estimators: pure functions over tensors, no I/O.

Shapes: token tensors are [B, T] (B sequences, T response-aligned positions) with `mask` 1 on tokens the
policy generated and 0 elsewhere (prompt, padding, tool results). All logprobs are fp32.
"""

from __future__ import annotations

import torch

GRPO_EPS = 1e-6
"""Added to the group std so a group with identical rewards gets zero advantage, not NaN."""


def grpo_advantages(rewards: torch.Tensor, eps: float = GRPO_EPS) -> torch.Tensor:
    """Group-normalised advantages: rewards [G] of one prompt -> (r - mean) / (std + eps), [G].

    std is the unbiased sample std, as in DeepSeekMath's GRPO; a group whose samples all got the same
    reward carries no signal and gets all-zero advantages.
    """
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce per-token losses [B, T] to a scalar (verl's agg_loss).

    token-mean: sum over all tokens / number of tokens (long answers weigh more);
    seq-mean-token-sum: mean over sequences of each sequence's token sum (Dr.GRPO-style, no length norm);
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
    Sequences with no masked-in token are left out of the seq-mean denominators.
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    seq_tokens = mask.sum(-1)
    has_tokens = seq_tokens > 0
    seq_sum = (loss * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1.0)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_seq[has_tokens].sum() / has_tokens.sum().clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "decoupled_ppo",
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level policy-gradient loss; returns (scalar loss, stats).

    decoupled_ppo (AReaL): PPO-clip on r = pi_theta / pi_prox, each token weighted by the truncated
        behaviour importance weight w = min(pi_prox / pi_behav, is_cap) (no gradient through w).
        pi_prox is the trainer's policy at batch time, so the trust region is anchored to weights the
        trainer actually had, while w corrects for the engines having sampled with older weights.
    ppo: PPO-clip with r = pi_theta / pi_behav (behaviour policy as the anchor).
    tis: REINFORCE with truncated importance sampling, -min(pi_theta/pi_behav, is_cap) * A * log pi_theta.
    """
    if kind == "decoupled_ppo":
        anchor = prox_logprobs
        weight = torch.exp(prox_logprobs - behav_logprobs).clamp(max=is_cap).detach()
    elif kind == "ppo":
        anchor = behav_logprobs
        weight = torch.ones_like(logprobs)
    elif kind == "tis":
        weight = torch.exp(logprobs.detach() - behav_logprobs).clamp(max=is_cap)
        per_token = -advantages * weight * logprobs
        return agg_loss(per_token, mask, agg), _stats(per_token, weight, torch.zeros_like(mask), mask)
    else:
        raise ValueError(f"unknown policy loss {kind!r}")
    ratio = torch.exp(logprobs - anchor)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped) * weight
    clip_hit = (clipped > unclipped).to(logprobs.dtype)
    return agg_loss(per_token, mask, agg), _stats(per_token, weight, clip_hit, mask)


def _stats(per_token, weight, clip_hit, mask) -> dict[str, float]:
    n = mask.sum().clamp(min=1)
    m = mask.to(per_token.dtype)
    return {
        "clip_fraction": float((clip_hit * m).sum() / n),
        "is_weight_mean": float((weight * m).sum() / n),
    }


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimator of KL(pi || ref) averaged over masked tokens (a diagnostic of how far a step moved)."""
    log_ratio = ref_logprobs - logprobs
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    return float((k3 * mask).sum() / mask.sum().clamp(min=1))
