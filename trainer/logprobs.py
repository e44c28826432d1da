"""Per-token logprobs of given sequences under a causal LM (the trainer's recomputation of pi_theta).

Sequences are right-padded into one batch; with causal attention and right padding every real token
sees exactly its own prefix at its own position, so no position ids are needed.
"""

from __future__ import annotations

import functools

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
    model,
    mb,
    temperature: float = 1.0,
    entropy: str = "none",
    chunk_tokens: int = 0,
    compiled: bool = False,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob of each target [T] fp32, entropy [T] or None) for a packed micro-batch.

    Logits are computed only at `mb.logit_index` (the trained positions): prompt and tool-result
    positions never reach the vocabulary projection. Elsewhere the outputs are 0. entropy: "none",
    "no_grad" (a metric) or "grad" (an entropy bonus in the loss).

    chunk_tokens > 0: the LM head, log-softmax, gather and entropy run fused over chunks of that many
    positions (`head_logprobs`), so no [K, V] tensor is ever whole and backward recomputes each chunk's
    logits; compiled: those per-chunk kernels go through torch.compile. chunk_tokens = 0: the plain path,
    one fp32 log-softmax over all K positions (its output the only [K, V] tensor kept for backward).

    fp32_head (trainer.fp32_lm_head): the head's matmul runs in fp32 on bf16 compute, from the final
    norm's output and the head's bf16 compute weight (FSDP2's bf16 copy, tied to embed_tokens when tied;
    under autocast the master weight rounded to bf16) cast to fp32, as the engines' fp32 head computes it
    from the bf16 weights they were sent. Gradients reach the weight and hidden states through the
    casts. No effect on an fp32 model without autocast.
    """
    if entropy not in ("none", "no_grad", "grad"):
        raise ValueError(f"entropy must be none, no_grad or grad, not {entropy!r}")
    keep = mb.logit_index
    head = model.get_output_embeddings()
    if chunk_tokens > 0 and getattr(head, "bias", None) is None:
        lp, ent = _fused_head_forward(model, head, mb, temperature, chunk_tokens, compiled, fp32_head)
    else:
        lp, ent = _plain_head_forward(model, head, mb, temperature, entropy, fp32_head)
    if entropy == "none":
        ent = None
    elif entropy == "no_grad":
        ent = ent.detach()
    full = lp.new_zeros(mb.num_tokens).index_copy(0, keep, lp)
    if ent is not None:
        ent = lp.new_zeros(mb.num_tokens).index_copy(0, keep, ent)
    return full, ent


def fp32_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits computed in fp32: hidden states, weight and bias cast up. Under autocast the
    weight and bias are first rounded to autocast's dtype (`compute_weight`)."""
    dev = hidden.device.type
    weight, bias = compute_weight(head.weight), getattr(head, "bias", None)
    with torch.autocast(dev, enabled=False):
        return F.linear(_fp32(hidden), _fp32(weight), None if bias is None else _fp32(compute_weight(bias)))


def compute_weight(w: torch.Tensor) -> torch.Tensor:
    """w as the bf16 compute sees it: rounded to autocast's dtype when autocast is on (the values every
    other matmul and the engines use; the fp32 master weight would differ from the engines' head by its
    rounding), else w itself (FSDP2's bf16 compute copy, or an fp32 model's weight)."""
    dev = w.device.type
    return w.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else w


