"""The weight bus's config (`BusSpec`): the update group's backend, buckets, pause mode, timeouts and
how often the trainer publishes."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.config import Pos, Seconds, Spec

BACKENDS = ("gloo", "nccl", "ipc")
"""How weights reach the engines: a torch.distributed group's broadcast (gloo, nccl), or handles to the
trainer's memory (ipc: CUDA IPC, on CPU shared memory) for engines on the trainer's host."""
PAUSE_MODES = ("in_place", "retract", "abort")
"""How engines pause for a weight swap (`bus.pause_mode`)."""
DTYPES = ("bfloat16", "float16", "float32")
"""What weights may travel and load as (`bus.dtype`)."""
BUCKET_BYTES = 512 * 1024 * 1024
"""Default largest bucket of flattened parameters (bytes), one broadcast each."""


class BusSpec(Spec):
    backend: Literal[BACKENDS] = "gloo"
    """gloo or nccl: one process group {trainer rank 0, every engine}, one broadcast per bucket. ipc:
    engines on the trainer's host (colocated) load each bucket straight from the trainer's memory (CUDA
    IPC; shared memory on CPU) through SGLang's /update_weights_from_tensor."""
    bucket_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)] = BUCKET_BYTES
    """Parameters are flattened into buckets of at most this many bytes, one broadcast each."""
    pause_mode: Literal[PAUSE_MODES] = "in_place"
    """How engines pause for the swap: keep in-flight requests with their KV cache (in_place: partial
    rollouts, later tokens carry the new version), free their KV and re-prefill them after the swap
    (retract), or abort them (abort: workers resume them from their prefix)."""
    dtype: Literal[DTYPES] | None = None
    """What the weights travel and load as; null = the engines' dtype (/get_server_info) when they all
    report one, else the trainer's."""
    timeout_s: Seconds = 60.0
    """Bound on every engine call and collective of an update: an engine that dies or stalls longer is
    dropped from the update group and the update goes on with the others (seconds, at most a day)."""
    master_address: str | None = None
    """Address engines reach the trainer's update group at (rank 0 hosts its store there); null =
    127.0.0.1 while every engine is local, else this node's address on its default route."""
    stage_weights: bool = False
    """gloo/nccl to built-in engines: each engine receives an update into a second copy of its weights
    while it goes on generating, and copies it over the serving weights at one step boundary at the end,
    so generation waits for that copy (about 2 ms for 3 GB on an H200) instead of the whole transfer.
    Costs every engine one more copy of its weights in device memory (3 GB at 1.5B, 15 GB at 7B in bf16),
    allocated at its first staged update; an engine without room for it receives in place."""
    update_every: Pos = 1
    """Publish weights every this many optimizer steps (and after the last one)."""
    idle_sync_s: Seconds = 5.0
    """When the trainer has waited this long for a batch while engines wait to join (new ones, or ones
    dropped and due for a retry), it publishes its current weights to admit them now instead of at its
    next step: with every engine gone or joining, no rollout comes and that step never would."""


PLACEMENTS = ("disaggregated", "colocated")
"""Where a job's engines run relative to its trainer ranks (the job spec's top-level `placement`)."""
SCHEDULES = ("sync", "async")
"""How colocated engines and trainer ranks share their devices (`colocation.schedule`)."""


class ColocationSpec(Spec):
    """How colocated engines and trainer ranks share a device (`placement: colocated`)."""

    schedule: Literal[SCHEDULES] | None = None
    """`sync` (verl's hybrid engine): once the trainer has its batch, the engines release their memory
    (KV cache, weights, CUDA graphs) for the optimizer step and get it back, weights first, for the
    publish; `async`: both stay resident and overlap, the engine's weights and KV pool held to
    `generators.mem_fraction_static` (`generators.sglang.mem_fraction_static`; null here =
    ASYNC_MEM_FRACTION) so the trainer's peak fits beside them. null = `sync` with buffer.max_staleness
    0, else `async`."""


ASYNC_MEM_FRACTION = 0.3
"""The engines' share of a GPU on the async colocated schedule when the spec leaves it null."""


def colocated_schedule(colocation: ColocationSpec, max_staleness: int) -> str:
    """The schedule a colocated job runs: `colocation.schedule`, else sync with max_staleness 0."""
    if colocation.schedule is not None:
        return colocation.schedule
    return "sync" if max_staleness == 0 else "async"
