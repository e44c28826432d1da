"""The TCPStores Slipstream hosts (the weight bus's group store, the trainer's rendezvous store) listen on the
address their peers are told to dial, never on every interface: the store has no credential, so the bind is
what keeps its keys private. Checked on this process's listening sockets (psutil)."""

from __future__ import annotations

import os
import socket

import psutil
import pytest

from trainer.distributed import host_store
from weight_bus.group import tcp_store


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every socket this process listens on."""
    conns = psutil.Process(os.getpid()).net_connections(kind="inet")
    return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}


def _listen_addrs(port: int, before: frozenset = frozenset()) -> set[str]:
    """The addresses this process listens on at `port`, leaving out the sockets in `before` (stores an
    earlier test of this process left open: on another address, one may have the same port number)."""
    return {ip for ip, p in _listening() - before if p == port}


def _non_loopback_ip() -> str | None:
    """An address of this host other than loopback, if it has one (the route to a private address)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_bus_store_listens_on_its_master_address_only():
    store = tcp_store("127.0.0.1", 0, 2, True, 10.0)
    assert store.port > 0
    assert _listen_addrs(store.port) == {"127.0.0.1"}
    # peers still reach it on that address
    peer = tcp_store("127.0.0.1", store.port, 2, False, 10.0)
    store.set("k", "v")
    assert peer.get("k") == b"v"


def test_trainer_rendezvous_store_listens_on_its_address_only():
    store = host_store("127.0.0.1", 1)
    assert _listen_addrs(store.port) == {"127.0.0.1"}


def test_store_on_loopback_is_not_reachable_on_another_address():
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no address besides loopback")
    store = tcp_store("127.0.0.1", 0, 2, True, 10.0)
    with pytest.raises(OSError):
        socket.create_connection((ip, store.port), timeout=2).close()


def test_store_hosted_on_a_host_address_listens_there_only():
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no address besides loopback")
    before = frozenset(_listening())
    store = tcp_store(ip, 0, 2, True, 10.0)
    assert _listen_addrs(store.port, before) == {ip}
    peer = tcp_store(ip, store.port, 2, False, 10.0)
    store.set("k", "v")
    assert peer.get("k") == b"v"
