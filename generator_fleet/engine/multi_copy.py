"""Many tensor copies as one kernel: a weight update copies hundreds of tensors (338 for a Qwen2.5-1.5B
shape), and `torch._foreach_copy_` over them runs at about 65% of one flat copy's bandwidth on an H200
(2.22 ms against 1.45 ms for 3.09 GB). A `CopyPlan` splits every (source, destination) pair into
fixed-size chunks and copies all of them in one Triton launch that reads each chunk's addresses from a
table on the device, with 16-byte accesses: 1.52 ms for the same tensors (benchmarks/probes/weight_copy.py,
nvidia-h200, 2026-11-25).

A plan is built once for a list of pairs and reused while the same tensors come again (a sender's
persistent buffers, whose payload the engine keeps: weight_bus.ipc.OpenedHandles). Pairs that differ in
dtype (a cast), are not contiguous, or whose addresses or sizes are not 16-byte multiples go through
`torch._foreach_copy_`; so does everything off CUDA or without Triton. SLIPSTREAM_ENGINE_COPY_KERNEL=0
turns the kernel off.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

WORD = 8
"""Bytes one element of the copy is (int64 words); each thread moves two at a time (16-byte accesses)."""
ALIGN = 16
"""Bytes every address and size the kernel takes is a multiple of (what lets it use 16-byte accesses)."""
BLOCK = 8192
"""Words per chunk: one program copies 64 KiB."""
NUM_WARPS = 8
ENABLE_ENV = "SLIPSTREAM_ENGINE_COPY_KERNEL"


@functools.cache
def copy_kernel():
    """The Triton kernel (engine/multi_copy_kernel.py), None without Triton. Imported at the first copy on
    CUDA: importing Triton costs an engine about 0.2 CPU-s at start, which one on CPU (every copy a
    foreach) need not spend."""
    try:
        from generator_fleet.engine.multi_copy_kernel import copy_chunks
    except ImportError:  # CPU installs: every copy goes through _foreach_copy_
        return None
    return copy_chunks


def chunks(words: list[int], block: int = BLOCK) -> tuple[list[int], list[int]]:
    """The kernel's launch table for pairs of `words` each: every chunk's pair index and first word."""
    pair_of_chunk, start_of_chunk = [], []
    for j, n in enumerate(words):
        starts = range(0, n, block)
        pair_of_chunk += [j] * len(starts)
        start_of_chunk += starts
    return pair_of_chunk, start_of_chunk


def _kernel_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    nbytes = src.numel() * src.element_size()
    return (
        src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.device == dst.device
        and nbytes % ALIGN == 0
        and src.data_ptr() % ALIGN == 0
        and dst.data_ptr() % ALIGN == 0
    )


class CopyPlan:
    """The copies of `pairs` (destination, source), split into one chunked kernel for the pairs it can
    take and a foreach copy for the rest. Valid while every tensor stays where it was (MultiCopy matches
    it to a load by `key`, or by `source`)."""

    def __init__(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        key: tuple,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
    ) -> None:
        self.key = key
        self.source: weakref.ref | None = None
        """The (name, tensor) list the plan was last run for, while it lives (MultiCopy.copy)."""
        self.block, self.num_warps = block, num_warps
        device = src[0].device if src else torch.device("cpu")
        fast = device.type == "cuda" and copy_kernel() is not None
        words = [d.numel() * d.element_size() // WORD for d in dst]
        kernel = [i for i, (d, s) in enumerate(zip(dst, src, strict=True)) if fast and _kernel_copyable(d, s)]
        self.rest = sorted(set(range(len(dst))) - set(kernel))
        self.rest_dst = [dst[i] for i in self.rest]
        self.rest_src = [src[i] for i in self.rest]
        self.chunks = 0
        self.kernel_bytes = sum(words[i] for i in kernel) * WORD
        if kernel:
            pair_of_chunk, start_of_chunk = chunks([words[i] for i in kernel], block)
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
            copy_kernel()[(self.chunks,)](
                self.src_ptrs,
                self.dst_ptrs,
                self.words,
                self.chunk_pair,
                self.chunk_start,
                BLOCK=self.block,
                num_warps=self.num_warps,
            )
        if self.rest:
            torch._foreach_copy_(self.rest_dst, self.rest_src)


class MultiCopy:
    """The engine's weight copies: the last plan is kept and reused while the same tensors come again.
    A plan holds addresses, not tensors (a sender buffer the engine closes is not kept mapped by it); it
    is matched by the destinations' names (parameters stay where they are until `clear`), the sources'
    addresses and dtypes (their sizes are the destinations', checked before any copy). A repeat of the
    very (name, tensor) list the plan last ran for (a payload the engine keeps mapped: the same list
    object, weakly referenced) matches without that comparison."""

    def __init__(self, enabled: bool | None = None, block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
        """`enabled`: use the kernel (None: unless SLIPSTREAM_ENGINE_COPY_KERNEL=0); else every copy is
        foreach. `block` (words per chunk) and `num_warps`: the kernel's launch shape."""
        self.enabled = os.environ.get(ENABLE_ENV, "1") != "0" if enabled is None else enabled
        self.block, self.num_warps = block, num_warps
        self.plan: CopyPlan | None = None
        self.plans_built = 0

    def copy(
        self,
        named: list[tuple[str, torch.Tensor]],
        dst_of: Callable[[list[str]], list[torch.Tensor]],
    ) -> None:
        """Copy every tensor of `named` into its destination (`dst_of(names)`, the same shapes)."""
        if not named:
            return
        plan = self.plan
        if plan is not None and plan.source is not None and plan.source() is named:
            plan.run()
            return
        names = [n for n, _ in named]
        src = [t for _, t in named]
        dst = dst_of(names)
        if not self.enabled or src[0].device.type != "cuda" or copy_kernel() is None:
            torch._foreach_copy_(dst, src)
            return
        key = (tuple(names), tuple(map(torch.Tensor.data_ptr, src)), tuple(t.dtype for t in src))
        if plan is None or plan.key != key:
            plan = self.plan = CopyPlan(dst, src, key, self.block, self.num_warps)
            self.plans_built += 1
            log.debug(
                "weight copy plan: %d tensors, %d chunks in one kernel (%.1f MB), %d by foreach",
                len(dst),
                plan.chunks,
                plan.kernel_bytes / 1e6,
                len(plan.rest),
            )
        try:
            plan.source = weakref.ref(named)
        except TypeError:  # a plain list: matched by its key next time
            plan.source = None
        plan.run()

    def clear(self) -> None:
        """Forget the plan (the weights moved: a release and resume re-allocates them)."""
        self.plan = None
