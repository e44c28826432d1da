"""The engine's step profiler over HTTP (SGLang's /start_profile and /stop_profile), on CPU with a tiny
model: a profile of N steps covers N generation steps labelled prefill/decode and writes a gzipped Chrome
trace and a summary into the engine's profile directory; a stop ends one on an idle engine; what cannot
start (profiling off, a directory outside the profile directory, a second profile) is a 400."""

from __future__ import annotations

import gzip
import json
import time

import http_calls
import pytest
import torch
from tiny_engine_model import build_noisy_model

from generator_fleet.engine import EngineServer
from generator_fleet.engine.profiling import StepProfiler

KEY = "profile-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "m"
    build_noisy_model(path, seed=3)
    return path


def _post(server, path, body=None):
    return http_calls.post(server.url + path, json=body, headers=HEADERS, timeout=60)


def _files(d, timeout_s=60.0):
    """The trace and summary a profile wrote into `d` (waits: the generation thread writes them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        summaries = sorted(d.glob("*-summary.txt")) if d.exists() else []
        if summaries:
            traces = sorted(d.glob("*.trace.json.gz"))
            return traces[-1], summaries[-1]
        time.sleep(0.1)
    raise AssertionError(f"no profile written into {d}")


def test_a_profile_of_n_steps_labels_them_and_writes_a_trace_and_a_summary(model, tmp_path):
    server = EngineServer(str(model), api_key=KEY, profile_dir=str(tmp_path / "profiles")).start()
    try:
        r = _post(server, "/start_profile", {"num_steps": 3, "output_dir": "run1"})
        assert r.status_code == 200 and r.text == "Start profiling.\n"
        assert _post(server, "/start_profile", {}).status_code == 400  # one at a time
        body = {"input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        assert _post(server, "/generate", body).status_code == 200
        trace, summary = _files(tmp_path / "profiles" / "run1")
        text = summary.read_text()
        assert text.startswith("3 steps profiled") and "prefill" in text and "decode" in text
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        assert {"prefill", "decode"} <= {e.get("name") for e in events}
        assert _post(server, "/stop_profile").status_code == 400  # it ended by itself
        # started and stopped on an idle engine: ends at once, no step in it
        assert _post(server, "/start_profile", {"output_dir": "idle"}).status_code == 200
        r = _post(server, "/stop_profile")
        assert r.status_code == 200 and r.text.startswith("Stop profiling.")
        _, summary = _files(tmp_path / "profiles" / "idle")
        assert summary.read_text().startswith("0 steps profiled")
        r = _post(server, "/start_profile", {"output_dir": "../outside"})
        assert r.status_code == 400 and "outside the engine's profile directory" in r.text
        assert not (tmp_path / "outside").exists()
    finally:
        server.stop()


def test_profiling_is_off_without_a_profile_directory(model):
    server = EngineServer(str(model), api_key=KEY).start()
    try:
        r = _post(server, "/start_profile", {"num_steps": 2})
        assert r.status_code == 400 and "--profile-dir" in r.text
        assert _post(server, "/stop_profile").status_code == 400
    finally:
        server.stop()


def test_a_profile_stopped_before_the_generation_thread_began_it_still_writes_its_files(tmp_path):
    """/start_profile then /stop_profile before the generation thread reached a step boundary (a busy
    host): the stop's answer said it stopped, so the boundary begins and ends it, writing 0 steps."""
    profiler = StepProfiler(str(tmp_path), torch.device("cpu"))
    profiler.start(output_dir="early")
    assert profiler.stop() and profiler.pending
    profiler.at_boundary()
    _, summary = _files(tmp_path / "early", timeout_s=5.0)  # written by at_boundary itself
    assert summary.read_text().startswith("0 steps profiled")
    assert not profiler.pending and not profiler.stop()  # nothing left running
