"""Packing the trainer's weights for the wire: (name, tensor) pairs into flat buckets of raw bytes
(SGLang's flattened_bucket load format), and each engine's ranks in the update group."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch

from weight_bus.group import dtype_name


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split (name, tensor) pairs, in order, into groups of at most bucket_bytes (a larger tensor alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return [b for b in out if b]


def flatten(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each tensor's raw bytes concatenated in order (SGLang's flattened_bucket load format)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the update group, and the group's size: the trainer is rank 0 and
    engine i's TP ranks follow the previous engines' (slime: rank_offset = 1 + GPUs before it)."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


class Bucket:
    """One flattened bucket: what the engines are told, the bytes, and its state on the wire."""

    __slots__ = (
        "calls", "dtypes", "flat", "index", "last", "names", "nbytes", "offsets", "payload", "shapes",
        "tensors", "times", "work",
    )  # fmt: skip

    def __init__(
        self,
        index: int,
        names,
        dtypes,
        shapes,
        flat: torch.Tensor | None,
        last: bool,
        offsets: list[int],
        tensors: list[torch.Tensor] | None = None,
        nbytes: int | None = None,
    ) -> None:
        self.index, self.names, self.dtypes, self.shapes = index, names, dtypes, shapes
        self.flat, self.last = flat, last
        self.tensors = tensors
        """The IPC backend's direct bucket: the trainer's own tensors, shared one handle each (no `flat`)."""
        if nbytes is None:
            nbytes = flat.numel() if flat is not None else sum(t.numel() * t.element_size() for t in tensors)
        self.nbytes = nbytes
        self.offsets = offsets
        """Each tensor's first byte in `flat`."""
        self.payload: str | None = None
        """The IPC backend's serialized handle to `flat` (weight_bus.ipc), made once per bucket."""
        self.work = None
        self.calls: dict[str, Future] = {}
        self.times = [0.0, 0.0, 0.0]
        """perf_counter at launch, broadcast seen done, every engine seen answered."""


def pack(
    named: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None,
    device: torch.device,
    alloc: Callable[[int, int], torch.Tensor] | None = None,
) -> Iterator[Bucket]:
    """Pull tensors lazily from `named` (cast to `dtype` if floating point, on `device`) and yield them
    packed into flat buckets of at most bucket_bytes, in order; a bucket is yielded once the next tensor
    does not fit (or `named` ends: then it is `last`). A bucket is packed by one torch.cat per run of one
    dtype (a copy per tensor costs ~25 us of launch overhead on CUDA: 7 ms for a 0.5B model's ~300
    tensors); meanwhile the trainer holds that bucket's gathered tensors. A tensor alone in its bucket
    that needs no cast or move is broadcast in place.

    `alloc(index, nbytes)`: the uint8 buffer bucket `index` is packed into (the IPC backend's reused
    ring); each run of one dtype then starts at a multiple of its element size, so that a receiver can
    view its bytes as that dtype (SGLang's FlattenedTensorBucket does)."""
    index = 0
    pending: list[tuple[str, torch.Tensor, torch.dtype]] = []
    size = 0
    for name, t in named:
        t = t.detach()
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        n = t.numel() * target.itemsize
        if pending and size + n > bucket_bytes:
            yield _packed(index, pending, device, False, alloc)
            index += 1
            pending, size = [], 0
        pending.append((name, t, target))
        size += n
    if pending:
        yield _packed(index, pending, device, True, alloc)


def _runs(tensors: list[tuple[str, torch.Tensor, torch.dtype]], align: bool) -> list[tuple[int, int, int]]:
    """(first, end, byte offset) of each run of tensors travelling as one dtype; `align`: each run
    starts at a multiple of its element size."""
    runs, off, i = [], 0, 0
    while i < len(tensors):
        target = tensors[i][2]
        j = i
        while j < len(tensors) and tensors[j][2] == target:
            j += 1
        if align:
            off = -(-off // target.itemsize) * target.itemsize
        runs.append((i, j, off))
        off += sum(t.numel() for _, t, _ in tensors[i:j]) * target.itemsize
        i = j
    return runs


def _packed(
    index: int,
    tensors: list[tuple[str, torch.Tensor, torch.dtype]],
    device: torch.device,
    last: bool,
    alloc: Callable[[int, int], torch.Tensor] | None = None,
) -> Bucket:
    names = [n for n, _, _ in tensors]
    dtypes = [dtype_name(d) for _, _, d in tensors]
    shapes = [list(t.shape) for _, t, _ in tensors]
    runs = _runs(tensors, align=alloc is not None)
    offsets = []
    for i, j, off in runs:
        for _, t, target in tensors[i:j]:
            offsets.append(off)
            off += t.numel() * target.itemsize
    size = offsets[-1] + tensors[-1][1].numel() * tensors[-1][2].itemsize
    if len(tensors) == 1 and alloc is None:
        _, t, target = tensors[0]
        if t.dtype == target and t.device == device and t.is_contiguous():
            return Bucket(index, names, dtypes, shapes, t.reshape(-1).view(torch.uint8), last, offsets)
    flat = torch.empty(size, dtype=torch.uint8, device=device) if alloc is None else alloc(index, size)
    for i, j, off in runs:  # one cat per run of tensors travelling as the same dtype
        target = tensors[i][2]
        run = [t.reshape(-1) if t.device == device else t.to(device).reshape(-1) for _, t, _ in tensors[i:j]]
        n = sum(t.numel() for t in run) * target.itemsize
        if off % target.itemsize == 0:
            torch.cat(run, out=flat[off : off + n].view(target))  # casts on the way in
        else:  # a mixed-dtype bucket left this run unaligned for `target`
            flat[off : off + n].copy_(torch.cat(run).to(target).view(torch.uint8))
    return Bucket(index, names, dtypes, shapes, flat, last, offsets)
