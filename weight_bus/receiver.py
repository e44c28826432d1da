"""Engine side of the weight bus: join update groups and receive broadcast tensors (blocking calls;
the engine runs them off its event loop)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from weight_bus.group import (
    DEFAULT_TIMEOUT_S,
    broadcast,
    broadcast_async,
    dtype_from_name,
    new_group,
    shutdown_group,
)
from weight_bus.schema import InitWeightsUpdateGroup, StreamBucket, UpdateWeightsFromDistributed

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
WAIT_POLL_S = 5e-5
"""How often a streamed update's host thread checks that its receives completed."""

Named = list[tuple[str, torch.Tensor]]


class _Ring:
    """Two CUDA receive buffers of one group, reused by the buckets of an update, so that bucket k+1 is
    received (on a side stream) while bucket k is copied into the weights (on the caller's stream).

    Without it, a bucket's receive waits for the copy of the bucket before (NCCL's stream waits on the
    current stream at launch) and every bucket allocates a fresh buffer. A slot is written again only
    after an event recorded behind the copies out of its previous bucket. The buffers are dropped when
    the update ends (the bucket that carries the version), so an engine holds them only during updates.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.slots: list[torch.Tensor | None] = [None, None]
        self.free: list[torch.cuda.Event | None] = [None, None]
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i, self.next = self.next, self.next ^ 1
        slot = self.slots[i]
        if slot is None or slot.numel() < nbytes:
            if self.free[i] is not None:
                self.free[i].synchronize()  # the slot's last copy is done before its memory goes back
            self.slots[i] = None
            slot = self.slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.free[i] = _recorded()  # the allocation is ordered on the current stream: wait for it
        return i, slot[:nbytes]

    def released(self, i: int) -> None:
        """The copies out of slot i are queued on the current stream."""
        self.free[i] = _recorded()


def _recorded() -> torch.cuda.Event:
    e = torch.cuda.Event()
    e.record()
    return e


class WeightReceiver:
    """Holds the engine's update groups by name (several may coexist, as in recent SGLang)."""

    def __init__(
        self, device: str | torch.device = "cpu", tp_rank: int = 0, gpu_lock: threading.Lock | None = None
    ) -> None:
        """`gpu_lock`: held around the CUDA work of a receive (buffers, the broadcast and, on gloo, its
        copy to the device) and of leaving a group, never around `load`: the engine's CUDA graph
        captures take it too, so none of that lands inside a capture (which CUDA would then fail)."""
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.gpu_lock = gpu_lock if gpu_lock is not None else contextlib.nullcontext()
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.rings: dict[str, _Ring] = {}
        self.timeouts: dict[str, float] = {}
        """Each group's collective timeout (InitWeightsUpdateGroup.timeout_s)."""
        self.broken: set[str] = set()
        """Groups a receive failed on (a peer died, the sender left): their later receives fail at once
        instead of each waiting out the group timeout; the bus builds a new group."""

    def init_group(self, req: InitWeightsUpdateGroup) -> None:
        if req.group_name in self.groups:
            raise ValueError(f"group {req.group_name!r} already exists; destroy it first")
        rank = req.rank_offset + self.tp_rank
        self.groups[req.group_name] = new_group(
            req.master_address,
            int(req.master_port),
            rank,
            req.world_size,
            req.backend,
            req.group_name,
            req.timeout_s or DEFAULT_TIMEOUT_S,
        )
        self.timeouts[req.group_name] = req.timeout_s or DEFAULT_TIMEOUT_S
        log.info(
            "joined weight group %s as rank %d/%d (%s)", req.group_name, rank, req.world_size, req.backend
        )

    def destroy(self, group_name: str) -> None:
        """Leave a group; the bus drops one this way after a peer died in it and rebuilds without it."""
        group = self.groups.pop(group_name, None)
        self.broken.discard(group_name)
        self.rings.pop(group_name, None)
        self.timeouts.pop(group_name, None)
        if group is None:
            raise ValueError(f"no group {group_name!r}")
        with self.gpu_lock:
            shutdown_group(group)

    def receive(
        self, req: UpdateWeightsFromDistributed, load: Callable[[Named], None] | None = None
    ) -> Named:
        """Receive the tensors named in `req` from rank 0; returns (name, tensor) in order.

        With `load` (which copies them into the model on the current stream), a CUDA engine receives a
        flattened bucket into a reused buffer on a side stream (_Ring), overlapping the next bucket's
        receive with this one's copy; the returned tensors are then only valid inside `load`. Without it,
        each call receives into fresh tensors that the caller keeps."""
        group = self._group(req.group_name)
        try:
            named = self._receive(group, req, load)
        except _LoadFailed as e:  # the bytes arrived: the group is still in step with rank 0
            raise e.__cause__ from None
        except Exception:
            # Whatever failed, this engine and rank 0 no longer agree on which broadcast comes next.
            self.broken.add(req.group_name)
            self.rings.pop(req.group_name, None)
            raise
        if req.weight_version is not None:  # the update's last bucket: its buffers go back
            self.rings.pop(req.group_name, None)
        return named

    def receive_stream(
        self,
        req: UpdateWeightsFromDistributed,
        target: Callable[[StreamBucket], torch.Tensor | None],
        load: Callable[[StreamBucket, Named], None],
    ) -> list[float]:
        """Receive every bucket of `req.stream`, in order, one broadcast each, and return once every one
        is in (each wait bounded by the group's timeout). A bucket for which `target` gives a tensor (a
        byte range of the engine's weight arena) is received straight into it: these broadcasts are all
        posted at once and each is waited for, as they may complete in any order (gloo runs a group's
        collectives on two worker threads: the last may be in before an earlier one began). Any other is
        a flattened bucket of named tensors, received into a reused buffer (CUDA: the _Ring, overlapping
        the next receive with this copy) and handed to `load(bucket, named)`. A failure breaks the group,
        as in `receive`. Returns perf_counter marks: the first broadcast posted, the last posted, every
        one done."""
        group = self._group(req.group_name)
        timeout_s = self.timeouts.get(req.group_name, DEFAULT_TIMEOUT_S)
        marks: list[float] = []
        try:
            posted: list[dist.Work] = []  # arena receives not yet waited for
            for b in req.stream:
                dest = target(b)
                if dest is not None:
                    with self.gpu_lock:
                        posted.append(broadcast_async(group, dest))
                    if not marks:
                        marks.append(time.perf_counter())
                    continue
                _wait_all(posted, timeout_s)  # a named bucket's buffer must not wait behind them
                one = UpdateWeightsFromDistributed(
                    names=b.names, dtypes=b.dtypes, shapes=b.shapes, group_name=req.group_name,
                    load_format=FLATTENED_BUCKET,
                )  # fmt: skip
                self._receive(group, one, lambda named, b=b: load(b, named))
                if not marks:
                    marks.append(time.perf_counter())
            marks.append(time.perf_counter())
            _wait_all(posted, timeout_s)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # named buckets' copies are done
        except Exception as e:  # a load that failed too: later buckets were never received
            self.broken.add(req.group_name)
            self.rings.pop(req.group_name, None)
            if isinstance(e, _LoadFailed):
                raise e.__cause__ from None
            raise
        self.rings.pop(req.group_name, None)
        return [*marks, time.perf_counter()]

    def _group(self, name: str) -> dist.ProcessGroup:
        group = self.groups.get(name)
        if group is None:
            raise ValueError(f"no weight update group {name!r}; call /init_weights_update_group")
        if name in self.broken:
            raise RuntimeError(f"weight update group {name!r} failed earlier; it must be rebuilt")
        return group

    def _receive(
        self,
        group: dist.ProcessGroup,
        req: UpdateWeightsFromDistributed,
        load: Callable[[Named], None] | None,
    ) -> Named:
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        dtypes = [dtype_from_name(d) for d in req.dtypes]
        if req.load_format == FLATTENED_BUCKET:
            sizes = [math.prod(s) * d.itemsize for s, d in zip(req.shapes, dtypes, strict=True)]
            ring = None
            with self.gpu_lock:
                if load is not None and self.device.type == "cuda":
                    ring = self.rings.get(req.group_name)
                    if ring is None:
                        ring = self.rings[req.group_name] = _Ring(self.device)
                    slot, flat = ring.take(sum(sizes))
                    with torch.cuda.stream(ring.stream):
                        ring.stream.wait_event(ring.free[slot])
                        work = broadcast_async(group, flat)  # its stream waits on ring.stream, not on ours
                    work.wait()  # our stream (the copies in `load`) waits for the broadcast
                else:
                    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
                    broadcast(group, flat)
            parts = flat.split(sizes)
            named = [
                (name, part.view(dtype).view(shape))
                for name, part, dtype, shape in zip(req.names, parts, dtypes, req.shapes, strict=True)
            ]
            try:
                _load(load, named)
            finally:
                if ring is not None:
                    with self.gpu_lock:
                        ring.released(slot)
            return named
        if req.load_format is not None:
            raise ValueError(f"load_format {req.load_format!r}: expected null or {FLATTENED_BUCKET!r}")
        out = []
        for name, shape, dtype in zip(req.names, req.shapes, dtypes, strict=True):
            with self.gpu_lock:
                t = torch.empty(shape, dtype=dtype, device=self.device)
                broadcast(group, t)
            out.append((name, t))
        _load(load, out)
        return out


def _wait_all(works: list[dist.Work], timeout_s: float) -> None:
    """Wait (host) until every receive in `works` is complete, all within `timeout_s`: TimeoutError
    past it; the first one's error if one failed. Empties `works`. Completing the last one posted says
    nothing of the others: on gloo they run on several threads, so each is waited for."""
    deadline = time.monotonic() + timeout_s
    while works:
        work = works[0]
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a weight broadcast did not complete within {timeout_s:.0f} s")
            time.sleep(WAIT_POLL_S)
        work.wait()
        works.pop(0)


class _LoadFailed(Exception):
    """`load` raised (its error is the __cause__) after the receive itself succeeded."""


def _load(load: Callable[[Named], None] | None, named: Named) -> None:
    if load is None:
        return
    try:
        load(named)
    except Exception as e:
        raise _LoadFailed from e
