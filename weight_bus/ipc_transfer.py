"""One weight update over CUDA IPC / shared memory (`bus.backend: ipc`): the engines share the trainer's
host (colocated), so a bucket is handed over as a handle to the trainer's memory, not as its bytes.

The order and failure semantics are the group transfer's (weight_bus/bus.py); what differs:

- membership: no process group. The probe drops the dead and admits joiners as they are; an engine not
  on this host is refused.
- buckets: packed into a ring of `max_inflight + 1` buffers the bus keeps (CUDA: on the trainer's device;
  CPU: shared memory), serialized once (weight_bus/ipc.py, SGLang's flattened_bucket payload) and POSTed
  to every engine's /update_weights_from_tensor, each engine's in bucket order on its pipelined
  connection. An engine answers once it copied the bucket into its weights; a buffer is packed again
  only after every engine still in the update answered for the bucket that used it, so besides the model
  the trainer holds only the ring, across buckets and updates. A buffer grows only when a bucket does not
  fit (a tensor larger than bucket_bytes, or the first update's first use).
- failure: an engine that dies or does not answer in time is dropped and the others go on with the same
  bucket (there is no collective to rebuild, nothing to re-send); one that is alive and refuses a bucket
  (an unknown name, a shape mismatch) is BusError.
"""

from __future__ import annotations

import base64
import itertools
import logging
import operator
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, wait

import torch

from weight_bus import ipc
from weight_bus.errors import BusError, Refused, UpdateFailed, _error
from weight_bus.group import dtype_from_name, dtype_name
from weight_bus.packing import Bucket, pack
from weight_bus.schema import (
    COMPLETION_EVENT,
    BuiltinUpdateWeightsFromTensor,
    LoadLoraAdapterFromTensors,
    UpdateWeightsFromTensor,
)
from weight_bus.transfer import Transfer

log = logging.getLogger(__name__)

COMPLETION_EVENT_ENV = "SLIPSTREAM_IPC_COMPLETION_EVENT"


