"""Raw-socket HTTP clients for the servers' limit tests (slow heads, chunked bodies, server closes): what
httpx cannot send on purpose. Shared by the control API's and the engine's tests."""

from __future__ import annotations

import socket


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
