"""What every Slipstream HTTP server (the control API, the built-in engine) puts in front of its app.

- `BearerGuard` (pure ASGI): the token is checked on the request head, before one byte of the body is
  received; a refused request with a body is answered with `Connection: close`, so its body is not read.
- `BodyGuard` (pure ASGI): a body over `max_bytes` is a 413, by its Content-Length before it is read or,
  chunked, as soon as the bytes received pass the limit; a body that stalls (no bytes for `body_timeout_s`)
  is a 408. Both answers close the connection, so the rest of the body is never read.
- `HttpLimits` / `server_config`: uvicorn's connection limits (keep-alive, concurrency) plus a request-head
  timeout uvicorn lacks: a connection whose request line and headers are not complete within
  `header_timeout_s` of its opening (or of the first byte of its next request) is closed (slowloris).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]
"""(status, message) -> the JSON body of an error answer, in the server's own shape."""

CLOSE = (b"connection", b"close")


def detail_body(status: int, message: str) -> bytes:
    """FastAPI's error shape: {"detail": message} (the control API's)."""
    return json.dumps({"detail": message}).encode()


async def send_error(
    send: Send,
    status: int,
    message: str,
    body: ErrorBody,
    headers: list[tuple[bytes, bytes]] = (),
    close: bool = True,
) -> None:
    """A complete JSON error answer; `close`: with `Connection: close` (the server then closes the
    connection after it, instead of reading the rest of a request body it does not want)."""
    data = body(status, message)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": head + ([CLOSE] if close else []) + list(headers),
        }
    )
    await send({"type": "http.response.body", "body": data})


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0") not in (b"0", b"")


