"""Job specs against real processes and a real cluster: two processes building one model.path build it
once, and neither reads it half-written; a driver whose job has no valid stored spec fails the job instead
of running defaults; a driver whose job was stopped before it connected to Ray ends it stopped, and one
stuck connecting to Ray exits once the stop is requested; and a job whose trainer cannot build its
weight-update group fails with that cause in its error. The driver and the failing job run on one real
cluster started by this module."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jobspec
from slipstream.cluster.control import JobControl

REPO = Path(__file__).resolve().parents[3]
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


BUILD = """
import hashlib, logging, sys
from pathlib import Path
import jobspec
from model_zoo.prepare import prepare_model
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
spec = jobspec.loads(sys.argv[1])
prepare_model(spec.model, spec.dataset)
# what this process would load: the weights in model.path once prepare_model returned
print("LOADED", hashlib.sha256((Path(spec.model.path) / "model.safetensors").read_bytes()).hexdigest())
"""


def test_two_processes_building_one_model_build_it_once_and_read_it_whole(tmp_path):
    model = tmp_path / "shared" / "model"
    spec = json.dumps({"model": {"path": str(model), "build": "tiny-arith", "warmup_steps": 60}})
    env = {**ENV, "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    first = subprocess.Popen(
        [sys.executable, "-c", BUILD, spec], env=env, stdout=logs[0].open("w"), stderr=subprocess.STDOUT
    )
    # the second starts once the first has saved its untrained model (before the SFT warm-up)
    deadline = time.monotonic() + 300
    while not ((model / "config.json").exists() or list(model.parent.glob(".model.building-*/config.json"))):
        assert first.poll() is None, logs[0].read_text()
        assert time.monotonic() < deadline, "the first build did not start"
        time.sleep(0.05)
    second = subprocess.Popen(
        [sys.executable, "-c", BUILD, spec], env=env, stdout=logs[1].open("w"), stderr=subprocess.STDOUT
    )
    assert first.wait(600) == 0, logs[0].read_text()
    assert second.wait(600) == 0, logs[1].read_text()
    out = [log.read_text() for log in logs]
    final = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    loaded = [next(ln.split()[1] for ln in o.splitlines() if ln.startswith("LOADED")) for o in out]
    assert loaded == [final, final], out[1]  # the second never read the first's half-built model
    assert "building tiny-arith model" in out[0] and "building tiny-arith model" not in out[1], out[1]
    assert "being built by another job; waiting" in out[1] and "was built by another job" in out[1]
    assert sorted(p.name for p in model.parent.iterdir()) == [".model.lock", "model"]  # no temp dir left


# ---- on a real cluster: the driver and a failing job ------------------------------------------------------


def _driver(info, job: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cluster.job_entry", "--home", info.home, "--job", job],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_driver_without_its_jobs_spec_fails_instead_of_running_defaults(info):
    import redis

    control = JobControl(info)
    admin = redis.Redis.from_url(info.redis_admin_url)
    keys_before = set(admin.keys("*"))
    run = _driver(info, "ghost")  # never submitted: no credentials for its Redis user either
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no Redis credentials" in run.stderr and "ghost" in run.stderr, run.stderr
    assert set(admin.keys("*")) == keys_before  # nothing made for it: no keys, no default job "demo"
    assert not (Path(info.home) / "jobs" / "demo").exists()
    control._job_credentials("ghost2")  # its Redis user exists, its spec does not
    run = _driver(info, "ghost2")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "no spec stored" in run.stderr and "ghost2" in run.stderr, run.stderr
    assert not (Path(info.home) / "jobs" / "demo").exists()

    # a record whose stored spec is another job's (or invalid) fails that job, with the reason
    other = jobspec.to_json(jobspec.loads("name: someone-else"))
    control.store.create("mixed", other, 1, 1)
    control._job_credentials("mixed")
    run = _driver(info, "mixed")
    assert run.returncode == 1 and "someone-else" in run.stderr, run.stderr
    st = control.store.status("mixed")
    assert st.state == "failed" and "someone-else" in st.error, st
    control.store.create("broken", '{"name": "broken", "algorithm": {"lr": -1}}', 1, 1)
    control._job_credentials("broken")
    assert _driver(info, "broken").returncode == 1
    st = control.store.status("broken")
    assert st.state == "failed" and "`$.algorithm.lr`" in st.error, st
    # a name that is not one (the driver is never started with it by submit, but it refuses it too)
    run = _driver(info, "nl\n")
    assert run.returncode == 1 and "job name" in run.stderr, run.stderr


def test_a_job_stopped_before_its_driver_starts_ends_stopped_without_ray(info, tmp_path):
    """A stop (or a cluster down) right after submit can reach the job before its driver connects to Ray:
    the driver ends the job as stopped, with what a resubmission starts from, before connecting to Ray."""
    control = JobControl(info)
    spec = jobspec.to_json(jobspec.loads(f"name: early\noutput_dir: {tmp_path / 'early'}"))
    control.store.create("early", spec, 1, 1)
    control._job_credentials("early")
    control.store.request_stop("early", reason="cluster down")
    run = _driver(info, "early")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "job early stopped before its driver started (cluster down)" in run.stdout, run.stdout
    st = control.store.status("early")
    assert st.state == "stopped" and st.checkpoint == "" and st.checkpoint_version is None, st
    assert "no checkpoint was written" in st.note and st.pools["trainers"] == 0, st


# What ray.init does while the GCS it dials is gone: block inside Ray's C++ client, where no Python signal
# handler runs (a sleep stands in for it); the driver's watchdog is what ends the process.
HUNG_CONNECT = """
import sys, time
import ray, redis
from slipstream.job.store import JobStore
from slipstream.cluster import job_entry
ray.init = lambda **kw: time.sleep(600)
job_entry.RAY_CONNECT_GRACE_S = 1.0
job_entry._connect_ray(JobStore(redis.Redis.from_url(sys.argv[1])), sys.argv[2])
"""


def test_a_driver_stuck_connecting_to_ray_exits_once_its_stop_is_requested(info):
    control = JobControl(info)
    control.store.create("hung", jobspec.to_json(jobspec.loads("name: hung")), 1, 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", HUNG_CONNECT, info.redis_admin_url, "hung"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        time.sleep(3)
        assert proc.poll() is None  # no stop requested: it waits for Ray
        control.store.request_stop("hung")
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert "job hung: its stop was requested and Ray has not answered for 1 s since" in out, out


def test_a_job_whose_trainer_fails_carries_the_real_cause(info, tmp_path, tiny_model_dir):
    from slipstream.cli.jobs import ControlClient

    client = ControlClient(info.api_url, info.api_token)
    # 192.0.2.1 (TEST-NET-1) is no address of this host: the trainer cannot host the weight group's store
    spec = f"""
name: nobus
model: {{path: {tiny_model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
algorithm: {{groups_per_step: 2, total_steps: 3}}
bus: {{master_address: 192.0.2.1, timeout_s: 1}}
"""
    client.submit(spec, [], str(tmp_path))
    deadline = time.monotonic() + 300
    while (st := client.get("nobus"))["state"] not in ("succeeded", "failed", "stopped"):
        assert time.monotonic() < deadline, st
        time.sleep(1)
    assert st["state"] == "failed", st
    err = st["error"]
    print(f"job error: {err}")
    # Was: "... BusError: no weight update group could be built over [...]", the cause only in trainer-0.log
    assert "no weight update group could be built" in err and "could not host its store on 192.0.2.1" in err
    assert "\n" not in err and "\x1b" not in err  # one plain line: the traceback stays in the logs
