"""Per-token logprobs of given sequences under a causal LM (the trainer's recomputation of pi_theta).

Sequences are right-padded into one batch; with causal attention and right padding every real token
sees exactly its own prefix at its own position, so no position ids are needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]) right-padded to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """logprob of input_ids[:, t] given input_ids[:, :t], for t >= 1: shape [B, T-1], fp32.

    Logits are divided by the rollout's sampling `temperature`: the policy being trained is the tempered
    one the engines sample from (and report behaviour logprobs under), as in verl and slime.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def response_logprobs(
    model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of each response token after the prompt: shape [len(response_ids)]."""
    ids, mask = pad_batch([prompt_ids + response_ids], pad_id=0)
    lp = token_logprobs(model, ids, mask, temperature)[0]
    return lp[len(prompt_ids) - 1 :]
