"""HTTP/1.1 pipelining to one engine: requests written on one kept-alive connection without waiting for
the previous answer; answers come back in order (uvicorn, which serves SGLang and the built-in engine,
handles a connection's requests one after another, in the order they arrived).

Why: the bus announces bucket k+1 while bucket k is still on the wire. Waiting for k's answer before
sending k+1 puts a network round trip and a thread hand-off into every bucket, which at NVLink speed
(~1.5 ms per 512 MiB) left the wire idle half the time. On one connection the order is also guaranteed,
which two parallel connections would not give (the engine must receive bucket k's bytes as bucket k).

An https:// engine (behind a TLS proxy) gets `SerialPipeline`: the same ordered Futures, but each request
waits for the previous answer (an SSL connection cannot be written by one thread while another reads it),
over httpx with `$SLIPSTREAM_CA_CERT`'s CA (common/tls.py).
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

IDLE_RECONNECT_S = 1.0
"""A connection idle for this long is replaced before the next request: servers close idle
keep-alive connections (uvicorn after 5 s), and a request written into one being closed is lost."""


class Response:
    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body


class Pipeline:
    """Ordered requests to one engine; `post` returns a Future of Response (or of the connection's
    error: every request still unanswered fails when the connection does)."""

    def __init__(self, url: str, headers: dict[str, str], connect_timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: only http:// is pipelined")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: collections.deque[Future] = collections.deque()
        self._last_used = 0.0

    def post(self, path: str, body: bytes) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # sent at once: there is nothing left to cancel
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        with self._lock:
            try:
                if self._sock is None or (
                    not self._pending and time.monotonic() - self._last_used > IDLE_RECONNECT_S
                ):
                    self._connect()
                self._pending.append(fut)
                self._sock.sendall(request)
                self._last_used = time.monotonic()
            except OSError as e:
                self._fail(self._sock, e)
                if not fut.done():  # the connection could not even be made
                    fut.set_exception(e)
        return fut

    def close(self) -> None:
        """Drop the connection; unanswered requests fail (ConnectionError)."""
        with self._lock:
            self._fail(self._sock, ConnectionError("pipeline closed"))

    # --- internals ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._sock is not None:
            self._fail(self._sock, ConnectionError("replaced an idle connection"))
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        sock.settimeout(None)  # reads wait for the bus's own deadlines, which close the socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        threading.Thread(target=self._read, args=(sock,), name="bus-pipeline", daemon=True).start()

    def _fail(self, sock: socket.socket | None, err: BaseException) -> None:
        """(Lock held.) Close `sock` if it is still ours and fail what was waiting on it."""
        if sock is None or sock is not self._sock:
            return
        self._sock = None
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        while self._pending:
            f = self._pending.popleft()
            if not f.done():
                f.set_exception(err if isinstance(err, Exception) else ConnectionError(str(err)))

    def _read(self, sock: socket.socket) -> None:
        reader = _Reader(sock)
        try:
            while True:
                status, headers, body = reader.response()
                with self._lock:
                    if sock is not self._sock or not self._pending:
                        return
                    self._pending.popleft().set_result(Response(status, body))
                    if headers.get("connection", "").lower() == "close":
                        self._fail(sock, ConnectionError("server closed the connection"))
                        return
        except (OSError, ValueError) as e:
            with self._lock:
                self._fail(sock, e if isinstance(e, OSError) else ConnectionError(str(e)))


class SerialPipeline:
    """`Pipeline`'s interface for an https:// engine: requests sent in order by one thread, each after the
    previous answer, on one kept-alive TLS connection (httpx)."""

    def __init__(self, url: str, headers: dict[str, str], connect_timeout_s: float) -> None:
        import httpx

        from common import tls

        if urlsplit(url).scheme != "https":
            raise ValueError(f"{url}: SerialPipeline is for https://")
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            headers={**headers, "Content-Type": "application/json"},
            timeout=httpx.Timeout(None, connect=connect_timeout_s),  # as Pipeline: the bus's deadlines
            verify=tls.verify(),
        )
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="bus-serial")

    def post(self, path: str, body: bytes) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                fut.set_exception(ConnectionError("pipeline closed"))
                return fut
            self._pending.add(fut)
            self._thread.submit(self._send, fut, path, body)
        return fut

    def _send(self, fut: Future, path: str, body: bytes) -> None:
        try:
            if fut.done():  # failed by close()
                return
            resp = self._http.post(self.url + path, content=body)
            result: Response | BaseException = Response(resp.status_code, resp.content)
        except Exception as e:
            result = e
        with self._lock:
            self._pending.discard(fut)
            if fut.done():
                return
            if isinstance(result, Response):
                fut.set_result(result)
            else:
                fut.set_exception(result)

    def close(self) -> None:
        """Unanswered requests fail (ConnectionError); the connection is dropped."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, set()
            for f in pending:
                if not f.done():
                    f.set_exception(ConnectionError("pipeline closed"))
        self._thread.shutdown(wait=False)
        self._http.close()


class _Reader:
    """Parses HTTP/1.1 responses off a socket (Content-Length or chunked bodies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("connection closed by the server")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status_line = self._line()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ValueError(f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        while line := self._line():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(self._line().split(b";")[0], 16):
                body += self._take(size)
                self._take(2)
            while self._line():  # trailers, then the blank line
                pass
        else:
            body = self._take(int(headers.get("content-length", "0")))
        return status, headers, body
