"""Turn group records into padded training tensors (pure: records in, tensors out).

Response token j of a sample sits at sequence index len(prompt) + j and is predicted from position
len(prompt) + j - 1, so every per-token tensor here is aligned with `token_logprobs` output [B, T-1].
"""

from __future__ import annotations

import msgspec
import torch

from replay_buffer.schema import GroupRecord
from trainer.logprobs import pad_batch
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
    seqs, spans, behav, lmask, advs, rewards = [], [], [], [], [], []
    for g in groups:
        r = torch.tensor([s.reward for s in g.samples], dtype=torch.float32)
        a = grpo_advantages(r)
        for s, adv in zip(g.samples, a.tolist(), strict=True):
            seqs.append(s.prompt_ids + s.response_ids)
            spans.append(len(s.prompt_ids))
            behav.append(s.behavior_logprobs)
            lmask.append(s.loss_mask)
            advs.append(adv)
        rewards.append(r)
    ids, attn = pad_batch(seqs, pad_id)
    shape = (ids.shape[0], ids.shape[1] - 1)
    loss_mask = torch.zeros(shape)
    behav_lp = torch.zeros(shape)
    adv_t = torch.zeros(shape)
    n_tokens = 0
    for i, start in enumerate(spans):
        n = len(lmask[i])
        sl = slice(start - 1, start - 1 + n)
        loss_mask[i, sl] = torch.tensor(lmask[i], dtype=torch.float32)
        behav_lp[i, sl] = torch.tensor(behav[i], dtype=torch.float32)
        adv_t[i, sl] = advs[i]
        n_tokens += n
    return TrainBatch(ids, attn, loss_mask, behav_lp * loss_mask, adv_t, torch.cat(rewards), n_tokens)
