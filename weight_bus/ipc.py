"""Weight handoff between processes of one host without copying the bytes: the payloads of SGLang's
POST /update_weights_from_tensor (docs/sglang_api.md §3).

A payload is SGLang's `MultiprocessingSerializer` format: base64 of a `ForkingPickler` pickle in which a
tensor travels as a handle to its memory, not as its bytes.

- CUDA tensors travel as CUDA-IPC handles (torch's reduction), the device named by its UUID instead of
  its index, as SGLang's `monkey_patch_torch_reductions` does: engine and trainer may see the GPU under
  different indices (Ray sets CUDA_VISIBLE_DEVICES per actor). The rebuild function is pickled under
  SGLang's name (`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`), which SGLang's
  deserializer allows and resolves to its own.
- CPU tensors travel as named shared-memory files (torch's "file_system" sharing strategy), whatever
  the process's global strategy: the default "file_descriptor" strategy hands over a descriptor
  through `multiprocessing.resource_sharer`, which only a child of the sender can reach (it needs the
  sender's authkey), never an engine that gets the payload over HTTP.

Two load formats, as SGLang builds them (`Engine.update_weights_from_tensor`, slime's
UpdateWeightFromTensor):

- None / "direct": the pickle of a list of (name, tensor) pairs.
- "flattened_bucket": the pickle of {"flattened_tensor": uint8 tensor, "metadata": [metadata, ...]},
  each metadata a `FlattenedTensorMetadata` (name, shape, dtype, start_idx, end_idx, numel: byte range
  of the tensor in the flat buffer), pickled under SGLang's class name
  (`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`), so SGLang rebuilds it as its own.

`deserialize` is a restricted unpickler: a payload may only name torch's rebuild functions, dtypes,
sizes, storages and the metadata class (SGLang's deserializer has an allowlist for the same reason:
a pickle from the network could otherwise run anything).

The sender must keep the shared memory alive, and unchanged, until every receiver answered (the bus's
ring of bucket buffers: weight_bus/ipc_transfer.py); a receiver copies out of it before it answers.

A receiver may keep what it mapped open between calls (`OpenedHandles`): torch's rebuild looks a handle up
in its cache of storages this process already mapped (`torch.multiprocessing.reductions.shared_cache`,
keyed by the CUDA-IPC handle and offset, or the shared-memory file's name) and skips the open while the
storage is alive; and a sender that repeats a payload (its persistent buffers serialized once: the ring's
slots, or the trainer's own parameters) has it loaded from the tensors the receiver kept for that payload
text, without unpickling (`OpenedHandles.lookup`). Either way the CUDA event wait of the open is skipped,
so a CUDA sender finishes writing a buffer (its stream synchronized) before it posts the handle. CPU
shared-memory references are taken per delivery by the sender (`share`) and dropped per delivery by the
receiver (its rebuild, or `lookup` for a kept payload), so a file is unlinked once its last mapping goes.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import io
import pickle
import sys
import threading
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from torch.multiprocessing import reductions

FLATTENED_BUCKET = "flattened_bucket"
PAYLOAD_REF = "slipstream-payload:"
"""What a reference to a payload the built-in engine keeps starts with (its answer names it as
`payload_ref`); base64 never contains ':', so a reference is never taken for a payload."""
LOAD_FORMATS = (None, "direct", FLATTENED_BUCKET)
"""What /update_weights_from_tensor loads (None and "direct": a list of (name, tensor))."""
TENSOR_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
PATCH_TORCH_MODULE = "sglang.srt.utils.patch_torch"
OLD_PATCH_TORCH_MODULE = "sglang.srt.patch_torch"
"""Where SGLang kept it before `sglang.srt.utils` became a package (accepted when loading)."""
_DEVICE_ARG = 6
"""Index of the device in the arguments of torch's CUDA tensor rebuild (SGLang's patch swaps it too)."""

Named = list[tuple[str, torch.Tensor]]


class NamedTensors(list):
    """The (name, tensor) pairs one payload mapped: a list that can be weakly referenced, so that a
    receiver's per-load state (the engine's copy plan: generator_fleet/engine/multi_copy.py) can know the
    very list of a kept payload again without holding its mappings open."""


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket: bytes [start_idx, end_idx) of the flat uint8 tensor (SGLang's
    FlattenedTensorMetadata; `numel` counts those bytes)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclasses.dataclass
class LocalSerializedTensor:
    """A tensor wrapped once more, one payload per TP rank (SGLang's LocalSerializedTensor, which some
    senders put in a direct payload instead of the tensor)."""

    values: list


def _rebuild_cuda_tensor_modified(*args):
    """torch's CUDA tensor rebuild, with the device given by UUID (or index) in this process's numbering."""
    args = list(args)
    if len(args) > _DEVICE_ARG:
        args[_DEVICE_ARG] = _device_index(args[_DEVICE_ARG])
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return rebuild(*args)


FlattenedTensorMetadata.__module__ = TENSOR_BUCKET_MODULE
_rebuild_cuda_tensor_modified.__module__ = PATCH_TORCH_MODULE
_ALIASES = {
    TENSOR_BUCKET_MODULE: {"FlattenedTensorMetadata": FlattenedTensorMetadata},
    PATCH_TORCH_MODULE: {"_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_modified},
}
"""What a payload names by SGLang's modules. The pickler checks that a global it writes can be imported
back, so while it runs (and only when SGLang itself is not loaded) these stand-in modules answer for
SGLang's."""
_alias_lock = threading.Lock()