def bearer_credentials(authorization: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` header value, b"" for any other scheme. The scheme
    is case-insensitive and may be followed by more than one space (RFC 7235 section 2.1), as FastAPI's
    HTTPBearer reads it: `bearer x` is the same credential as `Bearer x`."""
    scheme, _, token = authorization.partition(b" ")
    return token.lstrip(b" ") if scheme.lower() == b"bearer" else b""


class BearerGuard:
    """Requests that `public(method, path)` does not allow need `Authorization: Bearer <token>` (the
    scheme in any case; the token compared in constant time). No token (None or ""): everything passes."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        public: Callable[[str, str], bool],
        error_body: ErrorBody = detail_body,
        message: str = "missing or wrong bearer token",
    ) -> None:
        self.app = app
        self.expected = token.encode() if token else None
        self.public = public
        self.error_body = error_body
        self.message = message

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http":
            headers = dict(scope["headers"])
            given = bearer_credentials(headers.get(b"authorization", b""))
            if not self.public(scope["method"], scope["path"]) and not hmac.compare_digest(
                given, self.expected
            ):
                # A body is left unread: closing the connection is the only way not to read it.
                extra = [(b"www-authenticate", b"Bearer")]
                await send_error(send, 401, self.message, self.error_body, extra, close=_has_body(headers))
                return
        await self.app(scope, receive, send)


class BodyGuard:
    """413 for a body over `max_bytes` (declared or received), 408 for a body that stalls for
    `body_timeout_s` (None: no timeout). The app then sees a disconnect; whatever it sends is dropped."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        body_timeout_s: float | None = None,
        error_body: ErrorBody = detail_body,
        what: str = "the server's",
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self.error_body = error_body
        self.what = what

    def too_large(self) -> str:
        return f"request body over {self.what} limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = dict(scope["headers"]).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_bytes):
            await send_error(send, 413, self.too_large(), self.error_body)
            return
        seen = 0
        body_done = False
        answered = False  # we answered for the app: drop what it sends
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return
            started = True
            await send(message)

        async def refuse(status: int, text: str) -> Message:
            nonlocal answered, body_done
            body_done = True
            if not started:
                answered = True
                log.info("%s %s from %s: %d %s", scope["method"], scope["path"], _client(scope), status, text)
                await send_error(send, status, text, self.error_body)
            return {"type": "http.disconnect"}

        async def guarded_receive() -> Message:
            nonlocal seen, body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self.body_timeout_s):  # None: no timeout
                    message = await receive()
            except TimeoutError:
                return await refuse(408, f"no request body bytes for {self.body_timeout_s:g} s")
            if message["type"] != "http.request":
                body_done = True
                return message
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                return await refuse(413, self.too_large())
            if not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, guarded_receive, guarded_send)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


# ---- uvicorn ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """Connection limits of one HTTP server (uvicorn's options and the request-head timeout)."""

    header_timeout_s: float = 10.0
    """A request's line and headers must be complete this long after the connection opened or the
    first byte of the request arrived; else the connection is closed."""
    body_timeout_s: float = 30.0
    """A request body that sends nothing for this long is a 408 (connection closed)."""
    keep_alive_s: int = 5
    """An idle kept-alive connection is closed after this long (uvicorn's timeout_keep_alive)."""
    limit_concurrency: int = 256
    """Open connections + running requests beyond which new requests get 503 (uvicorn's option)."""

    def uvicorn_kwargs(self) -> dict[str, Any]:
        return {
            "http": head_timeout_protocol(self.header_timeout_s),
            "timeout_keep_alive": self.keep_alive_s,
            "limit_concurrency": self.limit_concurrency,
        }


API_LIMITS = HttpLimits(limit_concurrency=256)
"""The control API's defaults: a few CLI users and browser tabs, not a fleet."""
ENGINE_LIMITS = HttpLimits(limit_concurrency=8192)
"""The built-in engine's defaults: rollout workers keep up to 1024 connections each to an engine."""


def add_limit_arguments(p: argparse.ArgumentParser, defaults: HttpLimits) -> None:
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=defaults.header_timeout_s,
        help="close a connection whose request head is not complete after this long (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=defaults.body_timeout_s,
        help="a request body that stalls this long gets 408 (default %(default)s)",
    )
    p.add_argument(
        "--keep-alive-s",
        type=int,
        default=defaults.keep_alive_s,
        help="close idle kept-alive connections after this long (default %(default)s)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=defaults.limit_concurrency,
        help="open connections + requests beyond which requests get 503 (default %(default)s)",
    )


def limits_from_args(args: argparse.Namespace) -> HttpLimits:
    for key in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "limit_concurrency"):
        if not getattr(args, key) > 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")
    return HttpLimits(
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        keep_alive_s=args.keep_alive_s,
        limit_concurrency=args.limit_concurrency,
    )


class _Throttled:
    """Counts connections closed for a slow request head and logs them at most once a minute (a slowloris
    opens thousands: one line each would flood the log)."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self.count = 0
        self.logged_at: float | None = None

    def note(self, client: str, timeout_s: float) -> None:
        self.count += 1
        now = time.monotonic()
        if self.logged_at is None or now - self.logged_at >= self.EVERY_S:
            log.warning(
                "closed %d connection(s) whose request head was not complete within %g s (latest from %s)",
                self.count,
                timeout_s,
                client,
            )
            self.count, self.logged_at = 0, now


_HEAD_TIMEOUTS = _Throttled()
_PROTOCOLS: dict[float, type] = {}


def head_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (as `http="auto"` picks it) that closes a connection whose request
    head is not complete `timeout_s` after the connection opened or the next request's first byte."""
    if timeout_s in _PROTOCOLS:
        return _PROTOCOLS[timeout_s]
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_of: object = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_of:
                self._disarm()  # a request head completed
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                if not self.transport.is_closing():
                    self._arm()  # bytes of a next request, its head not complete yet

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_of = self.cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_of and not self.transport.is_closing():
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
                log.info(
                    "closing the connection from %s: no complete request head in %g s", client, timeout_s
                )
                self.transport.close()

    HeadTimeoutProtocol.__name__ = HeadTimeoutProtocol.__qualname__ = (
        f"HeadTimeout{AutoHTTPProtocol.__name__}"
    )
    _PROTOCOLS[timeout_s] = HeadTimeoutProtocol
    return HeadTimeoutProtocol
