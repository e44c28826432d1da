"""Packed-sequence attention for transformers models: one row holds several samples, and each token attends
only to earlier tokens of its own sample.

Registered with transformers as attn_implementation `slipstream_packed`. Because the name is not one of
transformers' mask implementations, the model builds no [T, T] mask at all; the sample boundaries come
in as `cu_seq_lens_q` / `max_length_q` keyword arguments (the names flash-attention uses), which the model
forwards to every attention layer. On CUDA the kernel is torch's varlen flash attention
(`torch.nn.attention.varlen.varlen_attn`): no work on masked-out blocks. Elsewhere (CPU, or a torch
without it) the samples are gathered into a padded batch for one masked SDPA call. Without boundaries (a plain
`model(input_ids)` call, e.g. from generation code) the whole row is one causal sequence.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "slipstream_packed"

_kernel_logged: set[str] = set()
_VARLEN_BROKEN: list[str] = []
"""Set (with the error) once varlen_attn has failed in this process; it is not tried again."""


@functools.cache
def _varlen() -> tuple[Callable | None, frozenset[str]]:
    """torch's varlen_attn and its parameter names, imported at the first CUDA forward (the module pulls in
    torch._dynamo: most of a second of every CPU process's start otherwise); (None, {}) on an older torch."""
    try:  # torch >= 2.10 on CUDA builds; the CPU wheel has the module but no kernel
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_usable() -> bool:
    return _varlen()[0] is not None and not _VARLEN_BROKEN


def _log_kernel(name: str) -> None:
    if name not in _kernel_logged:
        _kernel_logged.add(name)
        log.info("packed attention kernel: %s", name)


def _repeat_kv(x: torch.Tensor, n_rep: int, head_dim: int = 1) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim)


def varlen_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None
) -> torch.Tensor:
    """Causal varlen flash attention over [T, H, D] tensors, whichever causal/GQA spelling this torch has."""
    varlen_attn, params = _varlen()
    kw: dict = {"scale": scale}
    if "is_causal" in params:  # torch 2.10/2.11
        kw["is_causal"] = True
    else:  # torch >= 2.12: causal is a (left, right) = (-1, 0) window
        kw["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            n_rep = q.shape[1] // k.shape[1]
            k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out[0] if isinstance(out, tuple) else out


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None), transformers' contract."""
    if attention_mask is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention takes sample boundaries, not an attention mask")
    if query.shape[0] != 1 and cu_seq_lens_q is not None:
        raise ValueError("packed attention expects one packed row (batch size 1)")
    t = query.shape[2]
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.tensor([0, t], dtype=torch.int32, device=query.device)
        max_length_q = t
    if query.is_cuda and _varlen_usable() and query.dtype in (torch.float16, torch.bfloat16):
        # [1, H, T, D] -> [T, H, D]
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        try:
            out = varlen_flash(q, k, v, cu_seq_lens_q.to(torch.int32), int(max_length_q), scaling)
        except (RuntimeError, TypeError, ValueError) as e:  # a build without the kernel for this GPU
            _VARLEN_BROKEN.append(repr(e))
            log.warning("varlen flash attention failed, using padded SDPA from now on: %r", e)
        else:
            _log_kernel("varlen flash attention")
            return out.unsqueeze(0), None
    _log_kernel("SDPA over samples padded to a batch")
    return padded_sdpa(query, key, value, cu_seq_lens_q.tolist(), scaling), None


def padded_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float | None
) -> torch.Tensor:
    """Causal attention of each sample of a packed row, as one SDPA call over the samples gathered into
    a padded batch [n, H, L_max, D] (padding keys masked out): one kernel per layer however many samples,
    which is what the CPU needs. Returns [1, T, Hq, D]."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    starts = torch.tensor(bounds[:-1])
    lens = torch.tensor(bounds[1:]) - starts
    width = int(lens.max())
    offs = torch.arange(width)
    valid = offs[None, :] < lens[:, None]  # [n, L_max]
    index = torch.where(valid, starts[:, None] + offs[None, :], 0).to(query.device)
    q, k, v = (x[0][:, index].transpose(0, 1) for x in (query, key, value))  # [n, H, L_max, D]
    causal = offs[None, :] <= offs[:, None]  # [L_max(q), L_max(k)]
    mask = (causal[None] & valid[:, None, :])[:, None].to(query.device)  # [n, 1, L_max, L_max]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [n, H, L_max, D]
    return out.transpose(1, 2)[valid.to(query.device)].unsqueeze(0)


def register() -> str:
    """Make `slipstream_packed` a valid attn_implementation (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    return ATTN_IMPLEMENTATION
