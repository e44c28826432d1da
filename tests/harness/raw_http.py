"""Raw-socket HTTP clients for the servers' limit tests (slow heads, chunked bodies, server closes): what
httpx cannot send on purpose. Shared by the control API's and the engine's tests."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def connect(url: str, timeout_s: float) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def read_until_closed(s: socket.socket) -> bytes:
    """Block until the server closes the connection; what it sent before (b"" for a silent close)."""
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def send_chunks(s: socket.socket, total: int, chunk: int = 1 << 20) -> int:
    """Send up to `total` bytes as HTTP chunks; the bytes sent before the server closed the connection."""
    sent = 0
    data = b"%x\r\n" % chunk + b"a" * chunk + b"\r\n"
    try:
        while sent < total:
            s.sendall(data)
            sent += chunk
        s.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


@contextmanager
def trickling(socks: list[socket.socket]) -> Iterator[None]:
    """A slowloris: while inside, each of `socks` (each with a request head that never ends) gets a byte a
    second, so the server sees them busy; on the way out the trickle stops and the sockets are closed."""
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(1.0):
            for s in socks:
                try:
                    s.sendall(b"X")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
