"""Small network helpers shared by every process that opens a listening socket."""

import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

PICK_LOW = 20000
"""The lowest port `free_port` picks: above Ray's worker ports (`ray start` takes 10002-19999)."""
PICK_TRIES = 64
_pick = random.SystemRandom()  # not the global generator: processes that seed it alike would pick alike


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (what a bind to port 0 or an outgoing connection takes)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a store, a server, a test). Picked at random below the
    kernel's ephemeral range and above Ray's worker ports, so that between this probe and the service's own
    bind no bind to port 0 or outgoing connection (Ray's processes make hundreds) can take it; where the
    ephemeral range leaves no room below it, the kernel's pick."""
    low = ephemeral_range()[0]
    if low > PICK_LOW + PICK_TRIES:
        for port in _pick.sample(range(PICK_LOW, low), PICK_TRIES):
            # free on every address (as the kernel's own pick is), not only on `host`
            if _bindable("0.0.0.0", port) and _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_local(url: str) -> bool:
    """Whether the server at `url` (http://host:port) runs on this host: its host resolves to an
    address this host can bind to (loopback, or one of its interfaces)."""
    host = urlsplit(url).hostname
    if host is None:
        return False
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((addr, 0))
            return True
        except OSError:
            continue
    return False


def default_route_address() -> str | None:
    """This machine's address on its default route (a UDP connect: no packet is sent); None without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
    except OSError:
        return None
