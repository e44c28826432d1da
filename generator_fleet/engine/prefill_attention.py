"""Attention of one prefill step: each sequence's new tokens attend causally to themselves and to the cached
prefix before them (the prefix cache's K/V, already in the paged pool). Planned once per step from the
sequences' lengths and pool slots, then called once per layer.

Two ways, the same result:
- **varlen** (CUDA, fp16/bf16, FlashAttention built into torch): the sequences packed without padding, each
  query row i of a sequence with `past` cached tokens seeing keys 0..past+i (FlashAttention's causal mask
  is aligned to the bottom right when a sequence has more keys than queries), GQA read in place. Its cost is
  the real tokens' and contexts', so a continuation turn with a long cached history and a short new part
  (a tool's output) costs what its new part does.
- **padded** (CPU, fp32, no FlashAttention): the batch padded to its longest sequence and run through
  scaled_dot_product_attention, causal, or with a mask over the whole context after a cached prefix.
`SLIPSTREAM_ENGINE_VARLEN_PREFILL=0` forces the padded way (a side-by-side check).
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

from generator_fleet.engine.kv_cache import PagedKVCache

VARLEN_ENV = "SLIPSTREAM_ENGINE_VARLEN_PREFILL"


def varlen_available(cache: PagedKVCache, head_dim: int) -> bool:
    """Whether prefills on this pool run through FlashAttention's packed (varlen) kernel."""
    if os.environ.get(VARLEN_ENV, "1") == "0" or cache.device.type != "cuda":
        return False
    if cache.dtype not in (torch.float16, torch.bfloat16) or head_dim > 256 or head_dim % 8:
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability(cache.device) >= (8, 0)


class PrefillAttention:
    """One prefill step's attention. `lens`: each sequence's new tokens; `past`: per sequence, the pool
    slots of its cached prefix (None: no sequence has one); `slots`: the new tokens' pool slots, flat in
    sequence order (their K/V is written there before attention reads it)."""

    def __init__(
        self,
        cache: PagedKVCache,
        lens: list[int],
        past: list[list[int]] | None,
        slots: torch.Tensor,
        *,
        head_dim: int,
        group: int,
        scale: float,
        varlen: bool | None = None,
    ) -> None:
        dev = slots.device
        self.cache, self.group, self.scale = cache, group, scale
        self.offsets = offsets = [len(p) for p in past] if past else [0] * len(lens)
        """Each sequence's first position (its cached tokens)."""
        self.has_past = any(offsets)
        self.varlen = varlen_available(cache, head_dim) if varlen is None else varlen
        # every sequence's whole context as pool slots (its past, then its new tokens), on the device:
        # reading `slots` back to the host would wait for the GPU
        rows = (
            [
                torch.cat((torch.tensor(p, dtype=torch.long, device=dev), new))
                for p, new in zip(past, torch.split(slots, lens), strict=True)
            ]
            if self.has_past
            else None
        )
        if self.varlen:
            ctx_lens = [o + n for o, n in zip(offsets, lens, strict=True)]
            self.cu_q = _cumulative(lens, dev)
            self.cu_k = _cumulative(ctx_lens, dev)
            self.max_q, self.max_k = max(lens), max(ctx_lens)
            self.ctx = torch.cat(rows) if rows is not None else slots
            return
        # padded: flat token index of every (row, column) of the batch; pads point at token 0 (masked out by
        # causality: a real query never sees a later column, and pad rows are dropped afterwards)
        width = max(lens)
        starts = torch.tensor([0, *lens[:-1]], device=dev).cumsum(0)
        col = torch.arange(width, device=dev)
        valid = col[None] < torch.tensor(lens, device=dev)[:, None]
        self.pad_index = torch.where(valid, starts[:, None] + col[None], 0)
        # the padded rows' real tokens as indices, found once: a boolean mask per layer would make the host
        # wait for the device at every layer (nonzero), leaving the GPU idle while it launches the next
        self.flat_valid = valid.reshape(-1).nonzero().squeeze(1)
        self.mask = None
        if rows is not None:
            # padding reads slot 0 (the scratch block); a padded query sees key 0, so no softmax row is empty
            self.ctx = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
            q_pos = torch.tensor(offsets, device=dev)[:, None] + col[None]  # [N, width]
            key = torch.arange(self.ctx.shape[1], device=dev)
            self.mask = (key[None, None] <= q_pos[:, :, None])[:, None]  # [N, 1, width, kv width]
        else:
            self.ctx = slots[self.pad_index]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [T, H, D] (the new tokens, flat) → attention output [T, H·D]. `k`/`v` [T, KV, D]: the new
        tokens' keys and values when the caller has them (else, or after a cached prefix, they are read
        back from the pool, where this step wrote them)."""
        if k is None or self.has_past:
            k, v = self.cache.k[layer][self.ctx], self.cache.v[layer][self.ctx]
        elif not self.varlen:
            k, v = k[self.pad_index], v[self.pad_index]
        if self.varlen:
            return _flash_varlen(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, self.scale)
        q = q[self.pad_index]
        n, width = q.shape[:2]
        qp, kp, vp = (x.transpose(1, 2) for x in (q, k, v))  # [N, heads, width, D]
        if self.group > 1:
            kp = kp.repeat_interleave(self.group, dim=1)
            vp = vp.repeat_interleave(self.group, dim=1)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=self.mask, is_causal=self.mask is None, scale=self.scale
        )
        return o.transpose(1, 2).reshape(n * width, -1)[self.flat_valid]


def _cumulative(lens: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """FlashAttention-2 over packed sequences (torch's build of it): causal, bottom-right aligned per
    sequence, K/V with fewer heads than Q read in place."""
    out = torch.ops.aten._flash_attention_forward(
        q, k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )[0]
    return out.reshape(q.shape[0], -1)
