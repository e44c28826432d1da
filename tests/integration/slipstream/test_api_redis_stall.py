"""The control API while its Redis stalls (SIGSTOP): a request Redis does not answer gets a 503 that names
Redis and the timeout, within about that timeout (it was a bare `Internal Server Error`), and a job's
status is its last known state with its age; once Redis continues, status is live again. Real
redis-server, the real JobControl and API over HTTP, and `slipstream status` against it."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager

import http_calls
import httpx
import pytest
from cluster_helpers import control_with_redis, serving

from slipstream import cli
from slipstream.cluster.api import create_app

TOKEN = "stall-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REDIS_TIMEOUT_S = 0.5
"""The API's Redis timeout here (production: control.REDIS_TIMEOUT_S, 5 s)."""
ANSWER_BOUND_S = 10 * REDIS_TIMEOUT_S
"""A stalled request's answer comes within a few timeouts (one retry on a broken connection at most), never
after the client's own 30 s; generous for a loaded 2-core box."""


@contextmanager
def _stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def api(tmp_path):
    with control_with_redis(tmp_path, TOKEN, redis_timeout_s=REDIS_TIMEOUT_S) as (control, redis_server):
        with serving(create_app(TOKEN, control)) as url:
            yield url, control, redis_server


def _get(url: str, path: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = http_calls.get(f"{url}{path}", headers=AUTH, timeout=60)
    return r, time.monotonic() - t0


def test_a_stalled_redis_answers_503_naming_it_and_status_its_last_known_state(api, capsys, monkeypatch):
    url, control, redis_server = api
    control.store.create("known", json.dumps({"name": "known"}), 1, 1)
    control.store.update_status("known", state="failed", version=7, error="an earlier failure")
    control.store.create("unseen", json.dumps({"name": "unseen"}), 1, 1)
    live, _ = _get(url, "/jobs/known")
    assert live.status_code == 200 and "stale_s" not in live.json()

    monkeypatch.setenv("SLIPSTREAM_API_TOKEN", TOKEN)
    with _stopped(redis_server.proc.pid):
        r, took = _get(url, "/jobs/known")
        print(f"status while Redis is stopped ({took:.2f} s): {r.json()}")
        assert r.status_code == 200 and took < ANSWER_BOUND_S
        st = r.json()
        assert st["state"] == "failed" and st["version"] == 7  # the last known state ...
        assert st["stale_s"] >= 0 and "Redis" in st["stale_reason"]  # ... marked as such, with its age

        for path in ("/jobs/unseen", "/jobs", "/jobs/known/progress"):  # nothing to fall back on
            r, took = _get(url, path)
            print(f"{path} while Redis is stopped ({took:.2f} s): {r.status_code} {r.json()}")
            assert r.status_code == 503 and took < ANSWER_BOUND_S
            detail = r.json()["detail"]
            assert "Redis" in detail and f"within {REDIS_TIMEOUT_S:g} s" in detail
            assert redis_server.password not in detail
            assert r.headers["retry-after"]

        # what the operator reads
        assert cli.main(["status", "known", "--api-url", url]) == 0
        out = capsys.readouterr().out
        assert "STALE" in out and "last known state" in out and "failed" in out
        assert cli.main(["status", "unseen", "--api-url", url]) == 1
        err = capsys.readouterr().err
        assert "Redis" in err and "(HTTP 503)" in err

    r, _ = _get(url, "/jobs/known")  # Redis continued: live again
    assert r.status_code == 200 and "stale_s" not in r.json() and r.json()["state"] == "failed"
