"""The Triton paged decode attention against the gather + SDPA path it replaces on CUDA: on CPU through
Triton's interpreter (small fp32 shapes), on GPU in bf16 (skipped without CUDA)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from generator_fleet.engine.kv_cache import PagedKVCache  # noqa: E402

CPU_CASES = [
    (4, 2, 16, [1, 17, 40], None),  # GQA group 2, partial blocks, a one-token row
    (6, 2, 24, [33, 5], 3),  # group 3 (padded heads), head_dim not a power of 2, more splits than need
    (2, 2, 32, [64, 16], 1),  # MHA, whole blocks, one split
]


def _reference(q, cache, layer, block_tables, seq_lens, scale):
    """The engine's gather + SDPA decode attention (model.py's CPU path)."""
    B, H, D = q.shape
    kc, vc = cache.gather(layer, block_tables)
    L = kc.shape[1]
    KV = kc.shape[2]
    mask = (torch.arange(L, device=q.device)[None] < seq_lens[:, None])[:, None, None]
    qg = q.view(B, KV, H // KV, D)
    o = torch.nn.functional.scaled_dot_product_attention(
        qg, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return o.reshape(B, H, D)


def _setup(device, dtype, *, B, H, KV, D, lens, block_size=16, mb=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lens]
    mb = mb or max(need)
    cache = PagedKVCache(
        num_layers=1,
        num_kv_heads=KV,
        head_dim=D,
        num_blocks=sum(need) + 2,
        block_size=block_size,
        dtype=dtype,
        device=torch.device(device),
    )
    cache.k[0].copy_(torch.randn(cache.shape, generator=g).to(dtype))
    cache.v[0].copy_(torch.randn(cache.shape, generator=g).to(dtype))
    # Blocks handed out interleaved across rows, so a row's blocks are not contiguous in the pool.
    tables = [[] for _ in lens]
    for step in range(max(need)):
        for i, n in enumerate(need):
            if step < n:
                tables[i] += cache.allocate(1)
    bt = torch.zeros((B, mb), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    q = torch.randn((B, H, D), generator=g).to(dtype)
    return cache, q.to(device), bt.to(device), torch.tensor(lens, dtype=torch.long, device=device)


def _check_cpu_case(H, KV, D, lens, splits):
    from generator_fleet.engine import decode_attention

    cache, q, bt, sl = _setup("cpu", torch.float32, B=len(lens), H=H, KV=KV, D=D, lens=lens, mb=5)
    scale = D**-0.5
    got = decode_attention.paged_decode_attention(
        q, cache.k[0], cache.v[0], bt, sl, block_size=16, scale=scale, num_splits=splits
    )
    want = _reference(q, cache, 0, bt, sl, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels (the GPU test)")
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_matches_gather_sdpa_on_cpu_interpreted(case):
    """Triton's interpreter is chosen when triton is first imported, so the cases run in a fresh process
    with TRITON_INTERPRET=1 (another test may have imported triton already)."""
    root = Path(__file__).resolve().parents[3]
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('t', {str(Path(__file__).resolve())!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"m._check_cpu_case(*m.CPU_CASES[{case}])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_gather_sdpa_on_gpu(dtype):
    lens = [1, 100, 257, 1000, 31, 512, 2048, 7]
    cache, q, bt, sl = _setup("cuda", dtype, B=len(lens), H=14, KV=2, D=64, lens=lens, mb=130)
    from generator_fleet.engine import decode_attention

    block = torch.zeros((len(lens), 4 + bt.shape[1] + 3), dtype=torch.long, device="cuda")
    block[:, 3] = sl
    block[:, 4 : 4 + bt.shape[1]] = bt
    got = decode_attention.paged_decode_attention(  # strided views, as DecodeGraphs passes them
        q, cache.k[0], cache.v[0], block[:, 4 : 4 + bt.shape[1]], block[:, 3], block_size=16, scale=0.125
    )
    want = _reference(q.float(), _f32(cache), 0, bt, sl, 0.125)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _f32(cache):
    cache.k = [t.float() for t in cache.k]
    cache.v = [t.float() for t in cache.v]
    return cache