@functools.cache
def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA device (the same in every process, whatever index it has there); None for CPU
    (shared memory reaches every process of the host)."""
    if device.type != "cuda":
        return None
    return _device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == device:
            return i
    raise RuntimeError(f"no visible CUDA device has UUID {device} (tensors over CUDA IPC stay on one host)")


def _sglang_object(module: str, name: str):
    """SGLang's own object when SGLang is loaded in this process, else ours (the pickle is the same)."""
    loaded = sys.modules.get(module)
    if loaded is not None and not getattr(loaded, "_slipstream_alias", False):
        return getattr(loaded, name)
    return _ALIASES[module][name]


def metadata(name: str, shape, dtype: torch.dtype, start: int, end: int):
    """A FlattenedTensorMetadata for bytes [start, end) of a flat bucket."""
    cls = _sglang_object(TENSOR_BUCKET_MODULE, "FlattenedTensorMetadata")
    return cls(
        name=name, shape=torch.Size(shape), dtype=dtype, start_idx=start, end_idx=end, numel=end - start
    )


@contextlib.contextmanager
def _sglang_names():
    """Stand-in modules for SGLang's (and their parent packages: the pickler imports the top one) that
    are not loaded, while the pickler runs."""
    with _alias_lock:
        added = []
        for module, attrs in _ALIASES.items():
            parts = module.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    stand_in = types.ModuleType(name)
                    stand_in.__dict__.update(attrs if name == module else {}, _slipstream_alias=True)
                    sys.modules[name] = stand_in
                    added.append(name)
        try:
            yield
        finally:
            for name in reversed(added):
                sys.modules.pop(name, None)


# ---- serializing ---------------------------------------------------------------------------------------


def _reduce_tensor(t: torch.Tensor):
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    fn, args = reduce(t)
    if t.is_cuda:  # SGLang's patched form: the device by UUID, its rebuild function's name
        args = list(args)
        args[_DEVICE_ARG] = _device_uuid(args[_DEVICE_ARG])
        fn = _sglang_object(PATCH_TORCH_MODULE, "_rebuild_cuda_tensor_modified")
        args = tuple(args)
    return fn, args


