"""The CUDA forward passes built from the fused Triton kernels (engine/fused_ops.py) around the fused q/k/v
and gate/up GEMMs: a decode step and a prefill. Per layer: add + RMSNorm, one q/k/v GEMM, RoPE + K/V pool
write, attention, o_proj, add + RMSNorm, one gate/up GEMM, SwiGLU, down_proj; the residual stream is
carried as (delta, residual) so each add happens inside the next norm. Functions of a PagedForward
(engine/model.py), which decides when they apply (CUDA, SiLU, no q/k norms, no LoRA)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from generator_fleet.engine import decode_attention, fused_ops
from generator_fleet.engine.prefill_attention import PrefillAttention

PagedForward = Any
"""engine/model.py's PagedForward, whose fused weights, cache and rotary tables these passes use (not
imported: model.py imports this module)."""


def decode(fwd: PagedForward, x) -> torch.Tensor:
    """One token per sequence (`x`: engine/model.py's DecodeInputs) through the fused layers and paged
    decode attention; fp32 logits [B, vocab]."""
    B = x.block_tables.shape[0]

    def attend(i: int, q: torch.Tensor) -> torch.Tensor:
        o = decode_attention.paged_decode_attention(
            q,
            fwd.cache.k[i],
            fwd.cache.v[i],
            x.block_tables,
            x.seq_lens,
            block_size=fwd.cache.block_size,
            scale=fwd.scaling,
        )
        return o.view(B, -1)

    delta, res = _layers(fwd, fwd.decoder.embed_tokens(x.input_ids), x.positions, x.slots, attend)
    norm = fwd.decoder.norm
    normed, _ = fused_ops.add_rms_norm(delta, res, norm.weight, norm.variance_epsilon)
    return fwd._head(normed).float()


def prefill(
    fwd: PagedForward,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    attend: PrefillAttention,
) -> torch.Tensor:
    """Packed sequences (PagedForward.prefill's inputs; `attend`: the step's attention, which reads each
    layer's K/V back from the pools, where the layer writes them at `slots`). Returns the final hidden
    states [T, hidden] (before the last norm)."""
    delta, res = _layers(fwd, fwd.decoder.embed_tokens(ids), positions, slots, attend)
    return delta + res


def _layers(
    fwd: PagedForward, delta: torch.Tensor, positions, slots, attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer over rows `delta` (embeddings) at `positions`, writing K/V at `slots`;
    `attend(layer, q [T, H, D])` gives the attention output [T, H·D]. Returns (delta, residual)."""
    res = None
    for i, layer in enumerate(fwd.decoder.layers):
        norm = layer.input_layernorm
        normed, res = fused_ops.add_rms_norm(delta, res, norm.weight, norm.variance_epsilon)
        qkv = F.linear(normed, fwd.qkv_w[i], fwd.qkv_b[i])
        q = fused_ops.rope_kv_write(
            qkv, positions, fwd.cos, fwd.sin, slots, fwd.cache.k[i], fwd.cache.v[i], fwd.num_heads
        )
        a = layer.self_attn.o_proj(attend(i, q))
        norm = layer.post_attention_layernorm
        normed, res = fused_ops.add_rms_norm(a, res, norm.weight, norm.variance_epsilon)
        gate_up = F.linear(normed, fwd.gate_up_w[i], fwd.gate_up_b[i])
        delta = layer.mlp.down_proj(fused_ops.silu_mul(gate_up))
    return delta, res
