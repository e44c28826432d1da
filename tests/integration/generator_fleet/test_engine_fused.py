"""The engine's fused decode pieces: the Triton kernels of fused_ops.py against the PyTorch ops they
replace (on CPU through Triton's interpreter, on GPU in bf16), and the fused q/k/v and gate/up weights:
the HF parameters are views into them, so a weight update by HF name (and a release/resume of the
weights) changes the engine's outputs exactly as it changes the HF model's."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_engine_model import build_noisy_model, greedy_reference

from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner


def _reference_ops(device, dtype, seed):
    """Random inputs, the fused kernels' results and the PyTorch references, as (name, got, want) pairs."""
    from generator_fleet.engine import fused_ops

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(dtype).to(device)

    out = []
    T, N = 5, 96
    x, res, w = rnd(T, N), rnd(T, N), rnd(N)
    got, h = fused_ops.add_rms_norm(x, res, w, 1e-6)
    href = (x.float() + res.float()).to(dtype)
    out.append(("add_rms_norm.h", h, href))
    out.append(("add_rms_norm", got, F.rms_norm(href.float(), (N,), w.float(), 1e-6)))
    got, h = fused_ops.add_rms_norm(x, None, w, 1e-6)
    assert h is x
    out.append(("rms_norm", got, F.rms_norm(x.float(), (N,), w.float(), 1e-6)))

    B, H, KV, D, P = 3, 4, 2, 16, 40
    qkv = rnd(B, (H + 2 * KV) * D)
    pos = torch.tensor([0, 7, 39], device=device)
    ang = torch.rand((P, D // 2), generator=g).to(device) * 6.0
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    sin_signed = torch.cat([-sin[:, : D // 2], sin[:, D // 2 :]], -1).to(dtype)
    k_pool, v_pool = rnd(20, KV, D), rnd(20, KV, D)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    slots = torch.tensor([3, 0, 17], device=device)
    q = fused_ops.rope_kv_write(qkv, pos, cos, sin_signed, slots, k_pool, v_pool, H)
    qr, kr, vr = qkv.float().split([H * D, KV * D, KV * D], -1)
    c, s = cos[pos].float()[:, None], sin_signed[pos].float()[:, None]

    def rope(t, heads):
        t = t.view(B, heads, D)
        return t * c + t.roll(D // 2, -1) * s

    k_ref[slots] = rope(kr, KV).to(dtype)
    v_ref[slots] = vr.view(B, KV, D).to(dtype)
    out += [("rope.q", q, rope(qr, H)), ("rope.k_pool", k_pool, k_ref), ("rope.v_pool", v_pool, v_ref)]

    gu = rnd(T, 2 * 1100)
    gate, up = gu.float().chunk(2, -1)
    out.append(("silu_mul", fused_ops.silu_mul(gu), F.silu(gate) * up))
    return out


def _check_ops(device, dtype, tol):
    for name, got, want in _reference_ops(device, dtype, seed=0):
        assert got.shape == want.shape, name
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < tol, f"{name}: relative error {err}"
    _check_sampling(device)


def _check_sampling(device):
    """Greedy rows: the argmax and its logprob; temperature rows: the chosen token's logprob under
    softmax(logits / T), and draws whose frequencies match that distribution."""
    from generator_fleet.engine import fused_ops

    g = torch.Generator().manual_seed(5)
    B, V = 6, 5000  # several vocabulary splits
    logits = (torch.randn((B, V), generator=g) * 3).to(device)
    logits[1, 4321] = logits[1, 17] = 50.0  # a tie: the lower id wins, as torch.argmax
    temps = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.5, -1.0], device=device)
    seed = torch.tensor([1234], device=device)
    out = fused_ops.sample_rows(logits, temps, seed).cpu()
    tok = out[:, 0].long()
    greedy = (temps <= 0).cpu()
    assert torch.equal(tok[greedy], logits.argmax(-1).cpu()[greedy])
    assert tok[1] == 17
    scaled = logits.cpu() / torch.where(greedy, 1.0, temps.cpu())[:, None]
    want = torch.log_softmax(scaled.double(), -1).gather(1, tok[:, None]).squeeze(1)
    assert (out[:, 1] - want).abs().max() < 1e-4
    again = fused_ops.sample_rows(logits, temps, seed).cpu()
    assert torch.equal(again, out)  # the same seed draws the same tokens

    n, T = (20000, 0.7) if device == "cuda" else (500, 0.7)  # the interpreter draws ~20 rows/s
    row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    draws = (
        fused_ops.sample_rows(
            row.repeat(n, 1).to(device), torch.full((n,), T, device=device), torch.tensor([99], device=device)
        )[:, 0]
        .long()
        .cpu()
    )
    freq = torch.bincount(draws, minlength=6).double() / n
    p = torch.softmax(row.double() / T, -1)
    assert (freq - p).abs().max() < 2 / n**0.5, (freq, p)  # 4 standard deviations at most


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels (the GPU test)")
def test_fused_kernels_match_torch_on_cpu_interpreted():
    """In a fresh process: Triton picks its interpreter when first imported."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    code = "import torch\nfrom test_engine_fused import _check_ops\n_check_ops('cpu', torch.float32, 1e-6)\n"
    path = os.pathsep.join(map(str, (root, root / "tests" / "harness", Path(__file__).parent)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_kernels_match_torch_on_gpu():
    _check_ops("cuda", torch.bfloat16, 1e-2)
    _check_ops("cuda", torch.float32, 1e-5)


def _check_prefill(model_dir: str, device: str, dtype: torch.dtype, tol: float) -> None:
    """The fused prefill (engine/fused_forward.py) against the PyTorch-op prefill of the same forward:
    hidden states and the K/V written to the pools, for packed prompts of different lengths."""
    from generator_fleet.engine import fused_forward

    runner = Runner(model_dir, device=device, dtype=dtype, context_length=256, max_batch_size=8)
    fwd, cache = runner.fwd, runner.cache
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 15, (n,), generator=g).tolist() for n in (5, 23, 1, 17)]
    blocks = [cache.allocate((len(s) + cache.block_size) // cache.block_size) for s in seqs]
    flat = [x for b, s in zip(blocks, seqs, strict=True) for x in cache.slots(b, 0, len(s))]
    slots = torch.tensor(flat, dtype=torch.long, device=device)
    fwd._fused_prefill = False
    with torch.inference_mode():
        want = fwd.prefill(seqs, slots)
        kv_want = [(cache.k[i][slots].clone(), cache.v[i][slots].clone()) for i in range(len(cache.k))]
        for t in (*cache.k, *cache.v):
            t.zero_()
        fwd._fused_prefill = True
        got = fwd.prefill(seqs, slots)
    runner.stop()

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert got.shape == want.shape and rel(got, want) < tol, rel(got, want)
    for i, (k, v) in enumerate(kv_want):
        assert rel(cache.k[i][slots], k) < tol and rel(cache.v[i][slots], v) < tol, i
    assert fused_forward.prefill  # the path under test


def _check_prefix_prefill(model_dir: str, device: str, dtype: torch.dtype, tol: float, fused: bool) -> None:
    """A prefill after cached prefixes (the prefix cache's: `past`) against one prefill of the whole
    sequences: the new tokens' hidden states and the K/V they write, fused or PyTorch-op."""
    runner = Runner(model_dir, device=device, dtype=dtype, context_length=256, max_batch_size=8)
    fwd, cache = runner.fwd, runner.cache
    g = torch.Generator().manual_seed(12)
    seqs = [torch.randint(3, 15, (n,), generator=g).tolist() for n in (21, 40, 17, 33)]
    cut = [16, 32, 0, 5]  # cached tokens before each (0: a row without a prefix in the same batch)
    blocks = [cache.allocate((len(s) + cache.block_size) // cache.block_size) for s in seqs]
    slots_of = [cache.slots(b, 0, len(s)) for b, s in zip(blocks, seqs, strict=True)]
    flat = torch.tensor([x for sl in slots_of for x in sl], dtype=torch.long, device=device)
    fwd._fused_prefill = False
    with torch.inference_mode():
        want = fwd.prefill(seqs, flat)
        kv_want = [(cache.k[i][flat].clone(), cache.v[i][flat].clone()) for i in range(len(cache.k))]
        for t in (*cache.k, *cache.v):
            t.zero_()
        fwd._fused_prefill = fused
        heads = [i for i, c in enumerate(cut) if c]
        head_slots = [x for i in heads for x in slots_of[i][: cut[i]]]
        fwd.prefill([seqs[i][: cut[i]] for i in heads], torch.tensor(head_slots, device=device))
        tail_slots = [x for sl, c in zip(slots_of, cut, strict=True) for x in sl[c:]]
        got = fwd.prefill(
            [s[c:] for s, c in zip(seqs, cut, strict=True)],
            torch.tensor(tail_slots, device=device),
            past=[sl[:c] for sl, c in zip(slots_of, cut, strict=True)],
        )
    runner.stop()
    starts = [0, *itertools.accumulate(len(s) for s in seqs)][:-1]
    rows = [st + j for st, s, c in zip(starts, seqs, cut, strict=True) for j in range(c, len(s))]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(got, want[rows]) < tol, rel(got, want[rows])
    for i, (k, v) in enumerate(kv_want):
        assert rel(cache.k[i][flat], k) < tol and rel(cache.v[i][flat], v) < tol, i


def test_a_prefill_after_a_cached_prefix_matches_the_whole_prefill(model_dir):
    """The PyTorch-op path (the fused one: the interpreted and GPU tests below)."""
    _check_prefix_prefill(str(model_dir), "cpu", torch.float32, 1e-5, fused=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels (the GPU test)")
def test_fused_prefill_matches_the_torch_prefill_on_cpu_interpreted(model_dir):
    """In a fresh process: Triton picks its interpreter when first imported."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    code = (
        "import sys, torch\nfrom test_engine_fused import _check_prefill, _check_prefix_prefill\n"
        "_check_prefill(sys.argv[1], 'cpu', torch.float32, 1e-5)\n"
        "_check_prefix_prefill(sys.argv[1], 'cpu', torch.float32, 1e-5, fused=True)\n"
    )
    path = os.pathsep.join(map(str, (root, root / "tests" / "harness", Path(__file__).parent)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_prefill_matches_the_torch_prefill_on_gpu(model_dir):
    _check_prefill(str(model_dir), "cuda", torch.bfloat16, 2e-2)
    _check_prefill(str(model_dir), "cuda", torch.float32, 1e-5)
    for fused in (False, True):
        _check_prefix_prefill(str(model_dir), "cuda", torch.bfloat16, 2e-2, fused)
        _check_prefix_prefill(str(model_dir), "cuda", torch.float32, 1e-5, fused)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused")
    build_noisy_model(path, seed=3)
    return path


def _layer_params(model, i):
    layer = model.model.layers[i]
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]


def _assert_fused(runner):
    fwd = runner.fwd
    for i in range(len(runner.model.model.layers)):
        qkv, gu = _layer_params(runner.model, i)
        for mods, fused in ((qkv, fwd.qkv_w[i]), (gu, fwd.gate_up_w[i])):
            off = 0
            for m in mods:
                assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                assert torch.equal(m.weight, fused[off : off + m.weight.shape[0]])
                off += m.weight.shape[0]


def _greedy(runner, prompts, n):
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    futs = [runner.submit(Request(f"g{i}-{id(p)}", p, sp)) for i, p in enumerate(prompts)]
    return [f.result(120).output_ids for f in futs]


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_weight_update_by_hf_name_reaches_fused_weights(model_dir, device):
    runner = Runner(str(model_dir), device=device, dtype=torch.float32, context_length=256, max_batch_size=4)
    runner.start()
    try:
        _assert_fused(runner)
        ref = copy.deepcopy(runner.model).cpu()  # an unfused copy the updates are applied to directly
        prompts = [runner.tokenizer.encode(p) for p in ("12+7=", "3+45=")]
        before = _greedy(runner, prompts, 6)
        assert before == [greedy_reference(ref, p, 6) for p in prompts]

        g = torch.Generator().manual_seed(7)
        named = dict(ref.named_parameters())
        updates = []
        for name in (
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.bias",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ):
            t = named[name].detach() + torch.randn(named[name].shape, generator=g)
            updates.append((name, t))
            with torch.no_grad():
                named[name].copy_(t)
        runner.load_weights(updates, weight_version="1")
        _assert_fused(runner)
        after = _greedy(runner, prompts, 6)
        want = [greedy_reference(ref, p, 6) for p in prompts]
        assert after == want and after != before

        # weights to host memory and back: the parameters are fused again and updates still land
        runner.release_memory(["weights"])
        runner.resume_memory(["weights"])
        _assert_fused(runner)
        assert _greedy(runner, prompts, 6) == want
        name = "model.layers.0.mlp.gate_proj.weight"
        t = named[name].detach() * -1.0
        with torch.no_grad():
            named[name].copy_(t)
        runner.load_weights([(name, t)], weight_version="2")
        assert _greedy(runner, prompts, 6) == [greedy_reference(ref, p, 6) for p in prompts]
    finally:
        runner.stop()
