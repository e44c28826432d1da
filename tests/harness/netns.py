"""Nodes of a cluster as Linux network namespaces on one box: each node has its own network stack (its own
loopback, its own private address on a veth pair to the other node), while the file system and the
Python environment are shared. What one node binds on 127.0.0.1 the other cannot reach, as across real
machines, so a service bound to the wrong address shows up here.

`nodes()` makes them (root and `ip` needed: `unavailable()` says why not), `Node.run` / `Node.spawn` run a
command inside one, `Node.listeners()` is `ss -ltnp` there, and leaving `nodes()` kills every process
left in the namespaces and deletes them, also when the test failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

SUBNET = "10.77.0"
"""The private /24 of the test network; node i (from 0) is SUBNET.(i + 1)."""
KILL_GRACE_S = 5.0
"""How long teardown waits after SIGTERM before it SIGKILLs what is left in a namespace."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool, package in (("ip", "iproute2"), ("ss", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    probe = f"ssprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Listener(NamedTuple):
    """One listening TCP socket of `ss -ltnp`."""

    address: str
    """The bound address: an IPv4 address, `*`/`0.0.0.0`/`[::]` (every interface), IPv4-mapped unwrapped."""
    port: int
    process: str
    pid: int

    @property
    def loopback_only(self) -> bool:
        return self.address.startswith("127.") or self.address == "::1"

    @property
    def wildcard(self) -> bool:
        return self.address in ("*", "0.0.0.0", "::")


class Node(NamedTuple):
    """A namespace and the address other nodes reach it at."""

    name: str
    """`a`, `b`, ...: what tests call the node."""
    netns: str
    address: str

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def run(
        self, cmd: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run `cmd` in this node to its end (stdout and stderr captured as text); `env` is added to
        this process's environment. A failure (with `check`) raises with both streams in the message."""
        proc = subprocess.run(
            self.argv(cmd),
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"node {self.name}: {' '.join(cmd)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
            )
        return proc

    def listeners(self) -> list[Listener]:
        """Every listening TCP socket in this node, with its process (`ss -ltnpH`)."""
        out = self.run(["ss", "-ltnpH"]).stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            if len(cols) < 6:
                continue
            local, users = cols[3], " ".join(cols[5:])
            address, _, port = local.rpartition(":")
            address = address.strip("[]").removeprefix("::ffff:")
            process = users.split('"')[1] if '"' in users else "?"
            pid = int(users.split("pid=")[1].split(",")[0]) if "pid=" in users else 0
            found.append(Listener(address, int(port), process, pid))
        return found

    def pids(self) -> list[int]:
        """Every process running in this node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, hard: bool = False) -> None:
        """SIGTERM every process in the namespace, SIGKILL what is left after KILL_GRACE_S; `hard`: SIGKILL
        at once (a node that fails, with no chance to say so)."""
        for sig in (signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + KILL_GRACE_S
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)  # the kernel offers no wait on another process's exit
            if not self.pids():
                return


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def nodes(count: int = 2) -> Iterator[list[Node]]:
    """`count` nodes joined by one bridge in a namespace of its own, node i at SUBNET.(i + 1)/24 with its
    loopback up. On the way out, every process left in a node is killed and every namespace deleted."""
    tag = f"ss{os.getpid() % 100000}"  # unique per test process; interface names stay under 15 chars
    hub = Node("hub", f"{tag}hub", "")
    made: list[Node] = []
    try:
        _ip("netns", "add", hub.netns)
        _ip("-n", hub.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub.netns, "link", "set", "br0", "up")
        for i in range(count):
            node = Node(chr(ord("a") + i), f"{tag}{chr(ord('a') + i)}", f"{SUBNET}.{i + 1}")
            _ip("netns", "add", node.netns)
            made.append(node)
            outer = f"{tag}v{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("link", "set", outer, "netns", hub.netns)
            _ip("-n", hub.netns, "link", "set", outer, "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield made
    finally:
        for node in reversed(made):
            node.kill_all()
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", hub.netns], capture_output=True)
