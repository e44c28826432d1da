"""Releasing and resuming the engine's device memory (SGLang's release_memory_occupation and
resume_memory_occupation), so a trainer on the same GPU can use it between generation phases.

Three kinds of memory, by SGLang's tags (python/sglang/srt/constants.py GPU_MEMORY_ALL_TYPES):
- `kv_cache`: the paged KV pool tensors (PagedKVCache.free_pool / allocate_pool, same size again);
- `weights`: the model's parameters and buffers, copied to host memory (pinned on CUDA) and dropped from
  the device, then copied back byte for byte (SGLang's --enable-weights-cpu-backup);
- `cuda_graph`: the captured decode graphs and their private memory pool (captured again, bucket by
  bucket, the first time a decode step needs one).
The Runner decides when (no step in flight, requests retracted); this module only moves the memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""Every tag, in SGLang's order; a request without tags means all of them."""


class WeightsReleased(RuntimeError):
    """A weight update reached an engine whose weights are released (resume "weights" first)."""


def resolve_tags(tags: Iterable[str] | None) -> list[str]:
    """The tags a release/resume body names (None or empty: all), each once, in TAGS order; ValueError
    names an unknown one."""
    if not tags:
        return list(TAGS)
    tags = list(tags)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: expected any of {list(TAGS)}")
    return [t for t in TAGS if t in tags]


def device_used_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds on a CUDA device (0 elsewhere)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def empty_cache(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the driver, so mem_get_info sees them free."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class WeightsBackup:
    """The model's parameters and buffers moved to host memory and back. Each tensor object stays the
    module's (only its `.data` changes), so modules, tied weights and optimizers' references hold;
    views taken before `offload` (a state_dict) keep the old storage and must be taken again after
    `restore`. On CUDA the pinned host buffers stay allocated after a restore and are reused by the next
    offload (pinning gigabytes takes seconds; a colocated engine releases every step)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pinned: dict[int, torch.Tensor] = {}
        """id(tensor) -> its pinned host buffer, kept between offloads."""

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Copy every parameter and buffer to host memory (pinned when on CUDA) and leave an empty tensor
        on the device in its place; returns the device bytes dropped (0 when already offloaded). On CPU
        the tensors themselves are kept (they are host memory already): nothing is copied."""
        if self._saved:
            return 0
        seen: set[int] = set()
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = 0
        on_cuda = False
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            data = t.data
            if data.device.type == "cuda":
                on_cuda = True
                host = self._pinned.get(id(t))
                if host is None or host.shape != data.shape or host.dtype != data.dtype:
                    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                    self._pinned[id(t)] = host
                host.copy_(data, non_blocking=True)
            else:
                host = data
            saved.append((t, host))
            total += data.numel() * data.element_size()
        if on_cuda:
            torch.cuda.synchronize()  # every copy has landed before the device memory goes
        for t, _ in saved:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._saved = saved
        return total

    def restore(self) -> int:
        """Put every offloaded tensor back on its device, bytes unchanged; returns the bytes restored."""
        total = 0
        on_cuda = False
        for t, host in self._saved:
            if t.device.type == "cuda":
                on_cuda = True
                t.data = host.to(t.device, non_blocking=True)
            else:
                t.data = host
            total += host.numel() * host.element_size()
        if on_cuda:
            torch.cuda.synchronize()  # the pinned buffers are written again only by the next offload
        self._saved = []
        return total
