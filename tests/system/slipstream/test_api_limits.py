"""The control API's HTTP limits on a real cluster's API process (`python -m slipstream.cluster.api`, started by
`cluster.up`, default options): the token is checked on the request head, before any body byte is read
(a chunked upload of tens of MiB without a token is refused at once: the server neither reads it nor grows
by it; invalid JSON without a token is a 401, not a 422); a chunked body over 1 MiB with the token is a 413
while it is read; slow partial requests (slowloris, trickling a byte a second) are closed by the server
while a normal request still works."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import http_calls
from raw_http import connect, read_until_closed, send_chunks, trickling

from slipstream.cluster.api import MAX_BODY_BYTES

BODY = 96 << 20
"""A large upload: far more than the socket buffers between client and server hold."""
SLOW = 200
BOUND_S = 180.0
"""How long a test waits for the server to act (generous: a loaded 2-core CI box); never a measured value."""


def _auth(info) -> dict[str, str]:
    return {"Authorization": f"Bearer {info.api_token}"}


def _connect(info) -> socket.socket:
    return connect(info.api_url, BOUND_S)


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def test_a_chunked_upload_without_the_token_is_refused_before_it_is_read(info):
    pid = info.pids["api"]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = _status(pid)
    s = _connect(info)
    with s:
        s.sendall(b"POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(read_until_closed(s)))
        reader.start()
        sent = send_chunks(s, BODY)
        reader.join(BOUND_S)
    after = _status(pid)
    print(f"sent {sent >> 20} of {BODY >> 20} MiB; API process {before} -> {after} KiB")
    assert got and got[0].startswith(b"HTTP/1.1 401"), got
    assert b"token" in got[0] and b"connection: close" in got[0].lower()
    assert sent < BODY  # the server closed the connection instead of reading on
    assert after["VmHWM"] - before["VmRSS"] < (BODY >> 10) // 4  # peak memory did not grow by the body
    # The API still serves.
    assert http_calls.get(f"{info.api_url}/jobs", headers=_auth(info), timeout=30).status_code == 200


def test_invalid_json_without_the_token_is_401(info):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = http_calls.post(
            f"{info.api_url}/jobs",
            content=b'{"spec": not json',
            headers={**headers, "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 401, r.text
        assert "token" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
    r = http_calls.post(
        f"{info.api_url}/jobs",
        content=b'{"spec": not json',
        headers={**_auth(info), "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 422  # with the token, the body is read and found wrong


def test_a_chunked_body_over_the_limit_with_the_token_is_413(info):
    def chunks():  # no Content-Length: valid JSON of a spec text over the limit, sent in pieces
        yield b'{"spec": "'
        for _ in range(4):
            yield b"a" * (MAX_BODY_BYTES // 2)
        yield b'"}'

    r = http_calls.post(
        f"{info.api_url}/jobs",
        content=chunks(),
        headers={**_auth(info), "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413, r.text
    assert f"{MAX_BODY_BYTES} bytes" in r.json()["detail"]
    assert r.headers["connection"] == "close"
    # Under the limit, chunked or not, the body is read (and this spec text is refused on its merits).
    r = http_calls.post(
        f"{info.api_url}/jobs",
        content=iter([b'{"spec": "', b"a" * 1000, b'"}']),
        headers={**_auth(info), "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 422 and "mapping" in r.json()["detail"], r.text


def test_slow_partial_requests_are_closed_and_a_normal_request_still_works(info):
    socks = [_connect(info) for _ in range(SLOW)]
    for s in socks:
        s.sendall(b"POST /jobs HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    with trickling(socks):  # a slowloris keeps each connection busy with a byte a second
        # While they are open, a normal request is served.
        r = http_calls.get(f"{info.api_url}/jobs", headers=_auth(info), timeout=30)
        assert r.status_code == 200
        for s in socks:  # each is closed by the server (recv would block until BOUND_S otherwise)
            assert read_until_closed(s) == b""
    assert http_calls.get(f"{info.api_url}/jobs", headers=_auth(info), timeout=30).status_code == 200
