"""Turn group records into training inputs (pure: records in, tensors out).

`build_samples` gives the trainer's packed path one `TrainSample` per sample, with advantages and loss
aggregation weights computed over the whole step's batch.

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
from trainer.losses import agg_weights, effective_agg
from trainer.packing import TrainSample


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


def reweight(samples: list[TrainSample], loss_agg: str, loss_scale_factor: float | None) -> list[TrainSample]:
    """The samples of one mini-batch with aggregation weights over that mini-batch alone (`agg_weights`
    on its samples): each optimizer step's loss is its mini-batch's own token / sequence mean, as verl's
    and AReaL's mini-batch updates normalise it."""
    counts = [int(s.loss_mask.sum()) for s in samples]
    weights = agg_weights(counts, loss_agg, loss_scale_factor)
    return [msgspec.structs.replace(s, weight=w) for s, w in zip(samples, weights, strict=True)]
