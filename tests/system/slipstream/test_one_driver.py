"""One driver per job, ever: the run lease (a second holder refused, the lease lapsing once its holder
dies, a submission the control plane ended never starting late), a second driver process that exits at
once without touching the job's keys, and, on a real cluster, a control API killed (SIGKILL) at random
points of submits: never two drivers for a name, and a state every command accepts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from cluster_helpers import ENDED, control_with_redis, spec_text, wait_for

from replay_buffer.keys import JobKeys
from slipstream.cli.jobs import ApiError
from slipstream.cluster import services as cluster
from slipstream.cluster import state as cluster_state
from slipstream.job.lease import LeaseRefused, RunLease
from slipstream.job.store import ACTIVE_STATES, JobStore, NameTaken

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def test_a_second_holder_is_refused_and_the_lease_lapses_with_its_holder(redis_client, job_id):
    store = JobStore(redis_client)
    sid = store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    assert sid == store.status(job_id).ray_job_id and sid.startswith(f"slipstream-{job_id}-")
    first = RunLease(redis_client, job_id, sid, ttl_s=0.5)
    me = first.take()
    assert me["submission"] == sid and me["pid"] == os.getpid() and me["host"]

    second = RunLease(redis_client, job_id, sid, ttl_s=0.5)
    with pytest.raises(LeaseRefused, match=rf"already has a driver: submission {sid} \(pid {os.getpid()}"):
        second.take()
    with pytest.raises(LeaseRefused, match="is not the job's current submission"):
        RunLease(redis_client, job_id, f"slipstream-{job_id}-0").take()
    # the name is not free while a driver holds the lease, whatever the status says
    store.update_status(job_id, state="failed")
    with pytest.raises(NameTaken) as taken:
        store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    assert taken.value.held

    # the holder dies (stops renewing): its lease lapses after the TTL and the next driver takes it
    deadline = time.monotonic() + 10
    while True:
        try:
            second.take()
            break
        except LeaseRefused:
            assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
            time.sleep(0.05)
    assert not first.renew()  # the first cannot take it back from the live holder
    second.release()
    assert redis_client.get(JobKeys(job_id).lease) is None


def test_a_submission_ended_by_the_control_plane_never_starts_late(redis_client, job_id):
    store = JobStore(redis_client)
    sid = store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    # a driver taking the lease while the control plane asks Ray: the marking is not written
    late = RunLease(redis_client, job_id, sid)
    st = store.settle(job_id, lambda st, held: late.take() and {"state": "interrupted"})
    assert st.state == "submitted" and redis_client.get(JobKeys(job_id).lease) is not None
    late.release()
    # Ray never got it: marked, and its driver, were Ray to start it after all, refuses to run
    st = store.settle(job_id, lambda st, held: {"state": "interrupted", "error": "never started"})
    assert st.state == "interrupted"
    with pytest.raises(LeaseRefused, match="no current submission"):
        RunLease(redis_client, job_id, sid).take()
    assert redis_client.get(JobKeys(job_id).lease) is None


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


# ---- on a real cluster ------------------------------------------------------------------------------------


class DriverCensus:
    """Samples the job driver processes of a cluster (a thread, every 50 ms): the most of one name alive
    at once."""

    def __init__(self, home: Path) -> None:
        self.home, self.most = str(home), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def alive(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for p in psutil.process_iter(["cmdline", "status", "pid"]):
            argv = p.info["cmdline"] or []
            if "slipstream.cluster.job_entry" in argv and self.home in argv and p.info["status"] != "zombie":
                found.setdefault(argv[argv.index("--job") + 1], []).append(p.info["pid"])
        return found

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pids in self.alive().items():
                if len(pids) > len(self.most.get(name, [])):
                    self.most[name] = pids

    def close(self) -> dict[str, list[int]]:
        self._stop.set()
        self._thread.join()
        return self.most


def _submit_until_killed(info, spec: str, cwd: str) -> None:
    try:
        httpx.post(
            f"{info.api_url}/jobs",
            headers={"Authorization": f"Bearer {info.api_token}"},
            json={"spec": spec, "cwd": cwd},
            timeout=60,
        )
    except httpx.HTTPError:
        pass  # the API was killed under it


def test_a_control_api_killed_mid_submit_leaves_one_driver_per_name_and_no_stuck_job(
    info, client, tmp_path, tiny_model_dir
):
    home = Path(info.home)
    rng = random.Random(11)
    census = DriverCensus(home)
    seen = []
    for i in range(4):
        name = f"kill-{i % 2}"
        spec = spec_text(tiny_model_dir, name)
        post = threading.Thread(target=_submit_until_killed, args=(info, spec, str(tmp_path)))
        post.start()
        time.sleep(rng.uniform(i, i + 1) * 0.3)  # somewhere in the submit: checks, record, files, Ray
        api = psutil.Process(cluster_state.read_state(home).pids["api"])
        api.send_signal(signal.SIGKILL)
        api.wait(30)  # gone, its port closed, before a new one starts
        post.join()
        cluster.up(home, start_prometheus=False)  # a new control API; it reconciles the jobs at its start
        try:
            st = client.get(name)
        except ApiError as e:  # killed before anything was recorded
            assert "HTTP 404" in str(e), e
            st = {"state": None}
        seen.append(st.get("state"))
        if st["state"] in ACTIVE_STATES:  # Ray has its submission: the name stays taken
            with pytest.raises(ApiError, match="HTTP 409"):
                client.submit(spec, [], str(tmp_path))
        else:  # it never reached Ray (or nothing was recorded): the name is free, no driver started
            assert st["state"] is None or "never started" in st["error"], st
            client.submit(spec, [], str(tmp_path))
        stop = client.stop(name, force=True)
        assert stop["stop"] and f"submission {client.get(name)['ray_job_id']}" in stop["message"], stop
        st = wait_for(client, name, "the forced stop", lambda s: s["state"] in ENDED, ended_ok=True)
        assert st["state"] in ("stopped", "interrupted"), st
        client.remove(name)
    most = census.close()
    print(f"states after the kills: {seen}; most drivers of one name at once: {most}")
    assert all(len(pids) <= 1 for pids in most.values()), most
    deadline = time.monotonic() + 60  # an ended job's driver process is gone soon after
    while census.alive():
        assert time.monotonic() < deadline, census.alive()
        time.sleep(0.2)
