"""Process groups for the weight bus, created without touching torch.distributed's default group.

The trainer already owns a default group (its FSDP world) and an engine may too, so the bus builds a
stateless group from its own TCPStore, like vLLM's StatelessProcessGroup: rank 0 (the trainer) hosts
the store, engines connect to it. Every group has a timeout: a collective that a dead or hung peer
never completes fails after `timeout_s` instead of blocking forever.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""Bound on each collective and on group setup (and, on the bus, on each engine HTTP call)."""


def master_address_for(engine_urls: list[str]) -> str:
    """Where engines can reach rank 0's store: 127.0.0.1 while every engine is on this host's loopback,
    else this host's address on the route to the first remote engine (no packet is sent)."""
    from urllib.parse import urlparse

    remote = [
        h for u in engine_urls if (h := urlparse(u).hostname) and h not in ("127.0.0.1", "localhost", "::1")
    ]
    return address_toward(remote[0]) if remote else "127.0.0.1"


def address_toward(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent): where a peer that dials `host`
    can reach this process back. 127.0.0.1 for a loopback `host`."""
    from ipaddress import ip_address

    try:
        if ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a name
        if host == "localhost":
            return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def tcp_store(
    master_address: str, master_port: int, world_size: int, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """A group's store: rank 0 hosts it (`master_port` 0: the OS picks a free port, read it from
    `.port`; no window in which another process can take it), the others connect to it, retrying until
    `timeout_s`.

    The host listens on `master_address` only (the address its peers are told to dial), never on every
    interface: torch's store server binds the wildcard address itself, so it gets a socket bound and
    listening here (`master_listen_fd`). The store has no credential; the bind is what keeps it private."""
    fd = None
    if is_master:
        sock = listen_socket(master_address, int(master_port))
        master_port, fd = sock.getsockname()[1], sock.detach()
    # The store owns `fd` from here on (it closes it, also when it fails to start).
    return dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host` (an address or a name; port 0: the OS picks) and listening."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def group_on(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout_s: float,
    local_address: str | None = None,
) -> dist.ProcessGroup:
    """The group over `store` (prefixed with `group_name`). gloo blocks until all `world_size` ranks have
    joined (at most `timeout_s`); NCCL connects lazily, at the first collective.

    gloo: this rank's transport listens on `local_address` (this host's address toward the store, which
    the peers can dial) and advertises it to them. Left to itself, gloo takes the address the host name
    resolves to, often 127.0.0.1 or 127.0.1.1 (/etc/hosts): peers on other nodes then dial their own
    loopback. An operator's GLOO_SOCKET_IFNAME still wins."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        if local_address is None or os.environ.get("GLOO_SOCKET_IFNAME"):
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend {backend!r}: expected gloo or nccl")


def new_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a group at a known port: `tcp_store` + `group_on`."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: expected gloo or nccl")
    store = tcp_store(master_address, master_port, world_size, rank == 0, timeout_s)
    local = master_address if rank == 0 else address_toward(master_address)
    return group_on(store, rank, world_size, backend, group_name, timeout_s, local)


def broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> dist.Work:
    """Start a broadcast; poll `work.is_completed()`, then `work.wait()` raises if it failed. On NCCL it
    runs on the group's stream after the work queued so far on the current stream."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return group.broadcast([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    broadcast_async(group, tensor, src).wait()


def shutdown_group(group: dist.ProcessGroup | None) -> None:
    """Abort a group we are leaving (NCCL: frees a communicator a dead peer left hanging). Best effort:
    the group may already be broken."""
    if group is None:
        return
    for method in ("abort", "shutdown"):
        fn = getattr(group, method, None)
        if fn is not None:
            try:
                fn()
            except Exception as e:  # a broken group may refuse; dropping it is what matters
                log.debug("%s of a weight group failed: %s", method, e)
            return


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
