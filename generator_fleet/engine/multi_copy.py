"""Many tensor copies as one kernel: a weight update copies hundreds of tensors (338 for a Qwen2.5-1.5B
shape), and `torch._foreach_copy_` over them runs at about 60% of one flat copy's bandwidth on an H200
(2.3-2.5 ms against 1.47 ms for 3.1 GB). A `CopyPlan` splits every (source, destination) pair into
fixed-size chunks and copies all of them in one Triton launch that reads each chunk's addresses from a
table on the device, so the copy runs at flat-copy speed whatever the tensors' sizes.

A plan is built once for a list of pairs and reused while the same tensors come again (a sender's
persistent buffers, whose payload the engine keeps: weight_bus.ipc.OpenedHandles). Pairs that differ in
dtype (a cast), are not contiguous, or whose addresses or sizes do not fall on 8-byte words go through
`torch._foreach_copy_` as before; so does everything off CUDA or without Triton.

Off unless SLIPSTREAM_ENGINE_COPY_KERNEL=1: the kernel is not yet measured on a GPU
(benchmarks/probes/weight_copy.py times it against both copies; tests/generator_fleet/test_multi_copy.py
checks it there).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

WORD = 8
"""Bytes one element of the copy moves (int64 words)."""
BLOCK = 8192
"""Words per chunk: one program copies 64 KiB."""
ENABLE_ENV = "SLIPSTREAM_ENGINE_COPY_KERNEL"

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: every copy goes through _foreach_copy_
    triton = None

if triton is not None:

    @triton.jit
    def _copy_chunks(src_ptrs, dst_ptrs, words, chunk_pair, chunk_start, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        pair = tl.load(chunk_pair + pid)
        start = tl.load(chunk_start + pid)
        n = tl.load(words + pair)
        src = tl.load(src_ptrs + pair).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + pair).to(tl.pointer_type(tl.int64))
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def _word_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    nbytes = src.numel() * src.element_size()
    return (
        src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.device == dst.device
        and nbytes % WORD == 0
        and src.data_ptr() % WORD == 0
        and dst.data_ptr() % WORD == 0
    )


class CopyPlan:
    """The copies of `pairs` (destination, source), split into one chunked kernel for the pairs it can
    take and a foreach copy for the rest. Valid while every tensor stays where it was (`matches`)."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor], key: tuple) -> None:
        self.key = key
        device = src[0].device if src else torch.device("cpu")
        fast = triton is not None and device.type == "cuda"
        words = [d.numel() * d.element_size() // WORD for d in dst]
        kernel = [i for i, (d, s) in enumerate(zip(dst, src, strict=True)) if fast and _word_copyable(d, s)]
        self.rest = sorted(set(range(len(dst))) - set(kernel))
        self.rest_dst = [dst[i] for i in self.rest]
        self.rest_src = [src[i] for i in self.rest]
        self.chunks = 0
        self.kernel_bytes = sum(words[i] for i in kernel) * WORD
        if kernel:
            pair_of_chunk, start_of_chunk = [], []
            for j, i in enumerate(kernel):
                starts = range(0, words[i], BLOCK)
                pair_of_chunk += [j] * len(starts)
                start_of_chunk += starts
            table = torch.tensor(
                [
                    [src[i].data_ptr() for i in kernel],
                    [dst[i].data_ptr() for i in kernel],
                    [words[i] for i in kernel],
                ],
                dtype=torch.int64,
            ).to(device)
            self.src_ptrs, self.dst_ptrs, self.words = table[0], table[1], table[2]
            self.chunk_pair = torch.tensor(pair_of_chunk, dtype=torch.int32).to(device)
            self.chunk_start = torch.tensor(start_of_chunk, dtype=torch.int64).to(device)
            self.chunks = len(pair_of_chunk)

    def run(self) -> None:
        """Queue every copy on the current stream."""
        if self.chunks:
            _copy_chunks[(self.chunks,)](
                self.src_ptrs,
                self.dst_ptrs,
                self.words,
                self.chunk_pair,
                self.chunk_start,
                BLOCK=BLOCK,
                num_warps=8,
            )
        if self.rest:
            torch._foreach_copy_(self.rest_dst, self.rest_src)


class MultiCopy:
    """The engine's weight copies: the last plan is kept and reused while the same tensors come again.
    A plan holds addresses, not tensors (a sender buffer the engine closes is not kept mapped by it); it
    is matched by the destinations' names (parameters stay where they are until `clear`), the sources'
    addresses and dtypes (their sizes are the destinations', checked before any copy)."""

    def __init__(self, enabled: bool | None = None) -> None:
        """`enabled`: use the kernel (None: SLIPSTREAM_ENGINE_COPY_KERNEL=1); else every copy is foreach."""
        self.enabled = os.environ.get(ENABLE_ENV) == "1" if enabled is None else enabled
        self.plan: CopyPlan | None = None
        self.plans_built = 0

    def copy(self, names: list[str], dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if not dst:
            return
        if not self.enabled or src[0].device.type != "cuda" or triton is None:
            torch._foreach_copy_(dst, src)
            return
        key = (tuple(names), tuple(map(torch.Tensor.data_ptr, src)), tuple(t.dtype for t in src))
        if self.plan is None or self.plan.key != key:
            self.plan = CopyPlan(dst, src, key)
            self.plans_built += 1
            log.debug(
                "weight copy plan: %d tensors, %d chunks in one kernel (%.1f MB), %d by foreach",
                len(dst),
                self.plan.chunks,
                self.plan.kernel_bytes / 1e6,
                len(self.plan.rest),
            )
        self.plan.run()

    def clear(self) -> None:
        """Forget the plan (the weights moved: a release and resume re-allocates them)."""
        self.plan = None
