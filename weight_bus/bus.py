"""Trainer side of the weight bus: one process group {trainer rank 0, every engine}, bucketed broadcasts
(or, backend ipc, buckets handed to engines on the same host by CUDA IPC / shared memory).

One update (`WeightBus.publish`):

  1. membership — probe the engines (GET /get_server_info; after a streamed update that reached every
     engine only those in neither registry set); drop the dead, admit engines waiting to join (the
     registry's joining set, or engines dropped earlier that answer again); rebuild the group if it
     changed. Nothing is paused yet. (A streamed update then goes as weight_bus/stream.py says: one call
     per engine, sent before bucket 0 is packed, the pause folded into it.)
  2. bucket 0 — pulled from the trainer's (lazy) iterator, cast to the engine dtype and packed into one
     flat buffer, still before the pause.
  3. pause — /pause_generation on every engine (in_place | retract | abort).
  4. buckets — per bucket: announce (/update_weights_from_distributed, names/dtypes/shapes, the last
     one tagged with the version), then one broadcast. While bucket k is on the wire, bucket k+1 is
     gathered and packed; at most MAX_INFLIGHT buckets are unconfirmed at a time.
  5. continue — /continue_generation; engines that joined are promoted in the registry (they take
     traffic only now, holding the current weights).

Order matters (docs/sglang_api.md §3): an engine's HTTP handler blocks inside the collective, so the
trainer fires the HTTP request first, then joins the collective, then collects the HTTP answer. The
announcements to one engine go out in bucket order on one pipelined connection (weight_bus/pipeline.py):
bucket k+1's is written without waiting for k's answer, yet cannot overtake it (on two connections it
could, and the engine would receive bucket k+1's bytes as bucket k).

Where it lives: weight_bus/membership.py (step 1, and the group), weight_bus/packing.py (step 2),
weight_bus/transfer.py (steps 3-5 and recovery), weight_bus/engine_client.py (the HTTP calls).

Backend ipc (colocated: engines on the trainer's host; weight_bus/ipc_transfer.py): the same five steps
without a group. Step 1 only probes (a joiner is admitted as it is; an engine off this host is refused);
in step 4 each bucket is packed into one of max_inflight + 1 buffers the bus keeps (CUDA: on the
trainer's device; CPU: shared memory), serialized once as a handle to that buffer (weight_bus/ipc.py:
SGLang's MultiprocessingSerializer payload, load_format flattened_bucket) and POSTed to every engine's
/update_weights_from_tensor, pipelined as above; an engine answers once it copied the bytes into its
weights, and a buffer is packed again only after every engine answered for the bucket in it. An engine
that dies or times out is dropped and the others go on with no re-send; a refusal is BusError.
Steady state (weight_bus/ipc_transfer.py): a buffer's payload is reused while the buffer and its layout
stay the same, and the trainer's own tensors (`persistent`, already in the wire dtype) go as one direct
payload of per-tensor handles with no pack copy; the built-in engine keeps what a payload mapped and
loads a repeated payload without unpickling it. Step 1 probes only joiners while the last update reached
every engine; a one-call update to built-in engines folds pause and continue into that call.

LoRA (`lora`: a job with model.lora; weight_bus/lora.py): every update carries the adapter only, under
PEFT's names, through the same steps: announced with `lora_name` + `lora_config` over the group
(built-in engines), handed over as one ring bucket to /load_lora_adapter_from_tensors (ipc), or written
as a PEFT directory under `lora_dir` that engines without the group extension (SGLang) load.

Failure: every HTTP call and every collective is bounded (`timeout_s`). An engine that dies, or does
not answer in time, during an update is dropped; rank 0 leaves the group, builds a new one (new name,
new port) with the survivors, and re-sends every bucket they have not confirmed, so the same update
still reaches them and `publish` returns normally. An engine that is alive but refuses a bucket (e.g.
an unknown parameter name) is a bug, not a failure: `publish` raises BusError. Either way the engines
are continued and the trainer's iterator is drained (its other ranks take part in the same gathers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from weight_bus.config import BACKENDS, BUCKET_BYTES, PAUSE_MODES, BusSpec
from weight_bus.engine_client import EngineClient
from weight_bus.errors import BusError
from weight_bus.group import DEFAULT_TIMEOUT_S, dtype_from_name
from weight_bus.ipc_transfer import IpcTransfer
from weight_bus.membership import IPC, Membership, Registry
from weight_bus.rank_handoff import RankHandoff, Ranks
from weight_bus.schema import DEFAULT_GROUP
from weight_bus.stats import PublishStats
from weight_bus.transfer import MAX_INFLIGHT, Transfer

__all__ = ["BusError", "PublishStats", "Registry", "WeightBus", "update_due"]

log = logging.getLogger(__name__)


def update_due(version: int, every: int, final_version: int | None = None) -> bool:
    """Whether to publish after the optimizer step that made `version`: every `every` versions, and
    always at `final_version` so that engines end on the final policy. Pure, so that every trainer rank
    decides alike (the full-tensor gather is a collective all of them take part in)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return version % every == 0 or (final_version is not None and version >= final_version)


