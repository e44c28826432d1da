"""Small network helpers shared by every process that opens a listening socket."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a store, a server, a test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
