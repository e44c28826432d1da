"""Policy, value, KL and entropy losses: pure functions over tensors, no I/O.

Shapes: token tensors are [B, T] (padded batches) or [T] (one packed row); `mask` is 1 on tokens the
policy generated and 0 elsewhere (prompt, padding, tool results, sample boundaries). Logprobs are fp32.

Two ways to reduce per-token losses to the step's scalar:
- `agg_loss(loss, mask, mode)` on one padded batch (verl's agg_loss);
- `agg_weights(token_counts, mode)` per sample, so that sum(loss * mask * weight) over *any* split of the
  batch into micro-batches and ranks adds up to exactly the same scalar. The trainer uses this: the
  denominator (token count, sequence count) is the whole step's, computed once before the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from trainer.advantages import GRPO_EPS, grpo_advantages

__all__ = [
    "GRPO_EPS",
    "KL_ESTIMATORS",
    "PolicyTerms",
    "agg_loss",
    "agg_weights",
    "approx_kl",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss",
    "policy_loss_terms",
    "value_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
"""low_var_kl clamps log(ref/pi) before exp: one token far off-policy must not overflow to inf."""
LOW_VAR_KL_CLAMP = 10.0
"""...and the per-token estimate itself, as verl/OpenRLHF do, so one outlier cannot dominate the step."""


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


def agg_weights(token_counts: Sequence[int], mode: str) -> list[float]:
    """Per-sample token weight w_s such that sum_s w_s * sum_{t in s} loss_t == agg_loss(loss, mask, mode)
    for the batch whose samples have `token_counts` masked-in tokens. A sample without tokens gets 0.

    token-mean: 1 / total tokens; seq-mean-token-sum: 1 / sequences; seq-mean-token-mean:
    1 / (own tokens * sequences) (sequences = those with at least one token).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    total = sum(token_counts)
    seqs = sum(1 for c in token_counts if c > 0)
    out = []
    for c in token_counts:
        if c == 0:
            out.append(0.0)
        elif mode == "token-mean":
            out.append(1.0 / total)
        elif mode == "seq-mean-token-sum":
            out.append(1.0 / seqs)
        else:
            out.append(1.0 / (c * seqs))
    return out


class PolicyTerms(NamedTuple):
    """Per-token pieces of a policy loss (all shaped like the logprobs)."""

    loss: torch.Tensor
    """Per-token loss (before aggregation)."""
    is_weight: torch.Tensor
    """Behaviour importance weight applied (after truncation; 1 for plain PPO)."""
    truncated: torch.Tensor
    """1 where the raw importance weight exceeded is_cap and was truncated."""
    clipped: torch.Tensor
    """1 where the PPO clip was active (the clipped objective was the max)."""
    dual_clipped: torch.Tensor
    """1 where the dual clip bounded a negative-advantage token's loss."""


def policy_loss_terms(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    kind: str = "decoupled_ppo",
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    dual_clip_c: float | None = None,
) -> PolicyTerms:
    """Token-level policy-gradient loss terms.

    decoupled_ppo (AReaL): PPO-clip on r = pi_theta / pi_prox, each token weighted by the truncated
        behaviour importance weight w = min(pi_prox / pi_behav, is_cap) (no gradient through w).
        pi_prox is the trainer's policy at batch time, so the trust region is anchored to weights the
        trainer actually had, while w corrects for the engines having sampled with older weights.
    ppo: PPO-clip with r = pi_theta / pi_behav (behaviour policy as the anchor).
    tis: REINFORCE with truncated importance sampling, -min(pi_theta/pi_behav, is_cap) * A * log pi_theta.
    dual_clip_c (> 1, ppo / decoupled_ppo): for A < 0 the clipped loss is further bounded by -A * c
        (Ye et al. 2020), so a token whose ratio exploded cannot dominate the step.
    """
    zeros = torch.zeros_like(logprobs)
    if kind == "tis":
        raw = torch.exp(logprobs.detach() - behav_logprobs)
        weight = raw.clamp(max=is_cap)
        per_token = -advantages * weight * logprobs
        return PolicyTerms(per_token, weight, (raw > is_cap).to(logprobs.dtype), zeros, zeros)
    if kind == "decoupled_ppo":
        anchor = prox_logprobs
        raw = torch.exp(prox_logprobs - behav_logprobs).detach()
        weight = raw.clamp(max=is_cap)
        truncated = (raw > is_cap).to(logprobs.dtype)
    elif kind == "ppo":
        anchor = behav_logprobs
        weight = torch.ones_like(logprobs)
        truncated = zeros
    else:
        raise ValueError(f"unknown policy loss {kind!r}")
    ratio = torch.exp(logprobs - anchor)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped).to(logprobs.dtype)
    dual_hit = zeros
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        negative = advantages < 0
        dual_hit = (negative & (pg > bound)).to(logprobs.dtype)
        pg = torch.where(negative, torch.minimum(pg, bound), pg)
    return PolicyTerms(pg * weight, weight, truncated, clip_hit, dual_hit)


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
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated policy loss over a padded batch; returns (scalar loss, stats over masked tokens):
    clip_fraction, dual_clip_fraction, is_weight_mean, is_weight_max, is_truncated_fraction."""
    t = policy_loss_terms(
        logprobs, prox_logprobs, behav_logprobs, advantages, kind, clip_eps, is_cap, dual_clip_c
    )
    return agg_loss(t.loss, mask, agg), _stats(t, mask)


def _stats(t: PolicyTerms, mask: torch.Tensor) -> dict[str, float]:
    m = mask.to(t.loss.dtype)
    n = m.sum().clamp(min=1)
    return {
        "clip_fraction": float((t.clipped * m).sum() / n),
        "dual_clip_fraction": float((t.dual_clipped * m).sum() / n),
        "is_weight_mean": float((t.is_weight * m).sum() / n),
        "is_weight_max": float((t.is_weight * m).max()) if m.any() else 0.0,
        "is_truncated_fraction": float((t.truncated * m).sum() / n),
    }


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's logprobs (Schulman's estimators).

    k1: log pi - log ref (unbiased, high variance, can be negative);
    k2: 0.5 (log pi - log ref)^2;
    k3: ref/pi - 1 - log(ref/pi) (unbiased, >= 0);
    low_var_kl: k3 with log(ref/pi) clamped to +-20 and the estimate to +-10 (verl/OpenRLHF).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if kind == "low_var_kl":
        neg = (-log_ratio).clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
        return (torch.exp(neg) - 1 - neg).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum(softmax(l) * l). fp32 in, fp32 out."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float | None
) -> torch.Tensor:
    """Per-token clipped value loss (PPO): 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    unclipped = (values - returns).square()
    if clip_eps is None:
        return 0.5 * unclipped
    v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns).square())


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimator of KL(pi || ref) averaged over masked tokens (a diagnostic of how far a step moved)."""
    log_ratio = ref_logprobs - logprobs
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    return float((k3 * mask).sum() / mask.sum().clamp(min=1))