def _drain(it: Iterator) -> None:
    """Consume what is left of the trainer's iterator: its other ranks take part in the same gathers."""
    for _ in it:
        pass


class WeightBus:
    """Connects to engines over HTTP, hosts rank 0 of the update group, publishes weights: a
    `Membership` (who is in the group) and a `Transfer` (one update over it), one update at a time."""

    @classmethod
    def from_config(
        cls, spec: BusSpec, engine_urls: list[str], api_key: str | None = None, **over
    ) -> WeightBus:
        """The bus a job's `bus` section describes (backend, buckets, pause mode, dtype, timeouts, staging,
        the address peers dial); `over`: what the section does not hold (registry, device, lora, ...) or
        replaces."""
        kw = {
            "backend": spec.backend,
            "bucket_bytes": spec.bucket_bytes,
            "pause_mode": spec.pause_mode,
            "dtype": spec.dtype,
            "timeout_s": spec.timeout_s,
            "stage": spec.stage_weights,
        }
        if spec.master_address:
            kw["master_address"] = spec.master_address
        return cls(engine_urls, api_key=api_key, **(kw | over))

    def __init__(
        self,
        engine_urls: list[str],
        api_key: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = BUCKET_BYTES,
        master_address: str = "127.0.0.1",
        pause_mode: str = "in_place",
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dtype: str | None = None,
        registry: Registry | None = None,
        rejoin_after_s: float = 60.0,
        device: str | torch.device | None = None,
        max_inflight: int = MAX_INFLIGHT,
        repair_in_stream: bool | None = None,
        lora=None,
        lora_dir: str | None = None,
        stream: bool = True,
        stage: bool = False,
    ) -> None:
        """`dtype`: what the weights travel and load as ("bfloat16", ...); None: the engines' dtype from
        /get_server_info when they all report the same concrete one, else the trainer's own.
        `timeout_s`: bound on every HTTP call and collective (see membership.SETUP_GRACE_S).
        `registry`: where engines that join mid-job wait (they are admitted at the next update).
        `rejoin_after_s`: an engine dropped, or one that failed to join, is retried as a joiner after
        this long. `device`: where buckets are packed (default: the current CUDA device for nccl, else
        CPU; ipc: the current CUDA device when there is one, else CPU shared memory). `max_inflight`: see
        transfer.MAX_INFLIGHT (ipc: the bus keeps max_inflight + 1 bucket buffers). `repair_in_stream`: after an engine failed
        mid-update, re-send the unconfirmed buckets to the survivors (default: gloo), or park them until
        the next update (default: NCCL; see Transfer.recover). `lora` (models.config.LoraSpec; a LoRA
        job): every publish is adapter-only (weight_bus/lora.py), and `lora_dir` is where the adapter's
        PEFT directories go for engines that load it from disk (SGLang without ipc). `stream`: after the
        first update, send each update to built-in engines as one call (weight_bus/stream.py); `stage`:
        such engines receive into a staging copy of their weights while generating (bus.stage_weights)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {PAUSE_MODES}")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
        self.backend = backend
        if device is None:
            cuda = backend == "nccl" or (backend == IPC and torch.cuda.is_available())
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
        self.client = EngineClient(api_key, timeout_s)
        self.calls = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bus-http")
        """Threads for the bus's HTTP calls to engines in parallel (pause, update, continue, probes)."""
        self.members = Membership(
            self.client,
            self.calls,
            engine_urls,
            backend=backend,
            master_address=master_address,
            group_name=group_name,
            timeout_s=timeout_s,
            dtype=dtype_from_name(dtype) if dtype else None,
            registry=registry,
            rejoin_after_s=rejoin_after_s,
        )
        self.members.lora_files = lora is not None
        self.lora = lora
        self.transfer = (IpcTransfer if backend == IPC else Transfer)(
            self.members,
            self.client,
            self.calls,
            bucket_bytes=bucket_bytes,
            pause_mode=pause_mode,
            device=torch.device(device),
            max_inflight=max_inflight,
            repair_in_stream=backend == "gloo" if repair_in_stream is None else repair_in_stream,
            lora=lora,
            lora_dir=lora_dir,
            **({} if backend == IPC else {"stream": stream, "stage": stage}),
        )
        self._lock = threading.Lock()
        """One update (or connect) at a time: an update never overlaps another."""
        self.rank_handoff = RankHandoff(self)
        """ipc with several trainer ranks: this rank's handoff to the engines on its device."""

    @property
    def urls(self) -> list[str]:
        """Engines in the update group now."""
        return self.members.urls

    def connect(self) -> None:
        """Build the first update group with the engines given; every one of them must answer (a bad
        token or a dead engine fails here in milliseconds, not after a group-setup timeout)."""
        with self._lock:
            self.members.connect()
            log.info(
                "weight bus connected: %d engines, %s, %s",
                len(self.members.engines),
                self.backend,
                "no group (handles on this host)" if self.backend == IPC else f"group {self.members.name}",
            )

    def joiners_waiting(self) -> list[str]:
        """The engines the next update would try to admit, sorted. A trainer with nothing to train
        publishes its current weights for them (Trainer: bus.idle_sync_s) instead of waiting for its
        next step, which never comes when every engine is gone or still joining."""
        return self.members.joiners_waiting()

    def publish(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        version: int,
        persistent: bool = False,
        ranks: Ranks | None = None,
    ) -> PublishStats | None:
        """Send every (HF name, full tensor) of `named` to every live engine and tag them with `version`
        (with `lora`: `named` is the whole adapter under PEFT's names, and it replaces the engines' adapter
        `lora.name`).
        `named` may be lazy (an FSDP full-tensor gather per parameter): it is consumed once, in order, and
        always to the end. Returns once every engine left in the group confirmed; raises BusError if an
        engine refused or no group could be built (the version must not be published then).
        `persistent`: the tensors are the trainer's own (its parameters, not gathered copies), alive and
        where they are until the next publish; backend ipc then shares them as they are when they are
        on its device, contiguous and in the wire dtype (one call, no copy on the trainer's side).
        `ranks` (backend ipc, more than one trainer rank): every rank calls publish with its own bus (rank
        0's knows the engines) and hands the weights to the engines on its device
        (weight_bus.rank_handoff); the stats are rank 0's, None on the other ranks."""
        it = iter(named)
        with self._lock:
            try:
                if ranks is not None and ranks.world_size > 1:
                    if self.backend != IPC:
                        raise BusError(f"per-rank handoff is backend ipc's, not {self.backend}'s")
                    return self.rank_handoff.publish(it, version, persistent, ranks)
                return self.transfer.publish(it, version, persistent)
            finally:
                _drain(it)

    def close(self) -> None:
        """Leave the group on every side (engines keep serving) and release the connections."""
        with self._lock:
            self.members.close()
            self.rank_handoff.close()
        self.client.close()
        self.calls.shutdown(wait=False)
