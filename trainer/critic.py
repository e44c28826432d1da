"""Critic for GAE: a transformers backbone with a linear value head, and GAE targets over packed rows.

The value at packed position p is V(prefix up to and including token p), i.e. the value of the state in
which token p + 1 is generated: the same target alignment as the logprobs and loss mask.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.advantages import gae
from trainer.logprobs import packed_forward_kwargs


class Critic(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Start from V = 0 everywhere: the first advantages are then the plain Monte Carlo returns.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, attn_implementation: str) -> Critic:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation
        )
        return cls(backbone, backbone.config.hidden_size)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, **kw) -> torch.Tensor:
        hidden = self.backbone(**kw).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def values(self, mb) -> torch.Tensor:
        """[T] values of a packed micro-batch."""
        return self(**packed_forward_kwargs(mb))[0]


def gae_targets(values: torch.Tensor, mb, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [T], returns [T]) of a packed micro-batch: GAE over each sample's model tokens, the
    sample's reward on its last one; 0 at every other position. Runs on the CPU."""
    values = values.detach().float().cpu()
    mask = mb.loss_mask.cpu() > 0
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    bounds = mb.cu_seqlens.tolist()
    rewards = mb.rewards.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if i >= len(rewards):
            break  # the one-token placeholder row of an idle rank
        pos = mask[s:e].nonzero().squeeze(-1) + s
        if pos.numel() == 0:
            continue
        r = torch.zeros(pos.numel())
        r[-1] = rewards[i]
        a, g = gae(r, values[pos], gamma, lam)
        adv[pos] = a
        ret[pos] = g
    return adv, ret
