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
import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, wait

import torch

from weight_bus.errors import BusError, UpdateFailed, _error
from weight_bus.group import broadcast_async, dtype_from_name, dtype_name
from weight_bus.packing import Bucket
from weight_bus.receiver import FLATTENED_BUCKET
from weight_bus.schema import StreamBucket, UpdateWeightsFromDistributed, WeightLayout

log = logging.getLogger(__name__)

POLL_S = 1e-4
"""How often an unfinished broadcast is checked (and the engines' calls for an early error)."""

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
        self.slots_of: list[torch.Tensor | None] = []
        """arena: the trainer's reused bucket buffers (bucket i packs into slot i % len), made at first use."""
        self.busy: list[int | None] = []
        """arena: the bucket each slot holds until its broadcast is done (None: free)."""
        self.views: dict[str, torch.Tensor] = {}
        """arena: each tensor's place in its bucket's slot, taken once."""


class Recorder:
    """Passes the trainer's (name, tensor) pairs through and notes what was sent (name, shape, dtype);
    `complete` once the iterator ran out."""

    def __init__(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.it, self.sent, self.complete = it, [], False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.it:
            self.sent.append((name, tuple(t.shape), t.dtype))
            yield name, t
        self.complete = True


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


SLOTS_BEYOND_INFLIGHT = 2
"""Bucket buffers the trainer keeps beyond max_inflight: the bucket being packed, and one whose tensors
come early (the trainer's order puts a layer's biases after its fused weights' rows)."""


def pack_arena(
    plan: Plan, it: Iterator[tuple[str, torch.Tensor]], device: torch.device, inflight: int
) -> Iterator[Bucket]:
    """The arena buckets of one update, in order, each yielded once every tensor of it came from `it`
    (tensors arrive in the trainer's order; a bucket may wait for a later one). Each tensor is held until
    its bucket is complete, then the bucket's tensors are cast into place with one multi-tensor copy.
    Buckets pack into `inflight` + SLOTS_BEYOND_INFLIGHT buffers reused across updates (each tensor's
    view into its slot taken once); a slot still on the wire is never written (a fresh buffer instead).
    The caller releases a bucket's slot (`release`) once its broadcast is done."""
    n = len(plan.buckets)
    if not plan.slots_of:
        plan.slots_of = [None] * min(n, inflight + SLOTS_BEYOND_INFLIGHT)
    plan.busy = [None] * len(plan.slots_of)  # the last update's broadcasts are done (or their group gone)
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
            flats[i] = _buffer(plan, i, device)
        in_slot = flats[i] is plan.slots_of[i % len(plan.slots_of)]  # else a fresh buffer: no cached view
        view = plan.views.get(name) if in_slot else None
        if view is None:
            view = flats[i][offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
            if in_slot:
                plan.views[name] = view
        t = t.detach()
        pairs[i].append((view, t if t.shape == view.shape else t.reshape(shape)))
        left[i] -= 1
        while nxt < n and left[nxt] <= 0:
            flat = flats.pop(nxt) if nxt in flats else _buffer(plan, nxt, device)
            yield _filled(plan, nxt, flat, pairs[nxt], device)
            pairs[nxt] = []
            nxt += 1
    if nxt < n:
        missing = [name for name, (i, *_) in plan.slots.items() if i >= nxt and left[i] > 0][:5]
        raise BusError(f"the trainer's tensors ended before the plan's: {missing} were not sent")


def release(plan: Plan, b: Bucket) -> None:
    """Bucket b's broadcast is done: its slot may be packed again."""
    k = b.index % len(plan.slots_of) if plan.slots_of else 0
    if plan.busy and plan.busy[k] == b.index:
        plan.busy[k] = None


def _buffer(plan: Plan, i: int, device: torch.device) -> torch.Tensor:
    """Bucket i's buffer: its slot when free (made at the largest bucket's size the first time), else a
    fresh one (a slot is never written while its bucket may still be on the wire)."""
    k = i % len(plan.slots_of)
    if plan.busy[k] is not None:
        return torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=device)
    if plan.slots_of[k] is None:
        size = max(b.nbytes for b in plan.buckets)
        plan.slots_of[k] = torch.empty(size, dtype=torch.uint8, device=device)
    plan.busy[k] = i
    return plan.slots_of[k]


def _filled(plan: Plan, i: int, flat, pairs, device: torch.device) -> Bucket:
    with torch.no_grad():
        same = [(d, s) for d, s in pairs if d.dtype == s.dtype and s.device == device]
        if same:
            torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
        for d, s in pairs:
            if d.dtype != s.dtype or s.device != device:
                d.copy_(s)
    b = plan.buckets[i]
    return Bucket(i, [], [], [], flat[: b.nbytes], i == len(plan.buckets) - 1, [b.offset])


def run_stream(tr, plan: Plan, first: Bucket | None, stream: Iterator[Bucket], version: int):
    """One streamed update: one call to every engine with the whole plan, then the broadcasts, each
    bucket packed while the ones before it are on the wire (at most max_inflight unfinished), then
    every engine's answer. `first` None: bucket 0 is packed after the call went out, so the engines take
    it up and post their receives meanwhile. Returns what `_transfer` does; on a failure the engines
    that did not finish are dropped (dead) or parked until the next update (alive: their weights are
    incomplete)."""
    m = tr.members
    body = UpdateWeightsFromDistributed(
        names=[],
        dtypes=[],
        shapes=[],
        group_name=m.name,
        load_format=FLATTENED_BUCKET,
        weight_version=str(version),
        flush_cache=True,
        stream=plan.buckets,
        layout=plan.digest,
        stage=tr.stage,
        lora_name=tr.lora.name if tr.lora is not None else None,
        lora_config=tr.lora.peft_config() if tr.lora is not None else None,
    )
    t0 = time.perf_counter()
    calls = {e.url: e.announce(body) for e in m.engines}
    timeline: list[list[float]] = []
    inflight: deque[Bucket] = deque()
    total = count = 0
    pack_s = 0.0
    b: Bucket | None = first

    def retire() -> None:
        nonlocal total, count
        done = _sent(tr, inflight.popleft(), calls)
        total += done.nbytes
        count += 1
        timeline.append([done.index] + [round((t - t0) * 1e3, 3) for t in done.times])
        tr.release(done)
        release(plan, done)

    try:
        if b is None:
            t = time.perf_counter()
            b = next(stream, None)
            pack_s += time.perf_counter() - t
            if b is None:
                raise BusError("publish: no tensors")
        while b is not None:
            if plan.kind == "named" and b.names != plan.buckets[b.index].names:
                raise BusError(f"bucket {b.index}: the trainer's tensors are not the update's plan")
            b.calls = calls
            b.times[0] = time.perf_counter()
            b.work = broadcast_async(m.group, b.flat)
            inflight.append(b)
            while inflight and (len(inflight) > tr.max_inflight or inflight[0].work.is_completed()):
                retire()
            if b.last:
                break
            t = time.perf_counter()
            b = next(stream)
            pack_s += time.perf_counter() - t
        while inflight:
            retire()
        answers = _answers(tr, calls)
    except UpdateFailed as failure:
        return total, count, pack_s, _recover(tr, failure, calls), timeline
    except BusError as e:  # the trainer's tensors left the plan mid-update: no engine may wait for the rest
        _recover(tr, UpdateFailed(b or _NO_BUCKET, {}, e), calls)
        tr.sent.pop(tr.lora is not None, None)  # the next update learns what the trainer sends anew
        raise
    t_end = round((time.perf_counter() - t0) * 1e3, 3)
    for row in timeline:
        row[3] = t_end
    tr._staged = all(a.get("staged") for a in answers.values())
    tr._engine_pause_ms = max((float(a.get("paused_ms", 0.0)) for a in answers.values()), default=0.0)
    marks = next(iter(answers.values())).get("marks") or []  # the first engine's, on this host's clock
    tr._engine_marks_ms = [round((t - t0) * 1e3, 3) for t in marks]
    return total, count, pack_s, [], timeline


_NO_BUCKET = Bucket(-1, [], [], [], None, True, [], nbytes=0)
"""What a failure names when no bucket was in flight (the answers, or a stream without tensors)."""


def _sent(tr, b: Bucket, calls: dict[str, Future]) -> Bucket:
    """Wait (bounded) until rank 0's broadcast of b is done, failing early on an engine's error."""
    deadline = time.monotonic() + tr.timeout_s + tr.grace
    while not b.work.is_completed():
        errors = {u: err for u, f in calls.items() if (err := _error(f)) is not None}
        if errors:
            raise UpdateFailed(b, errors, None)
        if time.monotonic() > deadline:
            raise UpdateFailed(b, {}, TimeoutError("broadcast did not complete"))
        time.sleep(POLL_S)
    try:
        b.work.wait()
    except Exception as e:
        raise UpdateFailed(b, {}, e) from e
    b.times[1] = b.times[2] = time.perf_counter()
    return b


def _answers(tr, calls: dict[str, Future]) -> dict[str, dict]:
    """Every engine's answer to the streamed call (bounded): it has the whole update then."""
    wait(calls.values(), timeout=tr.timeout_s + tr.grace)
    errors = {u: (_error(f) if f.done() else TimeoutError("no answer in time")) for u, f in calls.items()}
    errors = {u: e for u, e in errors.items() if e is not None}
    if errors:
        raise UpdateFailed(_NO_BUCKET, errors, None)
    return {u: f.result() for u, f in calls.items()}


def _recover(tr, failure: UpdateFailed, calls: dict[str, Future]) -> list[str]:
    """After a failed streamed update: leave the group (rank 0's unfinished broadcasts fail, and so do
    the engines' receives), tell the dead from the alive by their answers and a probe, drop the dead,
    and park the alive ones that did not finish (their weights are incomplete: they stay paused and
    rejoin with the whole model at the next update). An engine that refused while everyone was alive
    and nothing failed on the wire is a bug: BusError."""
    m = tr.members
    log.warning("streamed weight update failed: %s", failure)
    m.leave_group()
    errors: dict[str, BaseException] = dict(failure.errors)
    tr.settle({u: [f] for u, f in calls.items()}, errors)
    dropped = tr.drop_lost(errors, failure)
    unfinished = [e for e in m.engines if e.url in errors]
    list(tr.calls.map(m.leave_on_engine, m.engines))  # the group is gone: every engine leaves it
    parked = m.drop([e.url for e in unfinished], park=True)
    if parked:
        log.warning("engines %s parked (paused) until the next update resends the whole model", parked)
    return dropped + parked


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
