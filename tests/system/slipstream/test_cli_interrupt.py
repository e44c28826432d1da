"""Ctrl-C on `slipstream run` stops everything it started: actors, Ray, and the private Redis."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_job_and_redis(tmp_path, tiny_model_dir, sig):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "slipstream",
        "run",
        "examples/demo.yaml",
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        f"output_dir={out}",
        "--set",
        "name=interrupt",
        "--set",
        "algorithm.total_steps=100000",
        "--set",
        "algorithm.groups_per_step=2",
        "--set",
        "rollout.group_size=2",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    seen = []
    try:
        for line in proc.stdout:  # wait until the job is really training
            seen.append(line)
            if line.startswith("step "):
                break
        assert any(line.startswith("step ") for line in seen), "".join(seen[-30:])
        started = {p.pid: p.name() for p in _children(proc.pid)}
        assert any("redis-server" in n for n in started.values())
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, rest[-3000:]
    assert "everything stopped" in rest
    still = [pid for pid in started if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert still == [], f"left running: {[started[p] for p in still]}"
    # The job spec was saved before anything started.
    assert json.loads((out / "job.json").read_text())["name"] == "interrupt"
