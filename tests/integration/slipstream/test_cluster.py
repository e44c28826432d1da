"""`slipstream cluster up/down/status` (slipstream/cluster/services.py) with real processes: Redis, a Ray head with
token auth, Prometheus (if installed) and the control API, all in one short-path HOME under /tmp.
One cluster for the module; the last tests take it down and up again through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import http_calls
import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from slipstream.cluster import services as cluster
from slipstream.cluster import state as cluster_state

REPO = Path(__file__).resolve().parents[3]
NO_RETRY = Retry(NoBackoff(), 0)
KEY = "slipstream:cluster-test:kept"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "cluster", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ray_processes(temp_dir: str) -> list[psutil.Process]:
    """Every live process whose command line names this cluster's Ray temp dir (gcs_server, raylet, ...)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and temp_dir in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture(scope="module")
def home():
    # Short on purpose: Ray's Unix socket paths live under HOME/ray and must stay under ~107 bytes.
    path = Path(tempfile.mkdtemp(prefix="ss-cluster-", dir="/tmp"))
    yield path
    try:
        cluster.down(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def info(home):
    return cluster.up(home, num_cpus=1)


def test_secrets_are_private_and_stay_out_of_cluster_json(info, home):
    secrets_file = home / "secrets.json"
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
    sec = json.loads(secrets_file.read_text())
    assert set(sec) == {"redis_password", "redis_control_password", "api_token", "ray_auth_token"}
    assert sec["redis_password"] != sec["redis_control_password"]
    assert sec["redis_control_password"] in info.redis_url and sec["redis_password"] not in info.redis_url
    assert sec["redis_password"] in info.redis_admin_url
    assert info.api_token == sec["api_token"] and info.ray_auth_token == sec["ray_auth_token"]
    public = (home / "cluster.json").read_text()
    assert not any(v in public for v in sec.values())
    assert cluster_state.load_info(home) == info


def test_redis_takes_the_app_user_and_refuses_anonymous(info):
    r = redis.Redis.from_url(info.redis_url)
    assert r.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL user: slipstream:* keys only
        r.set("not-slipstream", 1)
    r.set(KEY, "survives down+up")
    host, port = info.redis_url.rsplit("@", 1)[1].split("/")[0].split(":")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=int(port), retry=NO_RETRY).ping()


def test_ray_job_api_needs_the_token(info):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(
        info.dashboard_url, headers={"Authorization": f"Bearer {info.ray_auth_token}"}
    )
    assert isinstance(client.list_jobs(), list)
    assert http_calls.get(f"{info.dashboard_url}/api/jobs/").status_code == 401
    wrong = {"Authorization": "Bearer " + "0" * 64}
    assert http_calls.get(f"{info.dashboard_url}/api/jobs/", headers=wrong).status_code == 403


def test_a_ray_job_connects_to_the_cluster_with_ray_env(info):
    """What the job driver does: submitted with ray_env's variables, it runs ray.init() inside the cluster."""
    entry = ["python", "-c", "import ray; ray.init(); print('CPUS', ray.cluster_resources()['CPU'])"]
    submit = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", info.dashboard_url]
    out = subprocess.run(
        [*submit, "--", *entry],
        capture_output=True,
        text=True,
        env={**os.environ, **cluster_state.ray_env(info)},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "CPUS 1.0" in out.stdout


def test_control_api_answers(info):
    assert http_calls.get(f"{info.api_url}/healthz").json() == {"status": "ok"}


def test_status_reports_every_service_alive(info, home):
    expected = {"redis", "ray", "api"} | ({"prometheus"} if cluster.prometheus_binary() else set())
    assert cluster.status(home) == dict.fromkeys(expected, True)
    assert set(info.pids) == expected


@pytest.mark.skipif(cluster.prometheus_binary() is None, reason="no `prometheus` binary on PATH")
def test_prometheus_runs_with_the_rendered_config(info, home):
    assert http_calls.get(f"{info.prometheus_url}/-/ready").status_code == 200
    loaded = http_calls.get(f"{info.prometheus_url}/api/v1/status/config").json()["data"]["yaml"]
    assert f"{info.ray_temp_dir}/prom_metrics_service_discovery.json" in loaded
    assert "targets/*.json" in loaded
    assert (home / "prometheus" / "targets").is_dir()


def test_up_again_leaves_running_services_alone(info, home):
    assert cluster.up(home, num_cpus=1).pids == info.pids


def test_cli_down_stops_everything_and_up_restores_it(info, home):
    down = _cli("down", "--home", str(home))
    assert down.returncode == 0, down.stderr
    assert "stopped: api" in down.stdout and "data kept" in down.stdout
    assert "jobs: none was running" in down.stdout  # down names the jobs it stops; here there are none
    assert all(_gone(pid) for pid in info.pids.values())
    assert _ray_processes(info.ray_temp_dir) == []
    assert not any(cluster.status(home).values())
    assert _cli("status", "--home", str(home)).returncode == 1

    up = _cli("up", "--home", str(home), "--num-cpus", "1")
    assert up.returncode == 0, up.stderr
    again = cluster_state.load_info(home)
    for address in (again.ray_address, again.dashboard_url, again.api_url, again.redis_url.split("@")[1]):
        assert address in up.stdout
    # a loopback head cannot take other nodes: no `ray start --address` line, the way to allow them instead
    assert "ray start" not in up.stdout and "cluster up --host 0.0.0.0" in up.stdout
    assert "slipstream submit" in up.stdout
    assert not any(secret in up.stdout for secret in json.loads((home / "secrets.json").read_text()).values())
    # Same ports and secrets; new processes; the key written before `down` came back from the AOF.
    same = (
        "redis_url",
        "ray_address",
        "dashboard_url",
        "prometheus_url",
        "api_url",
        "api_token",
        "ray_auth_token",
    )
    assert {k: getattr(again, k) for k in same} == {k: getattr(info, k) for k in same}
    assert set(again.pids.values()).isdisjoint(info.pids.values())
    assert redis.Redis.from_url(again.redis_url).get(KEY) == b"survives down+up"
    assert all(cluster.status(home).values())


def test_a_failed_start_stops_what_it_started():
    home = Path(tempfile.mkdtemp(prefix="ss-fail-", dir="/tmp"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(RuntimeError, match=f"port {port} \\(ray\\).*in use"):
                cluster.up(home, ray_port=port, start_prometheus=False, start_api=False)
            assert cluster.status(home) == {"redis": False, "ray": False}
            assert "redis stopped" in (home / "logs" / "cluster.log").read_text()
        finally:
            cluster.down(home)
            shutil.rmtree(home, ignore_errors=True)


def test_long_home_gets_a_short_ray_temp_dir(tmp_path):
    long_home = tmp_path / ("x" * 80)
    short = cluster_state.ray_temp_dir(long_home)
    assert len(str(short)) <= cluster_state.RAY_TEMP_DIR_MAX_CHARS and short != long_home / "ray"
    assert cluster_state.ray_temp_dir(long_home) == short  # the same HOME always maps to the same directory
    assert cluster_state.ray_temp_dir(Path("/tmp/h")) == Path("/tmp/h/ray")


def test_no_cluster_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no cluster at .*make cluster-up"):
        cluster_state.load_info(tmp_path)
    assert _cli("status", "--home", str(tmp_path)).returncode == 2
