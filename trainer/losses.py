"""Policy, value, KL and entropy losses: pure functions over tensors, no I/O.

Shapes: token tensors are [B, T] (padded batches) or [T] (one packed row); `mask` is 1 on tokens the
policy generated and 0 elsewhere (prompt, padding, tool results, sample boundaries). Logprobs are fp32.
Sequence-level terms (GSPO, sequence-level IS and masking) need to know which tokens form one sequence:
`seq_ids` gives each token its sequence's index (a packed row holds several sequences); without it each
row of a [B, T] batch is one sequence ([T]: the whole row).

Names and meanings follow verl (verl/trainer/ppo/core_algos.py, rollout_corr_helper.py) wherever verl
has the concept, so that a ported config means the same thing; the docstrings say where we differ.

Per-token losses reduce to the step's scalar through `agg_weights(token_counts, mode)`, a weight per
sample such that sum(loss * mask * weight) over *any* split of the batch into micro-batches and ranks adds
up to exactly what verl's agg_loss gives on the whole batch: the denominator (token count, sequence
count) is the whole step's, computed once before the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from trainer.advantages import GRPO_EPS, grpo_advantages
from trainer.config import AGG_MODES

__all__ = [
    "GRPO_EPS",
    "PolicyTerms",
    "agg_weights",
    "behav_kl",
    "effective_agg",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss_terms",
    "value_loss",
]

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio that is exponentiated (PPO/CISPO ratio, sequence IS weight, masking statistic,
behav_kl) is clamped to +-20 first, as verl's compute_policy_loss_vanilla and rollout_corr_helper's
SAFETY_BOUND do: e^20 ~ 4.9e8 stays finite in fp32, where one token at log-ratio 89 would be inf."""
GSPO_LOG_RATIO_MAX = 10.0
"""verl's compute_policy_loss_gspo clamps the sequence log-ratio at 10 (above only)."""
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
"""low_var_kl clamps log(ref/pi) before exp: one token far off-policy must not overflow to inf."""
LOW_VAR_KL_CLAMP = 10.0
"""...and the per-token estimate itself, as verl/OpenRLHF do, so one outlier cannot dominate the step."""


def agg_weights(
    token_counts: Sequence[int], mode: str, loss_scale_factor: float | None = None
) -> list[float]:
    """Per-sample token weight w_s such that sum_s w_s * sum_{t in s} loss_t == verl's agg_loss(loss, mask, mode)
    for the batch whose samples have `token_counts` masked-in tokens. A sample without tokens gets 0.

    token-mean: 1 / total tokens; seq-mean-token-sum: 1 / sequences; seq-mean-token-mean:
    1 / (own tokens * sequences) (sequences = those with at least one token); seq-mean-token-sum-norm:
    1 / (all sequences * loss_scale_factor) (required for that mode).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive loss_scale_factor")
        return [1.0 / (len(token_counts) * loss_scale_factor) if c > 0 else 0.0 for c in token_counts]
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
    masked: torch.Tensor
    """1 where masked IS dropped the token (its ratio, or its sequence's, left [is_mask_low, high])."""


def effective_agg(loss: str, agg: str) -> str:
    """The aggregation a policy loss is reduced with: GSPO always uses seq-mean-token-mean (verl's
    compute_policy_loss_gspo ignores loss_agg_mode the same way); every other loss uses `agg`."""
    return "seq-mean-token-mean" if loss == "gspo" else agg


def _seq_ids(x: torch.Tensor, seq_ids: torch.Tensor | None) -> torch.Tensor:
    if seq_ids is not None:
        return seq_ids
    if x.dim() == 1:
        return torch.zeros(x.shape, dtype=torch.long, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (x.dim() - 1)))
    return rows.expand_as(x)


def seq_sum(
    values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int | None = None
) -> torch.Tensor:
    """Each token's sequence's sum of values over masked-in tokens, broadcast back to the token.
    num_seqs: the number of sequences (max id + 1); given, it saves a device-to-host sync."""
    ids = seq_ids.reshape(-1)
    n = int(ids.max()) + 1 if num_seqs is None else num_seqs
    sums = torch.zeros(n, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, ids, (values * mask).reshape(-1))
    return sums[ids].view_as(values)


