"""The Triton kernel of the engine's one-launch weight copy (engine/multi_copy.py, which imports this module
at its first copy on CUDA: an ImportError there means no Triton, and every copy goes through foreach)."""

import triton
import triton.language as tl


@triton.jit
def copy_chunks(src_ptrs, dst_ptrs, words, chunk_pair, chunk_start, BLOCK: tl.constexpr):
    """One chunk of one pair per program. The alignment hints (ALIGN, which the plan checked) and an
    unmasked body for whole chunks make every access 16 bytes wide."""
    pid = tl.program_id(0)
    pair = tl.load(chunk_pair + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)
    n = tl.multiple_of(tl.load(words + pair), 2)
    src = tl.multiple_of(tl.load(src_ptrs + pair).to(tl.pointer_type(tl.int64)), 16)
    dst = tl.multiple_of(tl.load(dst_ptrs + pair).to(tl.pointer_type(tl.int64)), 16)
    idx = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        tl.store(dst + idx, tl.load(src + idx))
    else:
        mask = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
