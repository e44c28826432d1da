"""The trainer pool's process group and FSDP2 sharding.

Every trainer rank is one process (a Ray actor, or a torchrun / spawned process in benchmarks and tests).
Ranks join one default group (NCCL on CUDA, gloo on CPU, same code) for FSDP's all-gathers and
reduce-scatters, plus a gloo group for small Python objects (the step plan rank 0 sends out), so object
traffic never touches the GPU stream. Models are sharded with FSDP2 `fully_shard` per decoder layer and
at the root (embeddings, final norm and a tied LM head share the root's group).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Iterator

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from weight_bus.group import tcp_store

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout: generous, since rank 0 may wait this long for a batch while the others block."""


class DistInfo(msgspec.Struct, frozen=True):
    """Where this process sits in the trainer pool."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    """TCP port of rank 0's rendezvous store; 0 = no process group (single process, FSDP off)."""


def host_store(addr: str, world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a port the OS picks (`.port`), listening before any rank is told it."""
    return tcp_store(addr, 0, world_size, True, DEFAULT_TIMEOUT_S)


SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's IPv4 address."""


def interface_of(addr: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is `addr` (a name is resolved first),
    or None if none is (a peer's address, or an unresolvable name)."""
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # down, or no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


@contextlib.contextmanager
def transport_on(addr: str):
    """Groups created inside listen on the interface of `addr` (the address rank 0's store is on, which
    ranks dial), not on the one the host name resolves to: with a cluster on 127.0.0.1, a rank's gloo
    transport would otherwise listen on the host's external address, open to the network without any
    credential. Gloo and NCCL's bootstrap read their interface from these variables when a group is
    created, so they are set only for that; an operator's own setting wins. Where `addr` is not this host's
    (another node's rank 0), the backends' defaults stay."""
    iface = interface_of(addr)
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    added = [n for n in names if iface and not os.environ.get(n)]
    for n in added:
        os.environ[n] = iface
    try:
        yield
    finally:
        for n in added:
            os.environ.pop(n, None)


class RankGroup:
    """This rank's handles: the default group (collectives of the model) and a gloo group for objects."""

    def __init__(self, info: DistInfo, device: torch.device, store: dist.Store | None = None) -> None:
        """`store`: rank 0's rendezvous store, hosted already (`host_store`: no window in which another
        process takes its port); None = host (rank 0) or reach (the others) the store at `info`'s port."""
        self.rank = info.rank
        self.world_size = info.world_size
        self.device = device
        self.enabled = info.master_port > 0
        self.objects = None
        if not self.enabled:
            if info.world_size != 1:
                raise ValueError("more than one trainer rank needs a rendezvous port")
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # FSDP places shards on the current device
        with transport_on(info.master_addr):
            if not dist.is_initialized():
                # device_id: NCCL's communicator is made now (eagerly), inside transport_on, not at the
                # first collective.
                kw = {"device_id": device} if device.type == "cuda" else {}
                if store is None:
                    store = tcp_store(
                        info.master_addr, info.master_port, info.world_size, info.rank == 0, DEFAULT_TIMEOUT_S
                    )
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=info.rank,
                    world_size=info.world_size,
                    timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
                    **kw,
                )
            self.objects = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        log.info("trainer rank %d/%d joined (%s)", info.rank, info.world_size, backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def scatter(self, per_rank: list | None):
        """Rank 0 passes one object per rank; every rank gets its own (rank 0 included)."""
        if not self.enabled:
            return per_rank[0]
        out = [None]
        dist.scatter_object_list(out, per_rank if self.is_main else None, src=0, group=self.objects)
        return out[0]

    def broadcast(self, obj=None):
        """Rank 0's object to every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's object, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.objects)
        return out

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.enabled and self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.objects)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a transformers model (causal LM or bare backbone)."""
    for owner in (getattr(model, "model", None), model, getattr(model, "backbone", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def shard(
    model: nn.Module,
    *,
    mixed_precision: bool,
    cpu_offload: bool = False,
    layers: nn.ModuleList | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2: `fully_shard` every decoder layer, then the root. bf16 compute with fp32 master weights and
    fp32 gradient reduction when `mixed_precision`; parameters, gradients and optimizer state on the CPU
    when `cpu_offload` (the optimizer step then runs there). `reshard_after_forward` False keeps each
    block's gathered (bf16) parameters from its forward to its backward (ZeRO-2 like): one gather and
    cast per micro-batch instead of two, for the memory of one unsharded bf16 copy of the model."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    blocks = layers if layers is not None else decoder_layers(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered to a plain tensor (a collective: every rank calls it); plain tensors pass.
    On a mesh of one rank the local tensor is the whole one and is returned as it is, without DTensor's
    redistribute (a one-GPU trainer's publish gathers every parameter this way)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1 and t.device.type == t.device_mesh.device_type:
        local = t.to_local()
        if local.shape == t.shape:
            return local
    if t.device.type != t.device_mesh.device_type:  # CPU-offloaded shard, GPU mesh: gather on the GPU
        local = t.to_local().to(t.device_mesh.device_type)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()


def gathered_by_unit(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of an FSDP2 `model` (named_parameters order, tied ones once),
    gathered one FSDP unit at a time: a unit's `unshard` is one all-gather of all its parameters in the
    compute dtype (bf16 under mixed precision: the values its forward uses), where a gather per parameter
    is one collective each, in fp32, through DTensor. The next unit's all-gather is issued while this
    one's tensors go out (at most two units gathered at once). A collective: every rank drains the
    iterator. Each tensor is a copy (a unit is resharded, its gathered storage freed, once the next one
    is used); the root's own parameters (embedding, final norm, head) stay gathered until the end."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, nn.Module] = {}
    for unit in model.modules():  # pre-order: a block's own unit overwrites the root's claim
        if isinstance(unit, FSDPModule):
            for p in unit.parameters():
                owner[id(p)] = unit
    order = [(name, owner.get(id(p), model)) for name, p in model.named_parameters()]
    runs = [u for i, (_, u) in enumerate(order) if u is not model and (i == 0 or order[i - 1][1] is not u)]
    units = runs if len(runs) == len({id(u) for u in runs}) else []  # each block's parameters in one run
    pending: dict[int, object] = {}  # unit index -> its unshard handle (issued, not waited for)
    gathered: list[nn.Module] = []

    def issue(k: int) -> None:
        if k < len(units):
            pending[k] = units[k].unshard(async_op=True)
            gathered.append(units[k])

    model.unshard()
    k = -1
    try:
        issue(0)
        current: nn.Module | None = None
        for name, unit in order:
            if unit is not model and unit is not current:
                if current is not None:
                    current.reshard()
                    gathered.remove(current)
                if units:
                    k += 1
                    handle = pending.pop(k)
                    if handle is not None:
                        handle.wait()
                    issue(k + 1)
                else:  # a unit's parameters in several runs: gathered when used, no prefetch
                    unit.unshard()
                    gathered.append(unit)
                current = unit
            yield name, model.get_parameter(name).detach().clone()
    finally:
        for handle in pending.values():
            if handle is not None:
                handle.wait()
        for unit in gathered:
            unit.reshard()
        model.reshard()


def grad_norm_clip(params, max_norm: float) -> float:
    """clip_grad_norm_ over (possibly sharded) parameters; returns the total norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    return float(full_tensor(norm))
