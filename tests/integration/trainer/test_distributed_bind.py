"""The trainer pool's sockets listen only on the address its ranks are given: 2 real spawned gloo ranks,
their listening sockets read from the kernel (psutil) while the group is up."""

from __future__ import annotations

import json
import socket

import psutil
import pytest
from rank_runs import start_ranks

from common.net import free_port


def _worker(rank: int, world: int, addr: str, port: int, out: str) -> None:
    import os

    import torch

    from trainer.distributed import DistInfo, RankGroup

    # The parent's test environment must not decide the interface: the pool does.
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.pop(name, None)
    pool = RankGroup(
        DistInfo(rank=rank, world_size=world, master_addr=addr, master_port=port), torch.device("cpu")
    )
    total = pool.all_reduce(torch.ones(1))  # the transport carries data: both ranks are connected
    listening = sorted(
        {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    )
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"sum": total.item(), "listening": listening}, f)
    pool.barrier()  # nobody closes before every rank has read its sockets
    pool.close()


def _listening(addr: str, tmp_path) -> list[dict]:
    port = free_port(addr)
    start_ranks(_worker, (2, addr, port, str(tmp_path)), 2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_loopback_group_listens_only_on_loopback(tmp_path):
    for rank in _listening("127.0.0.1", tmp_path):
        assert rank["sum"] == 2.0
        assert rank["listening"] == ["127.0.0.1"]


def _external_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_a_group_on_the_hosts_address_listens_only_there(tmp_path):
    """The other direction, which also fails where the host name resolves to 127.0.0.1 (gloo's default)."""
    addr = _external_ipv4()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    for rank in _listening(addr, tmp_path):
        assert rank["sum"] == 2.0
        assert rank["listening"] == [addr]
