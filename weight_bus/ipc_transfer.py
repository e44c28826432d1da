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

import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, wait

import torch

from weight_bus import ipc
from weight_bus.errors import BusError, Refused
from weight_bus.group import dtype_from_name
from weight_bus.packing import Bucket, pack
from weight_bus.schema import LoadLoraAdapterFromTensors, UpdateWeightsFromTensor
from weight_bus.transfer import Transfer, UpdateFailed, _error

log = logging.getLogger(__name__)


class BucketRing:
    """`size` reusable flat uint8 buffers on `device` (CPU: in shared memory), bucket k in slot k % size.
    A slot is taken for a bucket only when the bucket before it in that slot was released."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self.slots: list[torch.Tensor | None] = [None] * size
        self.holder: list[Bucket | None] = [None] * size
        """The bucket whose bytes a slot holds until every engine confirmed it."""

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        i = index % len(self.slots)
        if self.holder[i] is not None:
            raise RuntimeError(f"bucket ring: slot {i} still holds bucket {self.holder[i].index}")
        slot = self.slots[i]
        if slot is None or slot.numel() < nbytes:
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


class IpcTransfer(Transfer):
    """Publishes one version at a time to the (local) engines of `members`, by handle."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ring = BucketRing(self.max_inflight + 1, self.device)
        self.max_failures = 1 << 30  # each failure drops the engines that failed: no rebuild to bound

    def pack(
        self, it: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None, whole: bool = False
    ) -> Iterator[Bucket]:
        """Buckets packed into the ring; an adapter-only update is one bucket (the LoRA route takes the
        whole adapter in one call)."""
        self._drain_ring()
        for e in self.members.engines:  # a bucket an earlier update refused does not stop this one's
            e.broken = False
        ring = self.ring

        def alloc(index: int, nbytes: int) -> torch.Tensor:
            return ring.take(index, nbytes)

        limit = 1 << 62 if self.lora is not None else self.bucket_bytes
        for b in pack(it, limit, dtype, self.device, alloc=alloc):
            ring.hold(b.index, b)
            yield b

    def _drain_ring(self) -> None:
        """Before an update packs anything: buckets an earlier update left unconfirmed (it failed) may
        still be loading on an engine; wait (bounded) for their calls, then take their slots back."""
        calls = [f for b in self.ring.held() for f in b.calls.values()]
        if calls:
            wait(calls, timeout=self.timeout_s)
        self.ring.clear()

    def launch(self, b: Bucket, version: int) -> None:
        """Serialize bucket b once (a handle to its ring slot) and POST it to every engine."""
        m = self.members
        if b.payload is None:
            tensors = [
                (name, shape, dtype_from_name(d), off)
                for name, shape, d, off in zip(b.names, b.shapes, b.dtypes, b.offsets, strict=True)
            ]
            if b.flat.is_cuda:  # an engine that kept this slot mapped reads it without an event wait
                torch.cuda.current_stream(b.flat.device).synchronize()
            b.payload = ipc.serialize(ipc.flattened_bucket(b.flat, tensors))
            ipc.share(b.flat.untyped_storage(), len(m.engines))
        if self.lora is not None:
            self._launch_adapter(b, version)
            return
        body = UpdateWeightsFromTensor(
            serialized_named_tensors=[b.payload],
            load_format=ipc.FLATTENED_BUCKET,
            flush_cache=b.last,
            weight_version=str(version) if b.last else None,
        )
        b.times[0] = time.perf_counter()
        b.calls = {e.url: e.announce(body) for e in m.engines}
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
            e.url: self.pool.submit(self.replace_adapter, e, load, version) for e in self.members.engines
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
        b.times[1] = b.times[2] = time.perf_counter()
        return b

    def recover(self, failure: UpdateFailed, pending: deque[Bucket], confirmed: int) -> list[str]:
        """Drop the engines that failed (dead, or no answer in time); the others keep their calls. An
        engine that refused a bucket and still answers a probe is a bug: BusError."""
        m = self.members
        log.warning("weight update (ipc) failed: %s", failure)
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
        self.ring.release(b)
        b.flat = b.work = None
        b.payload = None
