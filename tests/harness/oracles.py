"""Reference implementations the tests check the product against: plain, padded-batch versions of what
the trainer computes packed and split across micro-batches and ranks, and closed forms of rules the
product enforces elsewhere (in Lua, in the optimizer's schedule)."""

from __future__ import annotations

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from replay_buffer.schema import GroupRecord
from trainer.logprobs import pad_batch
from trainer.losses import PolicyTerms, effective_agg, grpo_advantages, policy_loss_terms
from trainer.lr_schedule import lr_factor


# --- trainer/batch.py: one right-padded batch ----------------------------------------------------------
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


# --- trainer/logprobs.py: logprobs of a padded batch ---------------------------------------------------
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


# --- trainer/losses.py: aggregation and the policy loss over one padded batch ----------------------------
def agg_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """Reduce per-token losses [B, T] to a scalar (verl's agg_loss).

    token-mean: sum over all tokens / number of tokens (long answers weigh more);
    seq-mean-token-sum: mean over sequences of each sequence's token sum (no length norm);
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO);
    seq-mean-token-sum-norm: sum of every token's loss / (B * loss_scale_factor), a constant
        denominator (Dr.GRPO: the generation budget; None = T, the padded width, verl's default).
        verl divides each micro-batch's sum by loss_scale_factor and averages over micro-batches and
        ranks; here the sequence count is the step's, so the value does not depend on the split.
    Sequences with no masked-in token are left out of the seq-mean denominators (not of -norm's B).
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        scale = loss.shape[-1] if loss_scale_factor is None else loss_scale_factor
        rows = loss.shape[0] if loss.dim() > 1 else 1
        return (loss * mask).sum() / (rows * scale)
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
    loss_scale_factor: float | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated policy loss over a padded batch (each row one sequence); returns (scalar loss, stats
    over masked tokens): clip_fraction, dual_clip_fraction, is_weight_mean, is_weight_max,
    is_truncated_fraction, is_masked_fraction. `options`: policy_loss_terms' keyword-only ones."""
    t = policy_loss_terms(
        logprobs,
        prox_logprobs,
        behav_logprobs,
        advantages,
        kind,
        clip_eps,
        is_cap,
        dual_clip_c,
        mask=mask,
        **options,
    )
    return agg_loss(t.loss, mask, effective_agg(kind, agg), loss_scale_factor), policy_stats(t, mask)


def policy_stats(t: PolicyTerms, mask: torch.Tensor) -> dict[str, float]:
    m = mask.to(t.loss.dtype)
    n = m.sum().clamp(min=1)
    return {
        "clip_fraction": float((t.clipped * m).sum() / n),
        "dual_clip_fraction": float((t.dual_clipped * m).sum() / n),
        "is_weight_mean": float((t.is_weight * m).sum() / n),
        "is_weight_max": float((t.is_weight * m).max()) if m.any() else 0.0,
        "is_truncated_fraction": float((t.truncated * m).sum() / n),
        "is_masked_fraction": float((t.masked * m).sum() / n),
    }


# --- trainer/lr_schedule.py ------------------------------------------------------------------------------
def lr_at(step: int, alg) -> float:
    """The policy learning rate of optimizer step `step` under an AlgorithmSpec: the schedule spans every
    optimizer step of the job, total_steps batches x ppo_minibatches x ppo_epochs."""
    total = alg.total_steps * alg.ppo_minibatches * alg.ppo_epochs
    return alg.lr * lr_factor(step, total, alg.lr_schedule, alg.lr_warmup_steps, alg.min_lr_ratio)


# --- trainer/learner.py: mini-batch PPO over one padded batch ---------------------------------------------
def minibatch_loss(model, batch: TrainBatch, rows: list[int], prox: torch.Tensor, alg) -> dict:
    """One mini-batch's policy loss at `model`'s current weights (an HF causal LM; no reference model,
    critic or entropy bonus), aggregated over its own rows' tokens / sequences, against pi_prox `prox`
    ([B, T-1] logprobs of the whole batch). Returns loss, clip_fraction, grads (every parameter's, in
    model.parameters() order, before clipping); the model's .grad are left set."""
    r = torch.tensor(rows)
    logp = token_logprobs(model, batch.input_ids[r], batch.attention_mask[r])
    loss, stats = policy_loss(
        logp,
        prox[r],
        batch.behav_logprobs[r].to(logp.dtype),
        batch.advantages[r].to(logp.dtype),
        batch.loss_mask[r],
        alg.loss,
        alg.clip_eps,
        alg.is_cap,
        alg.loss_agg,
        alg.dual_clip_c,
        clip_eps_low=alg.clip_eps_low,
        clip_eps_high=alg.clip_eps_high,
    )
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return {"loss": float(loss.detach()), "clip_fraction": stats["clip_fraction"], "grads": grads}


def minibatch_ppo(
    model,
    batch: TrainBatch,
    parts: list[list[int]],
    alg,
    first_step: int = 0,
    prox: torch.Tensor | None = None,
) -> list[dict]:
    """verl's / AReaL's mini-batch PPO update on one batch, in place on `model`: pi_prox is the model's
    logprobs before the first update (or `prox`), then ppo_epochs passes over the mini-batches `parts` (row
    indices of `batch`), each one AdamW step on `minibatch_loss`, gradients clipped to max_grad_norm, lr
    by the schedule at optimizer step first_step + u. Returns minibatch_loss's dict per optimizer step,
    with grad_norm (before clipping) and lr."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=alg.lr, weight_decay=alg.weight_decay)
    if prox is None:
        with torch.no_grad():
            prox = token_logprobs(model, batch.input_ids, batch.attention_mask)
    out = []
    for _ in range(alg.ppo_epochs):
        for rows in parts:
            step = minibatch_loss(model, batch, rows, prox, alg)
            step["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, alg.max_grad_norm))
            step["lr"] = lr_at(first_step + len(out), alg)
            for g in opt.param_groups:
                g["lr"] = step["lr"]
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(step)
    return out


# --- replay_buffer/stream.py's admission script ----------------------------------------------------------
def admission_cap(version: int, max_staleness: int, groups_per_step: int) -> int:
    """Most groups the fleet may have started at `version` (AReaL's rule); mirrors the Lua script."""
    return (version + max_staleness + 1) * groups_per_step
