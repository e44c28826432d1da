"""Paged KV cache of the built-in engine: per layer one K and one V pool of `num_blocks × block_size`
token slots; a sequence owns a list of blocks (its block table) and grows one block at a time, so
memory follows actual lengths instead of `max_batch_size × context_length`.

Block 0 is scratch: never allocated, written by the padding rows of a captured decode graph.
"""

from __future__ import annotations

import math

import torch


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return math.ceil(tokens / block_size)


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than asked for (the scheduler retracts or waits)."""


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.scratch_block = 0
        self.num_layers = num_layers
        self.dtype = dtype
        self.shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate_pool()
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low block ids first
        self.bytes = 2 * num_layers * self.k[0].numel() * self.k[0].element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- the pool's memory (release_memory_occupation) -----------------------------------------------

    @property
    def allocated(self) -> bool:
        """Whether the pool tensors exist (False between free_pool and allocate_pool)."""
        return bool(self.k)

    def allocate_pool(self) -> None:
        """(Re)create the K and V pools at their one size, zeroed; no-op while they exist."""
        if self.k:
            return
        self.k = [
            torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.v = [
            torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]

    def free_pool(self) -> int:
        """Drop the K and V pools (every block must be free: the cached K/V is lost); returns the bytes
        dropped (0 when already dropped). The block bookkeeping stays, so the pool comes back as it was."""
        if not self.k:
            return 0
        if len(self._free) != self.capacity_blocks:
            raise RuntimeError(
                f"the KV pool is freed with {self.capacity_blocks - len(self._free)} blocks still held"
            )
        self.k, self.v = [], []
        return self.bytes

    # ---- allocation (the scheduler's thread only) --------------------------------------------------

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()

    def slot(self, blocks: list[int], pos: int) -> int:
        """Pool slot of token position `pos` of a sequence owning `blocks`."""
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, blocks: list[int], start: int, stop: int) -> list[int]:
        """Pool slots of token positions [start, stop) of a sequence owning `blocks`."""
        return [self.slot(blocks, p) for p in range(start, stop)]

    # ---- tensor access (inside forward passes) -----------------------------------------------------

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V at slots `src` copied to slots `dst` (a prompt computed once for several rows)."""
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of each row's blocks, in order: [B, MB·block_size, KV, D]."""
        B, MB = block_tables.shape
        bs = self.block_size
        k = self.k[layer].view(self.num_blocks, bs, *self.k[layer].shape[1:])[block_tables]
        v = self.v[layer].view(self.num_blocks, bs, *self.v[layer].shape[1:])[block_tables]
        return k.view(B, MB * bs, *k.shape[3:]), v.view(B, MB * bs, *v.shape[3:])