# Long: every policy loss (PPO, decoupled PPO, GSPO, dual clip, truncated and masked IS) as one set of terms,
#   so they combine
def policy_loss_terms(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    kind: str = "decoupled_ppo",
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    dual_clip_c: float | None = None,
    *,
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    is_level: str = "token",
    is_mask: str | None = None,
    is_mask_low: float | None = None,
    is_mask_high: float = 2.0,
    mask: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> PolicyTerms:
    """Token-level policy-gradient loss terms.

    The PPO-style ratio r = pi_theta / pi_anchor is exponentiated from log r clamped to +-20
    (LOG_RATIO_CLAMP, as verl); the clip range is [1 - clip_eps_low, 1 + clip_eps_high] (verl's
    clip_ratio_low / clip_ratio_high, DAPO's clip-higher; each None = clip_eps).

    decoupled_ppo (AReaL): PPO-clip on r = pi_theta / pi_prox, each token weighted by the truncated
        behaviour importance weight w = min(pi_prox / pi_behav, is_cap) (no gradient through w).
        pi_prox is the trainer's policy at batch time, so the trust region is anchored to weights the
        trainer actually had, while w corrects for the engines having sampled with older weights.
        (verl: decoupled mode, rollout_is with rollout_is_threshold = is_cap.)
    ppo: PPO-clip with r = pi_theta / pi_behav (behaviour policy as the anchor; verl's bypass mode
        with loss_type ppo_clip).
    tis: REINFORCE with truncated importance sampling, -min(pi_theta/pi_behav, is_cap) * A * log pi_theta
        (verl's bypass mode with loss_type reinforce).
    gspo (verl compute_policy_loss_gspo, Zheng et al. 2025): the sequence ratio s = exp(mean over the
        sequence's tokens of log(pi_theta / pi_behav)) (length-normalised geometric mean), as
        sg[s] * pi_theta / sg[pi_theta] per token so each token's gradient is s * A * d log pi_theta;
        log s clamped at 10 (above); PPO-clip on s. Reduced with seq-mean-token-mean (effective_agg).
    cispo (verl compute_policy_loss_cispo, MiniMax-M1): -sg[clip(r, 1 - low, 1 + high)] * A * log pi_theta
        with r = pi_theta / pi_behav: every token keeps a policy gradient, scaled by the clipped,
        stop-gradient IS weight (reported as the token's is_weight).
    gspo and cispo anchor on pi_behav, like ppo (verl's old_log_prob in bypass mode). pi_prox is the
    policy at batch time: with one optimizer step per batch it is the current policy itself (every
    ratio to it is 1); with mini-batches (algorithm.ppo_minibatches, ppo_epochs) the policy moves away
    from it after the batch's first optimizer step, and decoupled_ppo's clip acts.
    dual_clip_c (> 1, ppo / decoupled_ppo): for A < 0 the clipped loss is further bounded by -A * c
        (Ye et al. 2020; verl clip_ratio_c, on by default there at 3), so a token whose ratio exploded
        cannot dominate the step. Without it the log-ratio clamp still bounds such a token to e^20 |A|.

    Rollout correction (decoupled_ppo, tis):
    is_level: `token` weights each token by its own truncated ratio; `sequence` weights every token of a
        sequence by min(prod_t ratio_t, is_cap) (the log-sum clamped to +-20) (verl rollout_is).
    is_mask (any loss): masked IS drops tokens whose behaviour ratio rho = pi_prox / pi_behav leaves
        [is_mask_low, is_mask_high] (None low = 1 / high): `token` per token; `sequence` when the
        sequence's product of rho leaves it (the whole sequence); `geometric` when its geometric mean
        does (verl rollout_rs token / sequence / geometric; now token_k1 / seq_sum_k1 / seq_mean_k1, which
        bound 1/rho: the same set for the default low = 1/high). A dropped token adds 0 to the loss but
        stays in the aggregation denominator (the step's weights are fixed before any forward pass, so
        that every split of the batch sums to the same loss); verl renormalises over the kept tokens.
    mask / seq_ids / num_seqs: which tokens count, and which sequence each belongs to (sequence terms).
    """
    zeros = torch.zeros_like(logprobs)
    m = torch.ones_like(logprobs) if mask is None else mask.to(logprobs.dtype)
    low = clip_eps if clip_eps_low is None else clip_eps_low
    high = clip_eps if clip_eps_high is None else clip_eps_high
    needs_seq = kind == "gspo" or is_level == "sequence" or is_mask in ("sequence", "geometric")
    ids = _seq_ids(logprobs, seq_ids) if needs_seq else None

    def per_seq_sum(x: torch.Tensor) -> torch.Tensor:
        return seq_sum(x, m, ids, num_seqs)

    def truncated_weight(log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if is_level == "sequence":
            log_w = per_seq_sum(log_w).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        elif is_level != "token":
            raise ValueError(f"unknown importance-sampling level {is_level!r}")
        raw = torch.exp(log_w).detach()
        return raw.clamp(max=is_cap), (raw > is_cap).to(logprobs.dtype)

    keep = torch.ones_like(logprobs)
    if is_mask is not None:
        log_rho = (prox_logprobs - behav_logprobs).detach()
        if is_mask == "token":
            stat = log_rho
        elif is_mask == "sequence":
            stat = per_seq_sum(log_rho)
        elif is_mask == "geometric":
            stat = per_seq_sum(log_rho) / per_seq_sum(torch.ones_like(log_rho)).clamp(min=1.0)
        else:
            raise ValueError(f"unknown masked-IS mode {is_mask!r}")
        lo = 1.0 / is_mask_high if is_mask_low is None else is_mask_low
        keep = ((stat >= math.log(lo)) & (stat <= math.log(is_mask_high))).to(logprobs.dtype)
    masked = (1.0 - keep) * m

    weight = torch.ones_like(logprobs)
    truncated = clip_hit = dual_hit = zeros
    if kind == "tis":
        weight, truncated = truncated_weight(logprobs.detach() - behav_logprobs)
        pg = -advantages * logprobs
    elif kind == "cispo":
        log_ratio = (logprobs - behav_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio).detach()
        weight = ratio.clamp(1.0 - low, 1.0 + high)
        clip_hit = (ratio != weight).to(logprobs.dtype)
        pg = -advantages * logprobs
    elif kind == "gspo":
        log_ratio = logprobs.detach() - behav_logprobs
        seq_log = per_seq_sum(log_ratio) / per_seq_sum(torch.ones_like(log_ratio)).clamp(min=1.0)
        log_s = (logprobs - logprobs.detach() + seq_log).clamp(max=GSPO_LOG_RATIO_MAX)
        s = torch.exp(log_s)
        unclipped = -advantages * s
        clipped = -advantages * s.clamp(1.0 - low, 1.0 + high)
        pg = torch.maximum(unclipped, clipped)
        clip_hit = (clipped > unclipped).to(logprobs.dtype)
    elif kind in ("decoupled_ppo", "ppo"):
        if kind == "decoupled_ppo":
            anchor = prox_logprobs
            if is_level == "token":  # today's path, unchanged: min(e^x, cap) needs no clamp
                raw = torch.exp(prox_logprobs - behav_logprobs).detach()
                weight, truncated = raw.clamp(max=is_cap), (raw > is_cap).to(logprobs.dtype)
            else:
                weight, truncated = truncated_weight(prox_logprobs - behav_logprobs)
        else:
            anchor = behav_logprobs
        ratio = torch.exp((logprobs - anchor).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
        pg = torch.maximum(unclipped, clipped)
        clip_hit = (clipped > unclipped).to(logprobs.dtype)
        if dual_clip_c is not None:
            bound = -advantages * dual_clip_c
            negative = advantages < 0
            dual_hit = (negative & (pg > bound)).to(logprobs.dtype)
            pg = torch.where(negative, torch.minimum(pg, bound), pg)
    else:
        raise ValueError(f"unknown policy loss {kind!r}")
    return PolicyTerms(pg * weight * keep, weight, truncated, clip_hit, dual_hit, masked)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's logprobs (Schulman's estimators),
    named as verl's kl_penalty names them:

    k1 (= kl): log pi - log ref (unbiased, high variance, can be negative);
    k2 (= mse): 0.5 (log pi - log ref)^2;
    abs: |log pi - log ref|;
    k3 (= low_var_kl): ref/pi - 1 - log(ref/pi) with log(ref/pi) clamped to +-20 and the estimate to
        [-10, 10] (verl and OpenRLHF: one token far off the reference cannot overflow or dominate);
    k3_unclamped: the same estimator without clamps (unbiased, >= 0; overflows to inf in fp32 once
        log(ref/pi) > ~88). Slipstream's `k3` meant this one before it took verl's meaning.
    """
    log_ratio = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return log_ratio
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k3_unclamped":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if kind in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(-LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
        return (torch.exp(neg) - 1 - neg).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}")


def behav_kl(logprobs: torch.Tensor, behav_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_behav || pi_theta) on tokens the engines sampled from pi_behav:
    r - 1 - log r with r = pi_theta / pi_behav (log r clamped to +-20). Its expectation under pi_behav is
    exactly that KL (E[r] = 1), so the batch mean is an unbiased estimate of it; the reverse direction
    (pi_behav / pi_theta, what `behav_kl` computed before) has no such expectation on these tokens.
    verl reports the same quantity as rollout_corr/k3_kl."""
    log_r = (logprobs - behav_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_r) - 1 - log_r


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float | None
) -> torch.Tensor:
    """Per-token clipped value loss (PPO): 0.5 max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
    unclipped = (values - returns).square()
    if clip_eps is None:
        return 0.5 * unclipped
    v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns).square())
