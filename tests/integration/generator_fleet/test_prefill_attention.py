"""A prefill step's attention (engine/prefill_attention.py) against plain per-sequence causal attention:
sequences of different lengths, some after a cached prefix already in the pool, GQA. The padded way on
CPU (fp32), and on GPU the packed FlashAttention way in bf16 against both (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from generator_fleet.engine.kv_cache import PagedKVCache
from generator_fleet.engine.prefill_attention import PrefillAttention, varlen_available

H, KV, D = 6, 2, 32
LENS = [5, 1, 19, 8]  # new tokens per sequence
PASTS = [0, 21, 16, 3]  # cached tokens before them


def _case(device, dtype, pasts):
    """A pool holding each sequence's cached past and (written, as a prefill layer does) its new tokens'
    K/V at scattered slots; returns the cache, the plan's inputs, q [T, H, D], the new k/v and the
    reference output [T, H·D] (each sequence alone: its queries at positions past.. see keys 0..itself)."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(
        num_layers=1, num_kv_heads=KV, head_dim=D, num_blocks=16, block_size=8, dtype=dtype, device=device
    )
    free = torch.randperm(cache.shape[0] - 8, generator=g) + 8  # any slot but the scratch block's
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    taken = iter(free.tolist())
    past = [[next(taken) for _ in range(p)] for p in pasts]
    new = [[next(taken) for _ in range(n)] for n in LENS]
    slots = torch.tensor([s for row in new for s in row], device=device)
    T = sum(LENS)
    q = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    k = torch.randn(T, KV, D, generator=g).to(dtype).to(device)
    v = torch.randn(T, KV, D, generator=g).to(dtype).to(device)
    cache.k[0][slots], cache.v[0][slots] = k, v
    want, start = [], 0
    for p, row, n in zip(past, new, LENS, strict=True):
        ctx = torch.tensor(p + row, device=device)
        kc, vc = cache.k[0][ctx].float(), cache.v[0][ctx].float()
        qs = q[start : start + n].float()
        scores = torch.einsum("qhd,khd->hqk", qs, kc.repeat_interleave(H // KV, 1)) * D**-0.5
        allowed = (
            torch.arange(len(ctx), device=device)[None] <= (len(p) + torch.arange(n, device=device))[:, None]
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), vc.repeat_interleave(H // KV, 1))
        want.append(o.reshape(n, H * D))
        start += n
    return cache, (past if any(pasts) else None), slots, q, k, v, torch.cat(want)


def _run(cache, past, slots, q, k, v, *, varlen, give_kv):
    attend = PrefillAttention(
        cache, LENS, past, slots, head_dim=D, group=H // KV, scale=D**-0.5, varlen=varlen
    )
    return attend(0, q, k, v) if give_kv else attend(0, q)


@pytest.mark.parametrize("pasts", [PASTS, [0] * len(LENS)], ids=["cached-prefix", "no-prefix"])
@pytest.mark.parametrize("give_kv", [True, False], ids=["kv-given", "kv-from-pool"])
def test_padded_prefill_attention_is_each_sequences_causal_attention(pasts, give_kv):
    cache, past, slots, q, k, v, want = _case(torch.device("cpu"), torch.float32, pasts)
    got = _run(cache, past, slots, q, k, v, varlen=False, give_kv=give_kv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pasts", [PASTS, [0] * len(LENS)], ids=["cached-prefix", "no-prefix"])
def test_varlen_prefill_attention_matches_the_padded_way_on_gpu(pasts):
    dev = torch.device("cuda")
    cache, past, slots, q, k, v, want = _case(dev, torch.bfloat16, pasts)
    assert varlen_available(cache, D)
    varlen = _run(cache, past, slots, q, k, v, varlen=True, give_kv=True)
    padded = _run(cache, past, slots, q, k, v, varlen=False, give_kv=True)
    assert _run(cache, past, slots, q, k, v, varlen=True, give_kv=False).equal(varlen)
    torch.testing.assert_close(varlen.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(varlen.float(), padded.float(), atol=2e-2, rtol=2e-2)
