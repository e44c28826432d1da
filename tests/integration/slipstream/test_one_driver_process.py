"""One driver per job, ever: a second driver process (the real job entry point, against a real Redis whose
lease another holder has) exits at once without touching the job's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis
from cluster_helpers import control_with_redis

from replay_buffer.keys import JobKeys
from slipstream.job.lease import RunLease

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def test_a_second_driver_process_exits_at_once_without_touching_the_keys(tmp_path):
    with control_with_redis(tmp_path) as (control, server):
        name = "twice"
        spec = json.dumps({"name": name, "output_dir": str(tmp_path / "out")})
        sid = control.store.create(name, spec, 1, 1)
        control._job_credentials(name)
        holder = RunLease(control.r, name, sid)
        control.store.update_status(name, driver=holder.take(), state="running", version=5)
        keys = JobKeys(name)
        control.r.xadd(keys.groups, {"g": "1"})
        control.r.set(keys.version, 5)
        admin = redis.Redis.from_url(server.admin_url)
        before = {k: admin.dump(k) for k in admin.keys("slipstream:twice:*")}
        run = subprocess.run(
            [sys.executable, "-m", "slipstream.cluster.job_entry", "--home", str(tmp_path), "--job", name]
            + ["--submission", sid],
            env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr
        assert f"already has a driver: submission {sid} (pid {os.getpid()}" in run.stderr, run.stderr
        assert "exits without touching the job's keys" in run.stderr
        assert {k: admin.dump(k) for k in admin.keys("slipstream:twice:*")} == before
        assert not (tmp_path / "out" / "logs").exists()
