"""Small network helpers shared by every process that opens a listening socket."""

import socket
from urllib.parse import urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a store, a server, a test)."""
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