class BucketRing:
    """`size` reusable flat uint8 buffers on `device` (CPU: in shared memory), bucket k in slot k % size.
    A slot is taken for a bucket only when the bucket before it in that slot was released. Each slot
    keeps the payload it was last serialized into, reused while the slot and its bucket's layout stay
    the same (engines that keep the payload then load it without unpickling: ipc.OpenedHandles)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.slots: list[torch.Tensor | None] = [None] * size
        self.holder: list[Bucket | None] = [None] * size
        """The bucket whose bytes a slot holds until every engine confirmed it."""
        self.payloads: list[tuple[tuple, str] | None] = [None] * size
        """(the layout of the bucket the slot held, its payload) per slot; None after a reallocation."""

    def payload(self, b: Bucket) -> tuple[str, bool]:
        """The payload of bucket b (in its slot): the slot's last one when its layout is b's, else a new
        one. Returns (payload, whether it was serialized now)."""
        i = b.index % len(self.slots)
        layout = (
            b.flat.numel(),
            tuple(b.names),
            tuple(b.dtypes),
            tuple(map(tuple, b.shapes)),
            tuple(b.offsets),
        )
        kept = self.payloads[i]
        if kept is not None and kept[0] == layout:
            return kept[1], False
        tensors = [
            (name, shape, dtype_from_name(d), off)
            for name, shape, d, off in zip(b.names, b.shapes, b.dtypes, b.offsets, strict=True)
        ]
        payload = ipc.serialize(ipc.flattened_bucket(b.flat, tensors))
        self.payloads[i] = (layout, payload)
        return payload, True

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        i = index % len(self.slots)
        if self.holder[i] is not None:
            raise RuntimeError(f"bucket ring: slot {i} still holds bucket {self.holder[i].index}")
        slot = self.slots[i]
        if slot is None or slot.numel() < nbytes:
            self.payloads[i] = None  # its handle names the old buffer
            self.slots[i] = None  # the old buffer goes before the new one is allocated
            slot = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":  # into a shared-memory file now, not at its first handoff
                slot.untyped_storage()._share_filename_cpu_()
            self.slots[i] = slot
            log.debug("bucket ring: slot %d is %d bytes on %s", i, nbytes, self.device)
        return slot[:nbytes]

    def hold(self, index: int, b: Bucket) -> None:
        self.holder[index % len(self.slots)] = b

    def release(self, b: Bucket) -> None:
        i = b.index % len(self.slots)
        if self.holder[i] is b:
            self.holder[i] = None

    def held(self) -> list[Bucket]:
        return [b for b in self.holder if b is not None]

    def clear(self) -> None:
        self.holder = [None] * len(self.slots)

    @property
    def nbytes(self) -> int:
        """Bytes the ring holds now."""
        return sum(s.numel() for s in self.slots if s is not None)


class DirectPayload:
    """The payload of a direct bucket, kept for the next update with the bucket's metadata: valid while
    the trainer passes the same tensor objects, in the same order, under the same names, at the same
    addresses. It holds them (so no other storage can take an address over while it compares); they are
    the trainer's parameters, alive anyway, and an engine keeps what it mapped alive too. A match needs no
    other check: these tensors passed IpcTransfer._shareable when the payload was made."""

    def __init__(self, tensors: list[torch.Tensor], payload: str, b: Bucket) -> None:
        self.tensors, self.ptrs, self.payload = tensors, _addresses(tensors), payload
        self.names, self.dtypes, self.shapes, self.nbytes = b.names, b.dtypes, b.shapes, b.nbytes

    def matches(self, names: list[str], tensors: list[torch.Tensor]) -> bool:
        return (
            names == self.names
            and all(map(operator.is_, tensors, self.tensors))
            and _addresses(tensors) == self.ptrs
        )

    def bucket(self, tensors: list[torch.Tensor]) -> Bucket:
        """A direct bucket of `tensors` (that match) with the kept metadata."""
        return Bucket(
            0, self.names, self.dtypes, self.shapes, None, True, [], tensors=tensors, nbytes=self.nbytes
        )


def wait_event(event: torch.cuda.Event, deadline: float) -> bool:
    """Wait for another process's CUDA event, bounded: spin on `query` (a weight copy takes milliseconds),
    then poll every 0.1 ms. An unbounded `synchronize` could wait forever on an event whose process died
    before its work ran. Returns whether the event completed by `deadline` (time.monotonic)."""
    spin_until = time.monotonic() + 0.005
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            return False
        if now > spin_until:
            time.sleep(1e-4)
    return True


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    return list(map(torch.Tensor.data_ptr, tensors))


class IpcTransfer(Transfer):
    """Publishes one version at a time to the (local) engines of `members`, by handle."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ring = BucketRing(self.max_inflight + 1, self.device)
        self.direct: DirectPayload | None = None
        """The last direct bucket's payload (its tensors are the trainer's own)."""
        self._direct_raw: list[torch.Tensor] = []
        """The tensors of a new direct bucket as the trainer passed them (what a repeat is matched by)."""
        self.max_failures = 1 << 30  # each failure drops the engines that failed: no rebuild to bound
        self.abort_in_call = False
        """The update folds a pause of mode abort into its one call (abort_all_requests)."""
        self.completion_event = os.environ.get(COMPLETION_EVENT_ENV, "1") != "0"
        """CUDA: built-in engines answer once their copy is queued, with an event this side waits on
        (BuiltinUpdateWeightsFromTensor.completion), so the answer's trip overlaps the copy; off with
        SLIPSTREAM_IPC_COMPLETION_EVENT=0 (the engine then answers once its copy is done)."""
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = -1 if self.device.type == "cpu" else self.device.index
        """`Tensor.get_device()` of a tensor on the bus device (cheaper to compare than devices)."""

    def stream_plan(self, dtype: torch.dtype | None) -> None:
        """No streamed updates: each bucket is already one call that hands a handle over."""
        return None

    def probe_due(self) -> bool:
        """No probe while the last update reached every engine: a dead engine fails the update's own
        call and is dropped then (joiners are still probed)."""
        return not self.healthy

    def folds_pause(self, first: Bucket) -> bool:
        """Pause and continue go when the whole update is one call (a single bucket) to built-in engines
        only: the engine loads it at a step boundary under its weight lock, so no step ever runs on
        half-updated weights and requests go on afterwards, which is what an in_place pause gives; an
        abort pause becomes the call's abort_all_requests. SGLang engines, retract pauses and updates of
        several buckets are paused and continued as usual; so are adapter-only updates (their load and
        version tag are two calls)."""
        self.abort_in_call = False
        if self.lora is not None:
            return False
        if not (first.last and self.members.engines and all(e.builtin for e in self.members.engines)):
            return False
        if self.pause_mode == "in_place":
            return True
        if self.pause_mode == "abort":
            self.abort_in_call = True
            return True
        return False

    def _shareable(self, t: torch.Tensor, dtype: torch.dtype | None) -> bool:
        """Whether `t` can travel as it is: on the bus device, contiguous, in the wire dtype."""
        return (
            t.get_device() == self._device_index
            and t.is_contiguous()
            and (dtype is None or t.dtype == dtype or not t.is_floating_point())
        )

    def pack(
        self,
        it: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None,
        whole: bool = False,
        persistent: bool = False,
    ) -> Iterator[Bucket]:
        """`persistent` tensors already on the bus device, contiguous and in the wire dtype go as one
        direct bucket: a handle per tensor to the trainer's own memory, nothing copied; anything else is
        packed into the ring's buffers. An adapter-only update is one ring bucket (the LoRA route takes
        the whole adapter in one call)."""
        self._drain_ring()
        for e in self.members.engines:  # a bucket an earlier update refused does not stop this one's
            e.broken = False
        self.handoff = "ring"
        if persistent:
            first = next(it, None)
            if first is None:
                return
            if self._shareable(first[1], dtype):
                tensors = [first, *it]
                names, raw = [n for n, _ in tensors], [t for _, t in tensors]
                kept = self.direct
                if kept is not None and kept.matches(names, raw):  # the same tensors again
                    self.handoff = "direct"
                    b = kept.bucket(raw)
                    b.payload = kept.payload
                    yield b
                    return
                if all(self._shareable(t, dtype) for t in raw):
                    self.handoff = "direct"
                    self.direct = None  # its tensors go before the new payload takes them
                    b = self._direct_bucket(
                        [(n, t.detach()) if t.requires_grad else (n, t) for n, t in tensors]
                    )
                    self._direct_raw = raw
                    yield b
                    return
                it = iter(tensors)  # the trainer's own tensors: holding them all costs nothing
            else:
                it = itertools.chain([first], it)
        ring = self.ring

        def alloc(index: int, nbytes: int) -> torch.Tensor:
            return ring.take(index, nbytes)

        limit = 1 << 62 if self.lora is not None else self.bucket_bytes
        for b in pack(it, limit, dtype, self.device, alloc=alloc):
            ring.hold(b.index, b)
            yield b

    def _direct_bucket(self, tensors: list[tuple[str, torch.Tensor]]) -> Bucket:
        return Bucket(
            0,
            [n for n, _ in tensors],
            [dtype_name(t.dtype) for _, t in tensors],
            [list(t.shape) for _, t in tensors],
            None,
            True,
            [],
            tensors=[t for _, t in tensors],
        )

    def _direct_payload(self, b: Bucket) -> str:
        """A new payload for the direct bucket b (pack reuses the kept one while the tensors match)."""
        payload = ipc.serialize(list(zip(b.names, b.tensors, strict=True)))
        # after serializing: a CPU storage moved into shared memory then (its address changed)
        self.direct = DirectPayload(self._direct_raw, payload, b)
        self._direct_raw = []
        return payload

    def _drain_ring(self) -> None:
        """Before an update packs anything: buckets an earlier update left unconfirmed (it failed) may
        still be loading on an engine; wait (bounded) for their calls, then take their slots back."""
        calls = [f for b in self.ring.held() for f in b.calls.values()]
        if calls:
            wait(calls, timeout=self.timeout_s)
        self.ring.clear()

    def launch(self, b: Bucket, version: int) -> None:
        """Serialize bucket b (a handle to its ring slot, or one per direct tensor), or reuse the payload
        its buffers were serialized into before, and POST it to every engine."""
        m = self.members
        if not b.calls:  # its first launch (launched once: nothing is re-sent over ipc)
            device = self.device if b.flat is None else b.flat.device
            if device.type == "cuda":  # an engine that kept this memory mapped reads it without an event wait
                torch.cuda.current_stream(device).synchronize()
            if b.payload is not None:  # the kept direct payload (pack)
                fresh = False
            elif b.flat is None:
                b.payload, fresh = self._direct_payload(b), True
            else:
                b.payload, fresh = self.ring.payload(b)
            if device.type == "cpu":
                shared = ipc.storages(b.tensors) if b.flat is None else [b.flat.untyped_storage()]
                ipc.share(shared, len(m.engines) - int(fresh))
        if self.lora is not None:
            self._launch_adapter(b, version)
            return
        common = dict(
            load_format=None if b.flat is None else ipc.FLATTENED_BUCKET,
            flush_cache=b.last,
            abort_all_requests=self.abort_in_call and b.index == 0,
            weight_version=str(version) if b.last else None,
        )
        sglang = UpdateWeightsFromTensor(serialized_named_tensors=[b.payload], **common)
        completion = COMPLETION_EVENT if self._device_index >= 0 and self.completion_event else None

        def body(e) -> UpdateWeightsFromTensor:
            """A built-in engine gets the reference to a payload it keeps, and answers with an event."""
            if not e.builtin:
                return sglang
            ref = e.payload_refs.get(b.payload) or e.payload_refs_before.get(b.payload) or b.payload
            return BuiltinUpdateWeightsFromTensor(
                serialized_named_tensors=[ref], completion=completion, **common
            )

        b.times[0] = time.perf_counter()
        b.calls = {e.url: e.announce(body(e)) for e in m.engines}
        b.work = None

    def _launch_adapter(self, b: Bucket, version: int) -> None:
        """An adapter-only update (one bucket): every engine replaces the adapter from the handle
        (/load_lora_adapter_from_tensors) and tags the version (Transfer.replace_adapter)."""
        body = LoadLoraAdapterFromTensors(
            lora_name=self.lora.name,
            config_dict=self.lora.peft_config(),
            serialized_named_tensors=[b.payload],
            load_format=ipc.FLATTENED_BUCKET,
        )

        def load(url: str) -> dict:
            return self.client.load_lora_adapter_from_tensors(url, body)

        b.times[0] = time.perf_counter()
        b.calls = {
            e.url: self.calls.submit(self.replace_adapter, e, load, version) for e in self.members.engines
        }
        b.work = None

    def confirm(self, b: Bucket) -> Bucket:
        """Wait (bounded) until every engine answered bucket b: it copied the bytes out of the slot."""
        _, late = wait(b.calls.values(), timeout=self.timeout_s + self.grace, return_when=FIRST_EXCEPTION)
        errors = {u: err for u, f in b.calls.items() if (err := _error(f)) is not None}
        if errors:  # engines still loading it are seen by the next confirm, after the recovery
            raise UpdateFailed(b, errors, None)
        if late:
            raise UpdateFailed(
                b, {u: TimeoutError("no answer in time") for u, f in b.calls.items() if f in late}, None
            )
        deadline = time.monotonic() + self.timeout_s
        copies = {
            e.url: self._answered(e, b, f.result(), deadline)
            for e in self.members.engines
            if e.builtin and (f := b.calls.get(e.url)) is not None
        }
        if late := {u: TimeoutError("its copy was not done in time") for u, ok in copies.items() if not ok}:
            raise UpdateFailed(b, late, None)
        b.times[1] = b.times[2] = time.perf_counter()
        return b

    def _answered(self, e, b: Bucket, answer: dict, deadline: float) -> bool:
        """A built-in engine answered bucket b: remember the reference to the payload it keeps (the
        references of this update and the one before, as the engine keeps them), and wait for its copy
        to be done when it answered with an event (then the bucket's memory may be written again).
        Returns whether the copy is done: False when the event did not complete by `deadline` (an engine
        that died or hung after answering; it is dropped as one that did not answer)."""
        if ref := answer.get("payload_ref"):
            e.payload_refs[b.payload] = ref
        if b.last:
            e.payload_refs_before, e.payload_refs = e.payload_refs, {}
        if handle := answer.get("event"):
            if e.copy_event is None or e.copy_event[0] != handle:
                event = torch.cuda.Event.from_ipc_handle(self.device, base64.b64decode(handle))
                e.copy_event = (handle, event)
            return wait_event(e.copy_event[1], deadline)
        return True

    def recover(self, failure: UpdateFailed, pending: deque[Bucket], confirmed: int) -> list[str]:
        """Drop the engines that failed (dead, or no answer in time); the others keep their calls. An
        engine that refused a bucket and still answers a probe is a bug: BusError."""
        m = self.members
        log.warning("weight update (ipc) failed: %s", failure)
        for e in m.engines:  # an engine whose load failed closed what it kept: send payloads again
            e.payload_refs, e.payload_refs_before = {}, {}
        refused = {u: e for u, e in failure.errors.items() if isinstance(e, Refused)}
        lost = set(failure.errors) - set(refused)
        if refused:
            infos = m.probe(list(refused))
            alive = [u for u in refused if not isinstance(infos[u], BaseException)]
            if alive:
                raise BusError("; ".join(str(refused[u]) for u in alive))
            lost |= set(refused)
        dropped = m.drop(sorted(lost))  # closes their connections: their later calls fail at once
        for url in dropped:
            log.warning("engine %s dropped from the weight update: %s", url, failure.errors.get(url))
        for b in pending:
            for url in dropped:
                b.calls.pop(url, None)
        return dropped

    def resend(self, pending: deque[Bucket], version: int) -> None:
        """Nothing to re-send: the survivors' calls for the pending buckets are still under way."""

    def release(self, b: Bucket) -> None:
        if b.flat is not None:
            self.ring.release(b)
        b.flat = b.work = b.tensors = None
        b.payload = None