def _plain_head_forward(
    model, head, mb, temperature: float, entropy: str, fp32_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    keep = mb.logit_index
    if fp32_head:
        logits = _run_with_head_hook(model, head, mb, fp32_logits)[0]
    else:
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
    return lp, ent


def _run_with_head_hook(model, head, mb, fn):
    """Runs the model with `fn(head, hidden)` in place of its LM head's matmul and returns fn's result.

    A forward pre-hook on the LM head takes the final hidden states at the trained positions, hands them
    to fn and the head an empty input. The work stays inside the model's forward call, so under FSDP2 the
    weight is the unsharded parameter the root module gathered for its forward (tied to embed_tokens in
    Qwen), and its gradient reaches the sharded parameter through FSDP's own post-backward like the plain
    head's.
    """
    out = []

    def pre_hook(module, args):
        hidden = args[0]
        out.append(fn(module, hidden))
        return (hidden[:, :0],)

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        model(**packed_forward_kwargs(mb), logits_to_keep=mb.logit_index)
    finally:
        handle.remove()
    return out[0]


def _fused_head_forward(
    model, head, mb, temperature: float, chunk_tokens: int, compiled: bool, fp32_head: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the model with the fused head (`head_logprobs`) in place of its LM head's matmul
    (`_run_with_head_hook`): the fused logprobs and entropy from the final hidden states at the trained
    positions and the head's weight."""
    targets = mb.targets[mb.logit_index]

    def fused(module, hidden):
        return head_logprobs(
            hidden[0], module.weight, targets, temperature, chunk_tokens, compiled, fp32_head
        )

    return _run_with_head_hook(model, head, mb, fused)


# --- fused, chunked LM head + log-softmax + gather + entropy ------------------------------------------


def _chunk_forward(h, w, y, temperature: float):
    """One chunk's (logprob of y [C], entropy [C], logsumexp [C]) of logits (h @ w.T) / temperature in fp32.

    In-place on the chunk's fresh [C, V] logits: fewer passes over them when not compiled.
    """
    z = _fp32(h @ w.t())
    if temperature != 1.0:
        z /= temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.sub_(lse.unsqueeze(-1))
    lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ent = logp.exp().mul_(logp).sum(-1).neg_()
    return lp, ent, lse


def _chunk_grad_logits(h, w, y, lse, ent, g_lp, g_ent, temperature: float):
    """d(sum g_lp*lp + g_ent*ent)/d(h @ w.T) for one chunk, in h's dtype, recomputing the logits.

    With z the tempered logits, p = softmax(z): d lp/dz = onehot(y) - p and d ent/dz = -p * (logp + ent),
    so the gradient is g_lp * onehot(y) - p * (g_lp + g_ent * (logp + ent)); / temperature for the raw
    logits. In-place on the recomputed logits, like _chunk_forward.
    """
    z = _fp32(h @ w.t())
    if temperature != 1.0:
        z /= temperature
    logp = z.sub_(lse.unsqueeze(-1))
    p = logp.exp()
    g = logp.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_lp.unsqueeze(-1)).mul_(p).neg_()
    g.scatter_add_(-1, y.unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature != 1.0:
        g /= temperature
    return g.to(h.dtype)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64, for gradcheck)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, compiled, fp32):
        fwd = _compiled(_chunk_forward) if compiled else _chunk_forward
        k = hidden.shape[0]
        lp = _fp32(hidden.new_empty(k))
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        # fp32: the fp32 copy of the weight lives for this loop only (backward makes its own).
        w = _fp32(weight) if fp32 else weight
        for s in range(0, k, chunk):
            e = min(s + chunk, k)
            h = _fp32(hidden[s:e]) if fp32 else hidden[s:e]
            lp[s:e], ent[s:e], lse[s:e] = fwd(h, w, targets[s:e], temperature)
        del w
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.compiled, ctx.fp32 = temperature, chunk, compiled, fp32
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        g_lp = g_lp if g_lp is not None else torch.zeros_like(lse)
        g_ent = g_ent if g_ent is not None else torch.zeros_like(lse)
        grad_fn = _compiled(_chunk_grad_logits) if ctx.compiled else _chunk_grad_logits
        k, chunk, fp32 = hidden.shape[0], ctx.chunk, ctx.fp32
        w = _fp32(weight) if fp32 else weight
        gh = torch.empty_like(hidden) if need_h else None
        # Several chunks add into the weight gradient: in fp32, then one rounding like the plain head's.
        gw = None
        if need_w and k > chunk:
            gw = _fp32(torch.zeros_like(weight))
        for s in range(0, k, chunk):
            e = min(s + chunk, k)
            h = _fp32(hidden[s:e]) if fp32 else hidden[s:e]
            g = grad_fn(h, w, targets[s:e], lse[s:e], ent[s:e], g_lp[s:e], g_ent[s:e], ctx.temperature)
            if need_h:
                gh[s:e] = g @ w
            if need_w:
                if gw is None:
                    gw = g.t() @ h
                else:
                    gw += g.t() @ h
        if gw is not None:
            gw = gw.to(weight.dtype)
        return gh, gw, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 2048,
    compiled: bool = False,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of targets [K] fp32, entropy [K] fp32) under logits = hidden @ weight.T / temperature.

    hidden [K, H], weight [V, H] (the LM head, bias-free), targets [K]. The same values and gradients
    as log_softmax over the whole [K, V] logits, but computed chunk_tokens positions at a time: the
    largest tensor is one chunk's [chunk, V] fp32 logits, and backward recomputes them per chunk
    (one more head matmul) instead of keeping [K, V] fp32 for backward. The matmul runs in autocast's
    dtype when autocast is on (as the plain head's would), else in hidden's dtype; softmax math in fp32.
    fp32: the matmul in fp32 whatever the inputs' dtype (an fp32 LM head): each chunk's hidden states and
    the weight (under autocast: rounded to its dtype first, `compute_weight`) are cast up inside, and the
    gradients come back in their own dtypes.
    """
    if not (temperature > 0 and temperature != 1.0):
        temperature = 1.0  # greedy rollouts (0) and 1: plain logits
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    if fp32:
        weight = compute_weight(weight)
    else:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(dev, enabled=False):
        return _HeadLogprobs.apply(
            hidden, weight, targets, float(temperature), int(chunk_tokens), compiled, bool(fp32)
        )
