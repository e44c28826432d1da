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
    """The model's parameters and buffers moved to host memory and back, storage by storage: tensors that
    share one storage (the weight arena, engine/arena.py; fused projections) come back sharing one again,
    at the same offsets, so the arena's layout holds across a release. Each tensor object stays the
    module's (only its `.data` changes), so modules, tied weights and optimizers' references hold; views
    taken before `offload` (a state_dict) keep the old storage and must be taken again after `restore`.
    On CUDA the pinned host buffers stay allocated after a restore and are reused by the next offload
    (pinning gigabytes takes seconds; a colocated engine releases every step)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._saved: list[tuple[torch.Tensor, int, int, tuple, tuple]] = []
        """(tensor, index of its storage in _hosts, storage offset, size, stride) of each offloaded tensor."""
        self._hosts: list[tuple[torch.Tensor, torch.device]] = []
        """Each offloaded storage's bytes on the host (uint8) and the device it came from."""
        self._pinned: list[torch.Tensor] = []
        """Pinned host buffers, by storage position, kept between offloads."""

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Copy every parameter's and buffer's storage to host memory (pinned when on CUDA) and leave an
        empty tensor on the device in each one's place; returns the device bytes dropped (0 when already
        offloaded). On CPU the storages themselves are kept (they are host memory already): nothing is
        copied."""
        if self._saved:
            return 0
        seen: set[int] = set()
        index: dict[int, int] = {}
        saved, hosts = [], []
        total = 0
        on_cuda = False
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in index:
                index[key] = len(hosts)
                data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                if data.device.type == "cuda":
                    on_cuda = True
                    i = len(hosts)
                    if i >= len(self._pinned) or self._pinned[i].numel() != data.numel():
                        pinned = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
                        self._pinned[i : i + 1] = [pinned]
                    host = self._pinned[i]
                    host.copy_(data, non_blocking=True)
                else:
                    host = data
                hosts.append((host, t.device))
                total += data.numel()
            saved.append((t, index[key], t.storage_offset(), tuple(t.shape), t.stride()))
        if on_cuda:
            torch.cuda.synchronize()  # every copy has landed before the device memory goes
        for t, *_ in saved:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._saved, self._hosts = saved, hosts
        return total

    def restore(self) -> int:
        """Put every offloaded storage back on its device, bytes unchanged, and each tensor back into it
        at its offset; returns the bytes restored."""
        storages = []
        on_cuda = False
        for host, device in self._hosts:
            if device.type == "cuda":
                on_cuda = True
                storages.append(host.to(device, non_blocking=True).untyped_storage())
            else:
                storages.append(host.untyped_storage())
        for t, i, offset, size, stride in self._saved:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[i], offset, size, stride)
        total = sum(host.numel() for host, _ in self._hosts)
        if on_cuda:
            torch.cuda.synchronize()  # the pinned buffers are written again only by the next offload
        self._saved, self._hosts = [], []
        return total
