"""Process groups for the weight bus, created without touching torch.distributed's default group.

The trainer already owns a default group (its FSDP world) and an engine may too, so the bus builds a
stateless group from its own TCPStore, like vLLM's StatelessProcessGroup: rank 0 (the trainer) hosts
the store, engines connect to it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def new_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a group; blocks until all `world_size` ranks have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
    )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend {backend!r}: expected gloo or nccl")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