def _reduce_storage(storage: torch.UntypedStorage):
    """A CPU storage as a named shared-memory file (torch's "file_system" reduction)."""
    if storage.device.type != "cpu":
        raise RuntimeError(f"cannot share a {storage.device.type} storage; share a tensor instead")
    if storage.size() == 0:  # nothing to map
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference over
    reductions.shared_cache[handle] = reductions.StorageWeakRef(storage)
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _Pickler(ForkingPickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        for cls in (torch.Tensor, torch.nn.Parameter, *torch._tensor_classes):
            self.dispatch_table[cls] = _reduce_tensor
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage


def serialize(obj: Any) -> str:
    """`obj` as SGLang's MultiprocessingSerializer.serialize(obj, output_str=True) writes it: its tensors
    by handle (CUDA IPC, CPU shared memory), base64 text."""
    buf = io.BytesIO()
    with _sglang_names():
        _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def share(storage: torch.UntypedStorage | list[torch.UntypedStorage], receivers: int) -> None:
    """A CPU payload is about to reach `receivers` more processes: each one's rebuild (or, for a payload it
    keeps, its `OpenedHandles.lookup`) drops one reference per storage, so take them (CUDA needs none).
    Serializing took one already: pass `receivers - 1` for a payload just serialized."""
    for s in storage if isinstance(storage, list) else [storage]:
        if s.device.type == "cpu":
            for _ in range(receivers):
                s._shared_incref()


def flattened_bucket(flat: torch.Tensor, tensors: list[tuple[str, list[int], torch.dtype, int]]) -> dict:
    """The "flattened_bucket" object: `flat` (uint8) and, per (name, shape, dtype, start byte), the
    metadata of a tensor that fills bytes [start, start + its size)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {flat.dtype} {list(flat.shape)}")
    meta = []
    for name, shape, dtype, start in tensors:
        n = torch.Size(shape).numel() * dtype.itemsize
        meta.append(metadata(name, shape, dtype, start, start + n))
    return {"flattened_tensor": flat, "metadata": meta}


# ---- deserializing -------------------------------------------------------------------------------------

_REDUCTIONS = {
    "rebuild_tensor",
    "rebuild_storage_filename",
    "rebuild_storage_empty",
    "rebuild_typed_storage",
    "rebuild_typed_storage_child",
}


class _Unpickler(pickle.Unpickler):
    """Loads only what a weight payload contains; anything else is an UnpicklingError that names it."""

    def find_class(self, module: str, name: str):
        if module == "torch.multiprocessing.reductions":
            if name == "rebuild_cuda_tensor":
                return _rebuild_cuda_tensor_modified
            if name in _REDUCTIONS:
                return getattr(reductions, name)
            if name == "rebuild_storage_fd":
                raise pickle.UnpicklingError(
                    "a CPU tensor shared by file descriptor cannot reach another process over HTTP: the "
                    'sender must share CPU tensors with torch\'s "file_system" strategy'
                )
        if module in (PATCH_TORCH_MODULE, OLD_PATCH_TORCH_MODULE) and name == "_rebuild_cuda_tensor_modified":
            return _rebuild_cuda_tensor_modified
        if module.startswith("sglang.srt.") and name == "LocalSerializedTensor":
            return LocalSerializedTensor
        if module == TENSOR_BUCKET_MODULE and name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype) or obj is torch.Size or obj is torch.Tensor:
                return obj
            if isinstance(obj, type) and name.endswith("Storage"):
                return obj
        if (module, name) in (
            ("torch.nn.parameter", "Parameter"),
            ("torch.storage", "TypedStorage"),
            ("torch.storage", "UntypedStorage"),
        ):
            return super().find_class(module, name)
        if (module, name) == ("collections", "OrderedDict"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weight payload")


def deserialize(data: str | bytes) -> Any:
    """What `serialize` (or SGLang's MultiprocessingSerializer) wrote: base64 text or raw pickle bytes."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return _Unpickler(io.BytesIO(data)).load()


def reconstruct(flat: torch.Tensor, meta: list) -> Named:
    """The tensors of a flattened bucket: views of `flat` (SGLang's FlattenedTensorBucket.reconstruct_tensors:
    a byte range viewed as the dtype, or an element range of a flat tensor of that dtype)."""
    out = []
    for m in meta:
        shape = torch.Size(m.shape)
        part = flat[m.start_idx : m.end_idx]
        if part.numel() * part.element_size() != shape.numel() * m.dtype.itemsize:
            raise ValueError(
                f"{m.name}: [{m.start_idx}, {m.end_idx}) of the flat bucket does not hold "
                f"{list(shape)} {m.dtype} (or lies outside its {flat.numel()} elements)"
            )
        out.append((m.name, part.view(m.dtype).reshape(shape)))
    return out


def load_payload(entry: str | bytes, load_format: str | None) -> Named:
    """One TP rank's entry of `serialized_named_tensors` as (name, tensor) pairs; the tensors map the
    sender's memory until they are dropped. Raises ValueError for a payload of the wrong shape."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r}: expected null, 'direct' or {FLATTENED_BUCKET!r}")
    obj = deserialize(entry)
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= obj.keys():
            raise ValueError("a flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': [...]}")
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor):
            raise ValueError("flattened_tensor is not a tensor")
        return NamedTensors(reconstruct(flat, list(obj["metadata"])))
    if isinstance(obj, dict):
        obj = list(obj.items())
    named = []
    for item in obj:
        if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], LocalSerializedTensor):
            item = (item[0], deserialize(item[1].values[0]))  # this engine is TP rank 0
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError("a direct payload is a list of (name, tensor) pairs")
        named.append((str(item[0]), item[1]))
    return NamedTensors(named)


@dataclasses.dataclass
class _KeptPayload:
    """A payload a receiver keeps: the tensors it rebuilt, the CPU storages whose sender references a
    repeat drops, every storage behind it by address, its reference (PAYLOAD_REF) and its text."""

    named: Named
    cpu: list[torch.UntypedStorage]
    held: dict[int, torch.UntypedStorage]
    ref: str
    text: str


class OpenedHandles:
    """What a receiver opened, kept between calls: the sender storages it mapped, and each payload it
    loaded with the tensors that payload rebuilt, so that a sender repeating a payload (its persistent
    buffers: the ring's slots, or the trainer's own parameters, serialized once: weight_bus.ipc_transfer)
    costs no unpickling and no handle lookups at all: `lookup` returns the tensors mapped last time.

    A payload names its storages by handle (CUDA-IPC handle and offset, or the shared-memory file's name)
    and carries the sender's reference-counter slots, so two payloads are the same text only when they
    name the same live sender buffers: a sender that reallocated, restarted or serialized anew sends new
    text, which misses and is opened afresh.

    An update is the calls up to the one that carries a weight version: `end_update` keeps what that
    update used and drops the rest, so a sender buffer that changed (reallocated, a restarted sender, a
    smaller ring) is closed after the next complete update, and at most two updates' buffers stay
    mapped. `clear` drops everything (a failed load: the next update opens afresh)."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.UntypedStorage] = {}
        self.used: dict[int, torch.UntypedStorage] = {}
        self.payloads_kept: dict[tuple[str | None, str], _KeptPayload] = {}
        self.payloads_used: dict[tuple[str | None, str], _KeptPayload] = {}
        """(load format, payload text or its reference) -> the payload kept: found by either alike."""

    def lookup(self, entry: str, load_format: str | None) -> Named | None:
        """The tensors `entry` (a payload, or a reference to one: PAYLOAD_REF) mapped when this receiver
        loaded it before (and keeps), else None. A hit takes the payload's references as rebuilding it
        would: the sender takes one per delivery of a CPU storage (weight_bus.ipc.share), which the
        receiver's rebuild drops."""
        key = (load_format, entry)
        kept = self.payloads_used.get(key) or self.payloads_kept.get(key)
        if kept is None:
            return None
        for s in kept.cpu:
            s._shared_decref()
        self._use(load_format, kept)
        return kept.named

    def remember(self, entry: str, load_format: str | None, named: Named) -> str:
        """`entry` loaded into `named`: keep both (and the storages behind them) for the next call.
        Returns the reference a sender may send instead of `entry` while it is kept."""
        kept = self.payloads_used.get((load_format, entry))
        if kept is None:
            held = {s.data_ptr(): s for s in storages(t for _, t in named)}
            ref = PAYLOAD_REF + hashlib.blake2b(entry.encode(), digest_size=16).hexdigest()
            kept = _KeptPayload(named, [s for s in held.values() if s.device.type == "cpu"], held, ref, entry)
            self._use(load_format, kept)
        return kept.ref

    def _use(self, load_format: str | None, kept: _KeptPayload) -> None:
        """Mark a kept payload (and its storages) used by this update, under its text and its reference."""
        self.payloads_used[(load_format, kept.text)] = kept
        self.payloads_used[(load_format, kept.ref)] = kept
        self.used.update(kept.held)

    def end_update(self) -> int:
        """The update ended: keep its storages and payloads, close the others. Returns how many storages
        were closed."""
        closed = len(self.kept.keys() - self.used.keys())
        self.kept, self.used = self.used, {}
        self.payloads_kept, self.payloads_used = self.payloads_used, {}
        return closed

    def clear(self) -> int:
        """Close every kept storage and forget every payload. Returns how many storages there were."""
        n = len(self.kept.keys() | self.used.keys())
        self.kept, self.used = {}, {}
        self.payloads_kept, self.payloads_used = {}, {}
        return n

    def __len__(self) -> int:
        return len(self.kept.keys() | self.used.keys())


def storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (what a payload of them shares by handle; an
    empty one travels without)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())
