"""The built-in engine's command line (`python -m generator_fleet.engine`, a real subprocess) and the limits
of its HTTP server: it refuses to serve without an API key on a non-loopback address and warns on
loopback; a connection whose request head never completes (slowloris, even trickling a byte at a time) is
closed by the server; a request body that stalls gets 408; connections beyond --limit-concurrency get 503
while a normal request goes through once the stalled ones are gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import http_calls
import pytest
from raw_http import connect, read_until_closed, send_chunks, trickling

REPO = Path(__file__).resolve().parents[3]
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
LIMIT = 40
BOUND_S = 120.0
"""How long a test waits for the server to act (generous: a loaded 2-core CI box); never a measured value."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_ENGINE_API_KEY"}
    return {**env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra}


def _cmd(model: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "generator_fleet.engine", "--model", str(model), "--port", "0", *args]


def test_refuses_to_serve_without_a_key_on_a_non_loopback_host(tiny_model_dir):
    for host in ("0.0.0.0", "::", socket.gethostname()):
        proc = subprocess.run(
            _cmd(tiny_model_dir, "--host", host), env=_env(), capture_output=True, text=True, timeout=BOUND_S
        )
        assert proc.returncode == 2, (host, proc.stdout, proc.stderr[-2000:])
        assert "engine ready" not in proc.stdout
        assert f"refusing to serve on --host {host} without an API key" in proc.stderr
        assert "SLIPSTREAM_ENGINE_API_KEY" in proc.stderr


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """(url, stderr lines) of an engine on loopback without a key, with short limits."""
    cmd = _cmd(
        tiny_model_dir,
        "--host", "127.0.0.1",
        "--header-timeout-s", str(HEADER_TIMEOUT_S),
        "--body-timeout-s", str(BODY_TIMEOUT_S),
        "--limit-concurrency", str(LIMIT),
    )  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready at "), (line, err)
        yield line.split()[-1], err
    finally:
        proc.terminate()
        proc.wait(60)
        reader.join(10)


def test_warns_when_serving_without_a_key_on_loopback(engine):
    url, err = engine
    assert any("WARNING" in e and "no API key" in e and "SLIPSTREAM_ENGINE_API_KEY" in e for e in err), err
    assert http_calls.post(f"{url}/flush_cache", timeout=30).status_code == 200  # served, unauthenticated


def test_slow_request_heads_are_closed_and_a_normal_request_still_works(engine):
    url, _ = engine
    socks = [connect(url, BOUND_S) for _ in range(LIMIT)]
    for s in socks:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    # Over the concurrency limit: a complete request is refused with 503 instead of piling up.
    r = http_calls.get(f"{url}/health", timeout=30)
    assert r.status_code == 503, r.text
    with trickling(socks):  # a slowloris keeps each connection busy with a byte a second
        for s in socks:
            assert read_until_closed(s) == b""  # closed (recv would block until BOUND_S otherwise)
    assert http_calls.get(f"{url}/health", timeout=30).status_code == 200
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert http_calls.post(f"{url}/generate", json=body, timeout=60).status_code == 200


def test_a_stalled_request_body_gets_408(engine):
    url, _ = engine
    s = connect(url, BOUND_S)
    with s:
        s.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"input_ids"')
        got = read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 408"), got
    assert b"connection: close" in got.lower() and f"for {BODY_TIMEOUT_S} s".encode() in got
    # A chunked body that stalls, too.
    s = connect(url, BOUND_S)
    with s:
        s.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"in\r\n')
        got = read_until_closed(s)
    assert got.startswith(b"HTTP/1.1 408"), got


def test_a_keyed_engine_answers_401_to_a_chunked_body_without_reading_it(tiny_model_dir):
    """With a key, a request without it is refused on its head: the connection is closed after the 401,
    so a large chunked body is not read."""
    env = _env(SLIPSTREAM_ENGINE_API_KEY="k-" + "3" * 30)
    proc = subprocess.Popen(
        _cmd(tiny_model_dir, "--host", "127.0.0.1"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready at "), line
        s = connect(line.split()[-1], BOUND_S)
        with s:
            s.sendall(
                b"POST /update_weights_from_disk HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            sent = send_chunks(s, total=256 << 20)
            got = read_until_closed(s)
        assert got.startswith(b"HTTP/1.1 401"), got
        assert sent < 256 << 20
    finally:
        proc.terminate()
        proc.wait(60)
