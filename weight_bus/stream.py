"""Streamed weight updates: the whole update in one call per engine, its buckets planned before it starts.

The per-bucket protocol (SGLang's: announce a bucket over HTTP, broadcast it, wait for the answer) costs
an HTTP round trip and an engine-side copy per bucket, and at 7B those dwarfed the wire. Once the bus
knows what the trainer sends (the names, shapes and dtypes of the last update: they do not change) and
every engine is a built-in one, it plans the buckets of an update up front and sends the plan in one
/update_weights_from_distributed call (`stream`); then it only broadcasts, bucket after bucket, each
packed while the one before is on the wire. Two plans:

- arena: the engines' weights sit in one arena of one layout (GET /weight_layout, the same digest on
  every engine). Each bucket is a byte range of that arena; the trainer casts each tensor straight to its
  place in the bucket, and the engines receive the broadcasts straight into their weights (no receive
  buffer, no copy). The buckets cover the arena end to end; tied names share their bytes.
- named: flattened buckets of named tensors as the per-bucket protocol sends them (the same packing), for
  engines without an arena, and for adapter-only (LoRA) updates.

An engine answers once the last bucket is in; the answer says how long its generation waited
(`paused_ms`). weight_bus/transfer.py runs the stream (Transfer._transfer_stream) and its recovery.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import torch

from weight_bus.errors import BusError
from weight_bus.group import dtype_from_name, dtype_name
from weight_bus.packing import Bucket
from weight_bus.schema import StreamBucket, WeightLayout

Sent = tuple[str, tuple[int, ...], torch.dtype]
"""What the trainer sent for one tensor: its name, shape and dtype (before any cast)."""


class Plan:
    """The buckets of every streamed update while the trainer's tensors and the engines stay the same."""

    def __init__(self, kind: str, buckets: list[StreamBucket], digest: str | None = None) -> None:
        self.kind = kind
        """"arena" (byte ranges of the engines' weight arena) or "named" (flattened named buckets)."""
        self.buckets = buckets
        self.digest = digest
        """arena: the WeightLayout digest the plan was made from."""
        self.slots: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        """arena: name -> (bucket index, byte offset in the bucket, dtype on the engine, shape)."""
        self.counts: list[int] = []
        """arena: tensors each bucket waits for."""


def arena_plan(layout: WeightLayout, sent: list[Sent], bucket_bytes: int) -> Plan | str:
    """Buckets of at most `bucket_bytes` (a larger tensor alone) that split `layout`'s arena end to end at
    tensor boundaries, each tensor of `sent` placed at its bytes; or why the trainer's tensors do not fill
    that arena (a name or shape the engine lacks, or engine weights nothing sent covers)."""
    where = {e.name: e for e in layout.entries}
    units: list[tuple[int, int, str]] = []
    for name, shape, _ in sent:
        e = where.get(name)
        if e is None:
            return f"the engines have no weight {name!r}"
        if tuple(e.shape) != tuple(shape):
            return f"{name}: the trainer's shape {list(shape)} is not the engines' {e.shape}"
        units.append((e.offset, _nbytes(e.shape, dtype_from_name(e.dtype)), name))
    units.sort()
    starts = [u[0] for u in units]
    for e in layout.entries:  # every engine weight lies within the bytes of one sent tensor
        i = bisect.bisect_right(starts, e.offset) - 1
        end = e.offset + _nbytes(e.shape, dtype_from_name(e.dtype))
        if i < 0 or units[i][0] + units[i][1] < end:
            return f"no tensor the trainer sends covers the engines' {e.name!r}"
    bounds = [0]
    for offset, n, _ in units:
        if offset + n - bounds[-1] > bucket_bytes and offset > bounds[-1]:
            bounds.append(offset)
    bounds.append(layout.nbytes)
    plan = Plan(
        "arena",
        [StreamBucket(offset=a, nbytes=b - a) for a, b in zip(bounds, bounds[1:], strict=False)],
        layout.digest,
    )
    plan.counts = [0] * len(plan.buckets)
    for offset, _, name in units:
        i = bisect.bisect_right(bounds, offset) - 1
        e = where[name]
        plan.slots[name] = (i, offset - bounds[i], dtype_from_name(e.dtype), tuple(e.shape))
        plan.counts[i] += 1
    return plan


def named_plan(sent: list[Sent], bucket_bytes: int, dtype: torch.dtype | None) -> Plan:
    """The flattened named buckets weight_bus.packing.pack makes of `sent` (same boundaries, same order)."""
    buckets: list[StreamBucket] = []
    size = 0
    for name, shape, src in sent:
        target = dtype if dtype is not None and src.is_floating_point else src
        n = _nbytes(shape, target)
        if not buckets or (buckets[-1].names and size + n > bucket_bytes):
            buckets.append(StreamBucket(nbytes=0))
            size = 0
        b = buckets[-1]
        b.names.append(name)
        b.dtypes.append(dtype_name(target))
        b.shapes.append(list(shape))
        size += n
        b.nbytes = size
    return Plan("named", buckets)


def pack_arena(plan: Plan, it: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[Bucket]:
    """The arena buckets of one update, in order, each yielded once every tensor of it came from `it`
    (tensors arrive in the trainer's order; a bucket may wait for a later one). Each tensor is held until
    its bucket is complete, then the bucket's tensors are cast into place with one multi-tensor copy."""
    n = len(plan.buckets)
    left = list(plan.counts)
    pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    flats: dict[int, torch.Tensor] = {}
    nxt = 0
    for name, t in it:
        slot = plan.slots.get(name)
        if slot is None:
            raise BusError(f"the trainer sent {name!r}, which the update's plan does not have")
        i, offset, dtype, shape = slot
        if i not in flats:
            flats[i] = torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=device)
        view = flats[i][offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
        pairs[i].append((view, t.detach().reshape(shape)))
        left[i] -= 1
        while nxt < n and left[nxt] <= 0:
            yield _filled(plan, nxt, flats.pop(nxt, None), pairs[nxt], device)
            pairs[nxt] = []
            nxt += 1
    if nxt < n:
        missing = [name for name, (i, *_) in plan.slots.items() if i >= nxt and left[i] > 0][:5]
        raise BusError(f"the trainer's tensors ended before the plan's: {missing} were not sent")


def _filled(plan: Plan, i: int, flat, pairs, device: torch.device) -> Bucket:
    if flat is None:  # a bucket with no tensor of its own (cannot happen: each starts at one)
        flat = torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=device)
    with torch.no_grad():
        same = [(d, s) for d, s in pairs if d.dtype == s.dtype and s.device == device]
        if same:
            torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
        for d, s in pairs:
            if d.dtype != s.dtype or s.device != device:
                d.copy_(s)
    b = plan.buckets[i]
    return Bucket(i, [], [], [], flat, i == len(plan.buckets) - 1, [b.offset])


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
