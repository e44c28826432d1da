"""Next-token choice for a batch of requests: one vectorised pass for the common case (temperature, top-k,
top-p, min-p on the device, no host sync until the chosen ids are read), a per-row path for penalties,
logit bias, min_new_tokens and seeded requests.

Logprobs are under the temperature-scaled logits (the distribution sampled from before top-p/top-k/min-p
truncation), as SGLang reports by default; greedy rows use temperature 1. The trainer divides its logits
by the same temperature, so behaviour and policy logprobs compare like with like.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from generator_fleet.engine.request import Request


class Choice:
    """What the sampler picked for each row."""

    __slots__ = ("logprobs", "tokens", "top")

    def __init__(self, tokens: list[int], logprobs: list[float], top: list[list[tuple[float, int]] | None]):
        self.tokens = tokens
        self.logprobs = logprobs
        self.top = top


def sample(rows: list[Request], logits: torch.Tensor, eos_token_ids: set[int]) -> Choice:
    """Choose one token per row of fp32 `logits` [B, V]."""
    dev = logits.device
    B = len(rows)
    temps_lp = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in rows], dtype=logits.dtype, device=dev
    )
    logprobs = torch.log_softmax(logits / temps_lp[:, None], dim=-1)

    fast = [
        i
        for i, r in enumerate(rows)
        if r.params.plain and r.generator is None and len(r.output_ids) >= r.params.min_new_tokens
    ]
    fast_set = set(fast)
    slow = [i for i in range(B) if i not in fast_set]
    tokens = logits.argmax(dim=-1)
    stochastic = [i for i in fast if not rows[i].params.greedy]
    if stochastic:
        idx = torch.tensor(stochastic, device=dev)
        tokens[idx] = _sample_filtered([rows[i] for i in stochastic], logits[idx])
    for i in slow:
        tokens[i] = sample_row(rows[i], logits[i], eos_token_ids)
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top: list[list[tuple[float, int]] | None] = [None] * B
    want_top = [i for i, r in enumerate(rows) if r.top_logprobs_num > 0]
    if want_top:
        k = min(max(rows[i].top_logprobs_num for i in want_top), logprobs.shape[-1])
        vals, ids = torch.topk(logprobs[want_top], k)
        for j, i in enumerate(want_top):
            n = rows[i].top_logprobs_num
            top[i] = list(zip(vals[j, :n].tolist(), ids[j, :n].tolist(), strict=True))
    return Choice(tokens.tolist(), picked.tolist(), top)


def _sample_filtered(rows: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p (on the top-k-renormalised probabilities) and min-p, sampled with the
    exponential-race trick (argmax p/E, E ~ Exp(1)) so there is no multinomial per row."""
    dev = logits.device
    V = logits.shape[-1]
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
    x = logits / temps[:, None]
    ks = [r.params.top_k if 0 < r.params.top_k < V else V for r in rows]
    ps = [r.params.top_p for r in rows]
    mins = [r.params.min_p for r in rows]
    if all(k == V for k in ks) and all(p >= 1.0 for p in ps) and all(m <= 0.0 for m in mins):
        probs = torch.softmax(x, dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None]
    sorted_x = sorted_x.masked_fill(rank >= torch.tensor(ks, device=dev)[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (probs.cumsum(-1) - probs) > torch.tensor(ps, dtype=probs.dtype, device=dev)[:, None]
    drop |= probs < torch.tensor(mins, dtype=probs.dtype, device=dev)[:, None] * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    choice = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return order.gather(1, choice[:, None]).squeeze(1)


def sample_row(r: Request, logits: torch.Tensor, eos_token_ids: set[int]) -> int:
    """One row with everything SGLang's sampler applies: logit bias, repetition/frequency/presence
    penalties, min_new_tokens, then temperature, top-k, top-p, min-p; seeded through `r.generator`."""
    p = r.params
    x = logits.clone()
    if not p.plain:
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                if 0 <= tok < x.shape[0]:
                    x[tok] += bias
        if r.output_ids:
            out = torch.tensor(r.output_ids, device=x.device)
            counts = torch.bincount(out, minlength=x.shape[0]).to(x.dtype)
            seen = counts > 0
            if p.repetition_penalty != 1.0:
                x = torch.where(seen & (x > 0), x / p.repetition_penalty, x)
                x = torch.where(seen & (x <= 0), x * p.repetition_penalty, x)
            x = x - p.frequency_penalty * counts - p.presence_penalty * seen.to(x.dtype)
    if len(r.output_ids) < p.min_new_tokens:
        banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[0]]
        kept = x[banned].clone()
        x[banned] = float("-inf")
        if r.constraint is not None and not torch.isfinite(x).any():
            x[banned] = kept  # a finished grammar allows only the stop token: the grammar wins
    if p.greedy:
        return int(x.argmax())
    x = x / p.temperature
    if 0 < p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) > p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    gen = r.generator
    if gen is not None and gen.device != probs.device:
        return int(torch.multinomial((probs / probs.sum()).to(gen.device), 1, generator=gen))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
