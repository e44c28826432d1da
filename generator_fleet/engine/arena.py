"""The engine's weights in one contiguous buffer (the weight arena), so that a weight update can be
received straight into them: a trainer that knows the layout (`WeightLayout`, GET /weight_layout) packs
each bucket as a byte range of the arena, and the engine's receive of that broadcast is the whole load —
no receive buffer, no copy kernel, and the pause is the wire's time (weight_bus/stream.py).

Blocks follow the HF state_dict order; each layer's q/k/v (and gate/up) weights form one block whose rows
are the fused projection the forward pass runs (the HF parameters are views of it), so fusing costs no
extra memory either. Every block starts ALIGN-aligned; the bytes between blocks are unused.

The arena survives a release and resume of the weights (memory.WeightsBackup moves storages, not
tensors): `lay_out` finds the tensors already in place and only takes the fused views again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import msgspec
import torch

from weight_bus.schema import LayoutEntry, WeightLayout

log = logging.getLogger(__name__)

ALIGN = 256
"""Bytes each block starts at a multiple of: any dtype's alignment, and what GEMM kernels like."""


class Arena:
    """The arena's buffer, its layout, and the fused blocks' views (in the order of `groups`)."""

    def __init__(self, buffer: torch.Tensor, layout: WeightLayout, fused: list[torch.Tensor]) -> None:
        self.buffer = buffer
        self.layout = layout
        self.fused = fused

    def range(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the arena, as a uint8 view (where a broadcast lands)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.buffer.numel():
            raise ValueError(
                f"arena range [{offset}, {offset + nbytes}) is outside the engine's {self.buffer.numel()}-byte arena"
            )
        return self.buffer[offset : offset + nbytes]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def lay_out(model: torch.nn.Module, groups: Sequence[Sequence[torch.Tensor]]) -> Arena | None:
    """Put every parameter and persistent buffer of `model` into one arena (each tensor object keeps its
    identity; only its `.data` moves) and return it, or None when the model cannot be laid out (a
    non-contiguous tensor, or tensors on several devices), in which case nothing moved.

    `groups`: tensors to place back to back as one block (same dtype and trailing shape), in order; the
    arena's `fused` holds one view per group, their rows concatenated (the fused q/k/v and gate/up
    weights). Tensors already laid out as planned (after a resume) are not copied again."""
    named = model.state_dict(keep_vars=True)
    tensors: dict[int, torch.Tensor] = {}
    first: dict[int, int] = {}
    for i, t in enumerate(named.values()):
        tensors.setdefault(id(t), t)
        first.setdefault(id(t), i)
    if not tensors:
        return None
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or any(not t.is_contiguous() for t in tensors.values()):
        log.info("weights not laid out in one arena: %d devices, or non-contiguous tensors", len(devices))
        return None
    device = devices.pop()
    in_group = {id(t) for g in groups for t in g}
    if not in_group <= set(tensors):
        raise ValueError("a fused group holds a tensor that is not one of the model's parameters or buffers")
    blocks: list[list[torch.Tensor]] = [[t] for k, t in tensors.items() if k not in in_group]
    blocks += [list(g) for g in groups]
    blocks.sort(key=lambda b: min(first[id(t)] for t in b))
    offsets: dict[int, int] = {}
    block_at: list[int] = []
    size = 0
    for block in blocks:
        size = _align(size)
        block_at.append(size)
        for t in block:
            offsets[id(t)] = size
            size += t.numel() * t.element_size()
    size = _align(size)
    buffer = _existing(tensors.values(), offsets, size)
    if buffer is None:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for t in tensors.values():
                view = _view(buffer, offsets[id(t)], t.dtype, t.shape)
                view.copy_(t.data)
                t.data = view  # the old storage goes once nothing else holds it
    fused = []
    for g in groups:
        rows = sum(t.shape[0] for t in g)
        fused.append(_view(buffer, offsets[id(g[0])], g[0].dtype, (rows, *g[0].shape[1:])))
    entries = [
        LayoutEntry(name, offsets[id(t)], str(t.dtype).removeprefix("torch."), list(t.shape))
        for name, t in named.items()
    ]
    digest = hashlib.sha256(msgspec.msgpack.encode([size, entries])).hexdigest()[:16]
    return Arena(buffer, WeightLayout(nbytes=size, entries=entries, digest=digest), fused)


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return buffer[offset : offset + n].view(dtype).view(shape)


def _existing(tensors, offsets: dict[int, int], size: int) -> torch.Tensor | None:
    """The arena the tensors already sit in as planned (one storage of `size` bytes, each tensor at its
    offset), as a uint8 tensor over that storage; None when they do not."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != 1:
        return None
    t0 = next(iter(tensors))
    storage = t0.untyped_storage()
    if storage.nbytes() != size:
        return None
    base = storage.data_ptr()
    if any(t.data_ptr() - base != offsets[id(t)] for t in tensors):
        return None
    return torch.empty(0, dtype=torch.uint8, device=t0.device).set_(storage, 0, (size,), (1,))


def projections(decoder) -> tuple[list, list[list[torch.Tensor]] | None, list[tuple[str, int]]]:
    """Each layer's (index, q/k/v modules, gate/up modules); the tensors the arena fuses into blocks (the
    weights of each, and the biases where all have one), None when some projections of a group have a
    bias and others not (the fused bias then needs zero rows no tensor holds: no arena); and each block's
    (kind, layer)."""
    layers = [
        (
            i,
            [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            [layer.mlp.gate_proj, layer.mlp.up_proj],
        )
        for i, layer in enumerate(decoder.layers)
    ]
    mixed = any(0 < sum(m.bias is not None for m in mods) < len(mods) for _, *pair in layers for mods in pair)
    groups: list[list[torch.Tensor]] = []
    kinds: list[tuple[str, int]] = []
    for i, qkv, gate_up in layers:
        for kind, mods in (("qkv", qkv), ("gate_up", gate_up)):
            groups.append([m.weight for m in mods])
            kinds.append((kind + "_w", i))
            if mods[0].bias is not None:
                groups.append([m.bias for m in mods])
                kinds.append((kind + "_b", i))
    return layers, None if mixed else groups, kinds


def lay_out_weights(model: torch.nn.Module) -> Arena | None:
    """The model's weights in one arena, the fused projections' blocks adjacent (engine/arena.py); a
    no-op past the first call. The runner calls it right after loading the model, before the KV pool takes
    the free memory (laying out holds two copies of the weights for a moment); PagedForward then finds the
    arena in place. The model must be one engine/model.py supports (check_supported)."""
    _, groups, _ = projections(model.model)
    return lay_out(model, groups) if groups is not None else None
