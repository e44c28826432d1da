"""The engine's weight copies in one kernel (generator_fleet/engine/multi_copy.py): every tensor lands bit
for bit whatever its size (a chunk boundary inside a tensor, tensors smaller than one chunk), pairs the
kernel cannot take (a cast, byte counts off 16-byte multiples) go through the foreach copy, and a plan is
reused only for the same tensors: at once for the very list it last ran for, by comparison for another.
On CPU everything goes through the foreach copy; the kernel itself runs there under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from generator_fleet.engine import multi_copy
from generator_fleet.engine.multi_copy import BLOCK, WORD, MultiCopy
from weight_bus.ipc import NamedTensors

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pairs(device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    numels = [BLOCK * WORD // 2 * 3 + 8, 8, 1536, 16, 1536 * 256 + 24, BLOCK * WORD // 2]  # bf16 elements
    src = [torch.randn(n, generator=g).to(device, torch.bfloat16) for n in numels]
    src.append(torch.randn(12, generator=g).to(device, torch.bfloat16))  # 24 bytes: not 16-byte multiples
    src.append(torch.randn(64, generator=g).to(device))  # float32 into bfloat16: a cast
    dst = [torch.zeros(t.numel(), dtype=torch.bfloat16, device=device) for t in src]
    return [f"w{i}" for i in range(len(src))], dst, src


@pytest.mark.parametrize("device", DEVICES)
def test_every_tensor_lands_bit_for_bit_and_a_plan_is_reused_for_the_same_tensors(device):
    names, dst, src = _pairs(device, 0)
    by_name = dict(zip(names, dst, strict=True))

    def dst_of(ns):
        return [by_name[n] for n in ns]

    named = NamedTensors(zip(names, src, strict=True))
    mc = MultiCopy(enabled=True)
    for round_ in range(3):
        with torch.no_grad():
            torch._foreach_mul_(src, -1.5)  # in place: the same tensors, new values
        mc.copy(named if round_ else list(named), dst_of)  # a plain list first, then the kept one
        for i, (d, s) in enumerate(zip(dst, src, strict=True)):
            assert torch.equal(d, s.to(d.dtype)), (round_, i)
    if device == "cuda" and multi_copy.copy_kernel() is not None:
        assert mc.plans_built == 1
        assert mc.plan.source() is named
        assert mc.plan.rest == [6, 7]  # the odd-sized one and the cast: foreach
        words = [t.numel() * t.element_size() // WORD for t in src[:6]]
        assert mc.plan.chunks == sum(-(-w // BLOCK) for w in words) == 4 + 1 + 1 + 1 + 13 + 1
        other = [t.clone() for t in src]  # new addresses: a new plan
        mc.copy(list(zip(names, other, strict=True)), dst_of)
        assert mc.plans_built == 2
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dst, other, strict=True))
        mc.copy(named, dst_of)  # the list the first plan ran for: its tensors compared again
        assert mc.plans_built == 3
    else:
        assert mc.plan is None  # nothing to plan off CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_into_one_buffer_as_the_fused_projections_are():
    """Destinations that are row blocks of one fused buffer (q/k/v in qkv) take their rows only."""
    qkv = torch.zeros(96, 64, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv[:64], qkv[64:80], qkv[80:]
    src = [torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in (q, k, v)]
    views = {"q": q, "k": k, "v": v}
    MultiCopy(enabled=True).copy(list(zip("qkv", src, strict=True)), lambda ns: [views[n] for n in ns])
    assert torch.equal(qkv, torch.cat(src))


INTERPRETED = """
import sys
import torch
from generator_fleet.engine import multi_copy as m

assert "triton" not in sys.modules, "importing the engine's copy imported Triton"
kernel = m.copy_kernel()
src = [torch.randn(m.BLOCK * 4 + 8, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16)]
dst = [torch.zeros_like(t) for t in src]
words = [t.numel() * t.element_size() // m.WORD for t in dst]
pairs, starts = m.chunks(words)
table = torch.tensor([[t.data_ptr() for t in src], [t.data_ptr() for t in dst], words], dtype=torch.int64)
chunk_pair, chunk_start = torch.tensor(pairs, dtype=torch.int32), torch.tensor(starts, dtype=torch.int64)
kernel[(len(pairs),)](table[0], table[1], table[2], chunk_pair, chunk_start, BLOCK=m.BLOCK)
assert all(torch.equal(d, s) for d, s in zip(dst, src)), "a chunk did not land"
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernel (the tests above)")
def test_the_kernel_is_imported_at_its_first_use_and_copies_every_chunk_interpreted():
    """Triton's interpreter is chosen when triton is first imported: a fresh process with TRITON_INTERPRET=1
    runs the kernel on CPU (a tensor of several chunks, its last one partial, and one under a chunk)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-4000:]
