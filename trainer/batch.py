"""Turn group records into training inputs (pure: records in, tensors out).

`build_samples` gives the trainer's packed path one `TrainSample` per sample, with advantages and loss
aggregation weights computed over the whole step's batch. `build_batch` gives one right-padded batch.

Response token j of a sample sits at sequence index len(prompt) + j and is predicted from position
len(prompt) + j - 1, so every per-token array here is aligned with the next-token logprobs.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from replay_buffer.schema import GroupRecord
from trainer.advantages import group_advantages, reinforce_pp_advantages
from trainer.config import GROUP_ESTIMATORS, AlgorithmSpec
from trainer.losses import agg_weights, effective_agg, grpo_advantages
from trainer.packing import TrainSample


class TrainBatch(msgspec.Struct):
    input_ids: torch.Tensor
    """[B, T] right-padded prompt + response ids."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens."""
    loss_mask: torch.Tensor
    """[B, T-1] 1 where the predicted token is policy-generated."""
    behav_logprobs: torch.Tensor
    """[B, T-1] engine logprobs of the predicted tokens (0 where masked)."""
    advantages: torch.Tensor
    """[B, T-1] the sample's advantage broadcast over its tokens."""
    rewards: torch.Tensor
    """[B] sample rewards."""
    num_response_tokens: int


def build_batch(groups: list[GroupRecord], pad_id: int) -> TrainBatch:
    samples, advs, rewards = [], [], []
    for g in groups:
        r = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
        samples += g.samples
        advs += grpo_advantages(r).tolist()
        rewards.append(r)
    width = max(len(s.prompt_ids) // 4 + len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    shape = (len(samples), width - 1)
    loss_mask = torch.zeros(shape)
    behav_lp = torch.zeros(shape)
    adv_t = torch.zeros(shape)
    n_tokens = 0
    for i, s in enumerate(samples):
        p = torch.from_numpy(s.view("prompt_ids").astype(np.int64))
        r = torch.from_numpy(s.view("response_ids").astype(np.int64))
        start, n = len(p), len(r)
        ids[i, :start] = p
        ids[i, start : start + n] = r
        attn[i, : start + n] = 1
        sl = slice(start - 1, start - 1 + n)
        loss_mask[i, sl] = torch.from_numpy(s.view("loss_mask").astype(np.float32))
        behav_lp[i, sl] = torch.from_numpy(s.view("behavior_logprobs").copy())
        adv_t[i, sl] = advs[i]
        n_tokens += n
    return TrainBatch(ids, attn, loss_mask, behav_lp * loss_mask, adv_t, torch.cat(rewards), n_tokens)


def loss_aggregation(alg: AlgorithmSpec, response_budget: int) -> tuple[str, float]:
    """(aggregation mode, seq-mean-token-sum-norm's constant): the policy loss's own mode (GSPO forces
    seq-mean-token-mean) and `loss_scale_factor`, null = `response_budget` (the most response tokens of
    one sample, TrainerConfig.response_budget)."""
    return effective_agg(alg.loss, alg.loss_agg), alg.loss_scale_factor or response_budget


def build_samples(
    groups: list[GroupRecord],
    advantage: str = "grpo",
    loss_agg: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> list[TrainSample]:
    """One TrainSample per sample of every group, in order. Advantages: a group estimator (grpo |
    dr_grpo | rloo) per group, reinforce_pp over the whole batch, gae 0 (the trainer fills it in with
    its critic). Weights: `agg_weights` over the whole batch, so any split sums to the batch's loss
    (`loss_scale_factor`: seq-mean-token-sum-norm's constant)."""
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    counts = [int(s.view("loss_mask").sum()) for s in samples]
    if advantage in GROUP_ESTIMATORS:
        advs = torch.cat(
            [
                group_advantages(torch.tensor([s.reward for s in g.samples], dtype=torch.float32), advantage)
                for g in groups
            ]
        )
    elif advantage == "reinforce_pp":
        advs = reinforce_pp_advantages(rewards, counts)
    elif advantage == "gae":
        advs = torch.zeros_like(rewards)
    else:
        raise ValueError(f"unknown advantage estimator {advantage!r}")
    weights = agg_weights(counts, loss_agg, loss_scale_factor)
    out = []
    for s, adv, w in zip(samples, advs.tolist(), weights, strict=True):
        p = s.view("prompt_ids").astype(np.int64)
        r = s.view("response_ids").astype(np.int64)
        n = len(p) + len(r)
        mask = np.zeros(n, np.float32)
        behav = np.zeros(n, np.float32)
        sl = slice(len(p) - 1, len(p) - 1 + len(r))
        mask[sl] = s.view("loss_mask")
        behav[sl] = s.view("behavior_logprobs")
        out.append(
            TrainSample(
                np.concatenate([p, r]), mask, behav * mask, float(adv), w, float(s.reward), s.temperature
            )
        )
    return out
