"""Turn group records into padded training tensors (pure: records in, tensors out).

Response token j of a sample sits at sequence index len(prompt) + j and is predicted from position
len(prompt) + j - 1, so every per-token tensor here is aligned with `token_logprobs` output [B, T-1].
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from replay_buffer.schema import GroupRecord
from trainer.losses import grpo_advantages


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
