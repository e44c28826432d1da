"""One-off HTTP calls for the tests: httpx's module-level functions (a new client per call, so no pooled
connection outlives the call), with the process's one default TLS context (common.tls.default_context).
httpx builds a context for every client it creates, loading certifi's CA bundle each time (~45 ms of CPU),
and the suite makes about a thousand such calls. A call that passes its own `verify` keeps it."""

from __future__ import annotations

from typing import Any

import httpx

from common import tls


def request(method: str, url: str, **kw: Any) -> httpx.Response:
    kw.setdefault("verify", tls.default_context())
    return httpx.request(method, url, **kw)


def get(url: str, **kw: Any) -> httpx.Response:
    return request("GET", url, **kw)


def post(url: str, **kw: Any) -> httpx.Response:
    return request("POST", url, **kw)


def put(url: str, **kw: Any) -> httpx.Response:
    return request("PUT", url, **kw)


def delete(url: str, **kw: Any) -> httpx.Response:
    return request("DELETE", url, **kw)


def stream(method: str, url: str, **kw: Any):
    """httpx.stream (a context manager of the response)."""
    kw.setdefault("verify", tls.default_context())
    return httpx.stream(method, url, **kw)
