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


@contextmanager
def scripted_server(actions: list[bytes | None]) -> Iterator[tuple[str, list[bytes]]]:
    """A one-thread HTTP server on 127.0.0.1 whose i-th connection reads one request head and then does
    `actions[i]`: bytes, send them (a whole response) and close; None, close without answering. Past the
    list it holds connections open unanswered (an engine that hangs). Yields its URL and the request
    heads it read, one per connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    heads: list[bytes] = []
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # shut down on the way out
                return
            head = b""
            while b"\r\n\r\n" not in head and (chunk := conn.recv(65536)):
                head += chunk
            heads.append(head)
            if len(heads) > len(actions):
                held.append(conn)
                continue
            if (action := actions[len(heads) - 1]) is not None:
                conn.sendall(action)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", heads
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone leaves it blocked)
        listener.close()
        t.join(5)
        for conn in held:
            conn.close()
