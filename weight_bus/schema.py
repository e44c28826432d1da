"""Bodies of the engines' weight-update endpoints (SGLang native API, docs/sglang_api.md §3)."""

from __future__ import annotations

import msgspec

DEFAULT_GROUP = "weight_update_group"


class InitWeightsUpdateGroup(msgspec.Struct, kw_only=True, omit_defaults=True):
    """POST /init_weights_update_group: join {trainer rank 0, engine ranks} at tcp://addr:port."""

    master_address: str
    master_port: int | str
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float | None = None
    """Slipstream extension (the built-in engine only; SGLang has no such field, and a null is never
    sent): bound on each collective of the group, so an engine whose peer died gives up its receive, and
    its weight lock, after this long. None: weight_bus.group.DEFAULT_TIMEOUT_S."""


class UpdateWeightsFromDistributed(msgspec.Struct, kw_only=True):
    """POST /update_weights_from_distributed: receive tensors broadcast from rank 0 in `names` order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    """None: one broadcast per tensor; "flattened_bucket": one uint8 broadcast of all tensors' bytes."""
    lora_name: str | None = None
    """Slipstream extension (the built-in engine only; never sent to SGLang): the tensors are a whole LoRA
    adapter under PEFT's names (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`), loaded as
    adapter `lora_name` (replacing it atomically if loaded) instead of into the base weights."""
    lora_config: dict | None = None
    """With `lora_name`: the adapter's PEFT adapter_config (r, lora_alpha, target_modules)."""
    stream: list[StreamBucket] | None = None
    """Slipstream extension (the built-in engine only; never sent to SGLang): the whole update in this one
    call. The engine receives these buckets back to back, in order, one broadcast each (`names`, `dtypes`
    and `shapes` above stay empty), and answers once the last one is in and `weight_version` set. It
    holds its step boundary meanwhile (generation waits, in-flight requests keep their KV: the pause is
    folded into the call) unless `stage` lets it generate on until the swap."""
    layout: str | None = None
    """With `stream` buckets that carry an `offset`: the digest of the engine's WeightLayout the trainer
    planned them from; an engine whose layout differs refuses the update before anything is received."""
    stage: bool = False
    """With `stream`: receive the weight-arena buckets into a second arena beside the serving one while
    generation goes on, and copy it over the serving weights at one step boundary at the end (the pause
    is that copy, not the transfer). Costs the engine one more copy of its weights in device memory,
    allocated at the first staged update and kept; an engine that cannot allocate it receives in place."""


class StreamBucket(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One bucket of a streamed update (UpdateWeightsFromDistributed.stream): one broadcast of `nbytes`.
    With `offset`, the bytes are the engine's weight arena [offset, offset + nbytes) and are received
    straight into it; without, they are a flattened bucket of the named tensors, copied into the weights
    (or, with `lora_name`, kept for the adapter) as the per-bucket call does."""

    nbytes: int
    offset: int | None = None
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []


class LayoutEntry(msgspec.Struct, array_like=True):
    """Where one HF-named tensor lives in an engine's weight arena (tied names share their bytes)."""

    name: str
    offset: int
    """Byte offset of the tensor's first element in the arena."""
    dtype: str
    shape: list[int]


class WeightLayout(msgspec.Struct, kw_only=True):
    """GET /weight_layout (built-in engine): every weight of the engine in one contiguous arena, in HF
    state_dict order, each layer's q/k/v and gate/up adjacent (the fused projections are views of it). A
    trainer that knows it packs each bucket as a byte range of the arena, which the engine receives in
    place: no receive buffer, no copy."""

    nbytes: int
    """The arena's size in bytes (gaps between tensors included: each block starts 256-byte aligned)."""
    entries: list[LayoutEntry]
    digest: str
    """Identifies the layout (names, offsets, dtypes, shapes, size); /get_server_info's `weight_layout`."""


class UpdateWeightsFromTensor(msgspec.Struct, kw_only=True):
    """POST /update_weights_from_tensor: load tensors the sender shares through CUDA IPC (on CPU: shared
    memory); each entry of `serialized_named_tensors` is one TP rank's weight_bus.ipc payload."""

    serialized_named_tensors: list[str]
    """One entry per TP rank: base64 of a ForkingPickler pickle (SGLang's MultiprocessingSerializer)."""
    load_format: str | None = None
    """None or "direct": a list of (name, tensor); "flattened_bucket": {"flattened_tensor", "metadata"}."""
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class BuiltinUpdateWeightsFromTensor(UpdateWeightsFromTensor, kw_only=True):
    """What the built-in engine's /update_weights_from_tensor takes beyond SGLang's body (never sent to
    SGLang). Its answer also names the payload it keeps (`payload_ref`), which a sender may send in the
    payload's place while the engine keeps it (weight_bus.ipc.PAYLOAD_REF)."""

    completion: str | None = None
    """COMPLETION_EVENT asks a CUDA engine to answer once the copy is queued, with `event` (base64 of its
    interprocess CUDA event's IPC handle, recorded after the copy) for the sender to wait on before it
    reuses the memory; None: the engine answers once the copy is done, as SGLang does."""


COMPLETION_EVENT = "event"


class UpdateWeightVersion(msgspec.Struct, kw_only=True):
    """POST /update_weight_version (SGLang's UpdateWeightVersionReqInput)."""

    new_version: str
    abort_all_requests: bool = False


class DestroyWeightsUpdateGroup(msgspec.Struct, kw_only=True):
    group_name: str = DEFAULT_GROUP


class MemoryOccupation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """POST /release_memory_occupation and /resume_memory_occupation (SGLang's
    ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput): which device memory to release or
    take back: any of "kv_cache", "weights", "cuda_graph"; None (or empty) = all of them."""

    tags: list[str] | None = None


class LoadLoraAdapter(msgspec.Struct, kw_only=True):
    """POST /load_lora_adapter (SGLang's LoadLoRAAdapterReqInput): load the PEFT adapter directory
    `lora_path` (adapter_config.json + adapter_model.safetensors) as `lora_name`."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraAdapter(msgspec.Struct, kw_only=True):
    """POST /unload_lora_adapter (SGLang's UnloadLoRAAdapterReqInput)."""

    lora_name: str


class LoadLoraAdapterFromTensors(msgspec.Struct, kw_only=True):
    """POST /load_lora_adapter_from_tensors (SGLang's LoadLoRAAdapterFromTensorsReqInput): the adapter's
    tensors shared as in /update_weights_from_tensor (one weight_bus.ipc payload per TP rank, PEFT names),
    with its PEFT adapter_config as `config_dict`."""

    lora_name: str
    config_dict: dict
    serialized_named_tensors: list[str]
    load_format: str | None = None
    pinned: bool = False
