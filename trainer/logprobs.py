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


ENTROPY_CHUNK_TOKENS = 1024
"""The entropy metric is computed in chunks of this many positions, so no second [K, V] tensor is
ever whole."""


def packed_forward_kwargs(mb) -> dict:
    """Keyword arguments that make a transformers model run a packed micro-batch (trainer/attention.py)."""
    return {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "cu_seq_lens_q": mb.cu_seqlens,
        "cu_seq_lens_k": mb.cu_seqlens,
        "max_length_q": mb.max_seqlen,
        "max_length_k": mb.max_seqlen,
        "use_cache": False,
    }


def packed_logprobs(
    model, mb, temperature: float = 1.0, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob of each target [T] fp32, entropy [T] or None) for a packed micro-batch.

    Logits are computed only at `mb.logit_index` (the trained positions): prompt and tool-result
    positions never reach the vocabulary projection. Elsewhere the outputs are 0. entropy: "none",
    "no_grad" (a metric) or "grad" (an entropy bonus in the loss).

    The vocabulary-wide work is the largest memory traffic of a small model's step ([K, 152k] for
    Qwen), so it is kept to one fp32 log-softmax (cast fused in, its output the only [K, V] tensor kept
    for backward); the sampled tokens' logprobs are gathered from it and the entropy read off it.
    """
    keep = mb.logit_index
    logits = model(**packed_forward_kwargs(mb), logits_to_keep=keep).logits[0]
    if temperature > 0 and temperature != 1.0:
        logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    lp = logp_all.gather(-1, mb.targets[keep].unsqueeze(-1)).squeeze(-1)
    ent = None
    if entropy == "grad":
        ent = -(logp_all.exp() * logp_all).sum(-1)
    elif entropy == "no_grad":
        with torch.no_grad():
            ent = torch.cat([-(c.exp() * c).sum(-1) for c in logp_all.detach().split(ENTROPY_CHUNK_TOKENS)])
    elif entropy != "none":
        raise ValueError(f"entropy must be none, no_grad or grad, not {entropy!r}")
    full = lp.new_zeros(mb.num_tokens).index_copy(0, keep, lp)
    if ent is not None:
        ent = lp.new_zeros(mb.num_tokens).index_copy(0, keep, ent)
    return full, ent
