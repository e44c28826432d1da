"""A CUDA error that poisons the engine's context makes it unhealthy and go away, never a live engine
that fails every request: /health answers 503 with the cause, requests in flight and new ones fail with
it, the server stops itself (an EngineActor's watch() then fails, and the driver replaces the engine),
and `python -m generator_fleet.engine` exits non-zero. On CPU the fault is injected through the runner's
testing hook (SLIPSTREAM_ENGINE_INJECT_FAULT), which raises the error a real CUDA fault raises."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import http_calls
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from generator_fleet.engine import EngineServer
from generator_fleet.engine.faults import FAULT_ENV, is_fatal_cuda_error
from model_zoo.tiny import build_tokenizer

ROOT = Path(__file__).resolve().parents[3]
STICKY = "CUDA error: an illegal memory access was encountered"
GENERATE = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("unhealthy")
    tok = build_tokenizer("abcdefghij", ["abcdefghij"])
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_fatal_cuda_errors_are_told_from_the_others():
    assert is_fatal_cuda_error(RuntimeError(STICKY))
    assert is_fatal_cuda_error(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert is_fatal_cuda_error(
        RuntimeError("Offset increment outside graph capture encountered unexpectedly.")
    )
    assert is_fatal_cuda_error(RuntimeError("CUDA error: device-side assert triggered"))
    try:
        try:
            raise RuntimeError(STICKY)
        except RuntimeError as e:
            raise ValueError("load failed") from e
    except ValueError as wrapped:
        assert is_fatal_cuda_error(wrapped)  # the cause counts
    assert not is_fatal_cuda_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_fatal_cuda_error(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal_cuda_error(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    assert not is_fatal_cuda_error(ValueError("shape mismatch for lm_head.weight"))


def test_a_sticky_cuda_error_turns_the_engine_unhealthy(model_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, STICKY)
    server = EngineServer(str(model_dir), fatal_exit_grace_s=3600).start()
    monkeypatch.delenv(FAULT_ENV)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/generate", json=GENERATE)  # in flight when the fault hits: answered with it
            assert r.status_code == 503, r.text
            assert STICKY in r.json()["message"]
            health = c.get("/health")
            assert health.status_code == 503
            assert STICKY in health.json()["message"]
            assert c.get("/get_server_info").status_code == 503  # the weight bus drops it, not BusError
            again = c.post("/generate", json=GENERATE)  # no request runs on a poisoned context
            assert again.status_code == 503 and STICKY in again.json()["message"]
            assert 'slipstream_engine_healthy{model_name="' in c.get("/metrics").text
            assert any(
                line.startswith("slipstream_engine_healthy{") and line.endswith(" 0.0")
                for line in c.get("/metrics").text.splitlines()
            )
        assert server.fatal is not None and STICKY in server.fatal
    finally:
        server.stop()


def test_an_unhealthy_engine_stops_itself(model_dir, monkeypatch):
    """serve_forever returns (what an EngineActor's watch() waits on: the driver then replaces it)."""
    monkeypatch.setenv(FAULT_ENV, STICKY)
    server = EngineServer(str(model_dir), fatal_exit_grace_s=0.0).start()
    monkeypatch.delenv(FAULT_ENV)
    served = threading.Thread(target=server.serve_forever)
    served.start()
    try:
        r = http_calls.post(f"{server.url}/generate", json=GENERATE, timeout=60)
        assert r.status_code == 503 and STICKY in r.text
        served.join(120)
        assert not served.is_alive()
        assert STICKY in server.fatal
    finally:
        server.stop()
        served.join(30)


def test_a_failing_step_that_is_no_cuda_fault_leaves_the_engine_serving(model_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "index out of range in self")
    server = EngineServer(str(model_dir)).start()
    monkeypatch.delenv(FAULT_ENV)
    try:
        # (one connection per call: the server closes the one a 500 went out on)
        assert http_calls.post(f"{server.url}/generate", json=GENERATE, timeout=60).status_code == 500
        assert http_calls.get(f"{server.url}/health", timeout=60).status_code == 200
        assert http_calls.post(f"{server.url}/generate", json=GENERATE, timeout=60).status_code == 200
        assert server.fatal is None
    finally:
        server.stop()


def test_the_engine_process_exits_non_zero_with_the_cause(model_dir, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        FAULT_ENV: STICKY,
    }
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "generator_fleet.engine", "--model", str(model_dir), "--port", "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready at "), (line, log_path.read_text())
        url = line.removeprefix("engine ready at ").strip()
        r = http_calls.post(f"{url}/generate", json=GENERATE, timeout=60)
        assert r.status_code == 503 and STICKY in r.text
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code != 0, text
    assert "engine unhealthy" in text and STICKY in text
    assert "exiting: the engine is unhealthy" in text


_REAL_FAULT = """
import sys, httpx, torch
from generator_fleet.engine import EngineServer
server = EngineServer(sys.argv[1], device="cuda", fatal_exit_grace_s=3600).start()
fwd = server.runner.fwd
prefill = fwd.prefill

def faulty_prefill(seqs, slots, *lora):  # an out-of-range gather on the device: a device-side assert
    h = prefill(seqs, slots, *lora)
    return h[torch.full((h.shape[0],), 1 << 40, device=h.device)]

fwd.prefill = faulty_prefill
r = httpx.post(server.url + "/generate", json={"input_ids": [3, 4, 5]}, timeout=120)
print("generate", r.status_code, r.text[:300], flush=True)
h = httpx.get(server.url + "/health", timeout=30)
print("health", h.status_code, h.text[:300], flush=True)
print("fatal", server.fatal, flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_device_side_assert_turns_the_engine_unhealthy(model_dir):
    """A real sticky CUDA error (not the hook), in its own process: the context stays poisoned."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _REAL_FAULT, str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(out.stdout)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["generate"].startswith("503"), out.stdout + out.stderr[-3000:]
    assert lines["health"].startswith("503") and "engine unhealthy" in lines["health"]
    assert "CUDA error" in lines["fatal"] or "AcceleratorError" in lines["fatal"], lines["fatal"]
