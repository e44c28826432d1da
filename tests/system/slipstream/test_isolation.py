"""Isolation on a running cluster: HOME and Ray's temp dir are owner-only (an existing HOME with loose modes is
tightened); each submitted job runs under its own Redis ACL user, which reaches its own keys only (not another
job's, not the control index), may not flush scripts, and whose password is on no command line, in no Ray job
record and in no file others may read; Redis runs with the configured memory limit and `noeviction`.

One cluster (Redis, Ray, control API) serves the module; two tiny jobs run on it, side by side, to their end."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import redis

from slipstream.cli.jobs import ControlClient
from slipstream.cluster import services as cluster
from slipstream.cluster import state as cluster_state

JOB_TIMEOUT_S = 300
MAXMEMORY = 256 << 20


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _exposed(root: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """Entries under `root` (itself included) that another user could reach and read, write or list: open
    to group or others (some mode bit in 0o077) while every directory from `root` down to them lets group
    or others through (x). `root`'s own parents are not counted: each root must stand on its own.
    Symlinks and the paths in `skip` (and what is under them) are left out."""
    found = []

    def visit(p: Path, reachable: bool) -> None:
        if p in skip:
            return
        try:
            st = p.lstat()
        except FileNotFoundError:  # replaced by a service meanwhile
            return
        if stat.S_ISLNK(st.st_mode):
            return
        mode = stat.S_IMODE(st.st_mode)
        if reachable and mode & 0o077:
            found.append(f"{p} {oct(mode)}")
        if stat.S_ISDIR(st.st_mode):
            through = reachable and bool(mode & 0o011)
            for child in p.iterdir():
                visit(child, through)

    visit(root, True)
    return found


@pytest.fixture(scope="module")
def home():
    path = Path(tempfile.mkdtemp(prefix="ss-iso-", dir="/tmp"))
    # A HOME someone left open: the directory, a log and a job directory readable (and writable) by all.
    path.chmod(0o777)
    (path / "logs").mkdir(mode=0o755)
    (path / "logs" / "old.log").write_text("old")
    (path / "logs" / "old.log").chmod(0o666)
    (path / "jobs" / "old").mkdir(parents=True)
    (path / "jobs" / "old").chmod(0o777)
    yield path
    try:
        cluster.down(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(cluster_state.ray_temp_dir(path), ignore_errors=True)


@pytest.fixture(scope="module")
def info(home):
    return cluster.up(home, start_prometheus=False, redis_maxmemory=str(MAXMEMORY))


@pytest.fixture(scope="module")
def jobs(info, tmp_path_factory, tiny_model_dir):
    """Two tiny jobs, run side by side to their end: their names."""
    client = ControlClient(info.api_url, info.api_token)
    tmp = tmp_path_factory.mktemp("iso-specs")
    names = ["iso-a", "iso-b"]
    for name in names:
        spec = f"""
name: {name}
model: {{path: {tiny_model_dir}}}
rollout: {{group_size: 2, concurrency: 2, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1}}
algorithm: {{groups_per_step: 1, total_steps: 2, lr: 1.0e-3}}
"""
        client.submit(spec, [], str(tmp))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for name in names:
        while (st := client.get(name))["state"] not in ("succeeded", "failed", "stopped"):
            assert time.monotonic() < deadline, st
            time.sleep(0.25)
        assert st["state"] == "succeeded" and st["version"] == 2, (st.get("error"), _driver_log(info, name))
    return names


def _driver_log(info, name: str) -> str:
    try:
        return (Path(info.home) / "jobs" / name / "logs" / "driver.log").read_text()[-4000:]
    except OSError as e:
        return str(e)


def _job_client(info, name: str) -> redis.Redis:
    url = cluster_state.job_redis_url(info.home, name)
    return redis.Redis.from_url(url, socket_connect_timeout=5)


def test_home_and_ray_temp_dir_are_owner_only(info, home, jobs):
    """After jobs ran. Ray makes the directories of its temp dir 0777 (every Ray process, at start): its
    owner-only parent (HOME here, /tmp/slipstream-ray-<hash> for a long HOME) keeps others out, and its
    files and sockets are owner-only. Prometheus' file_sd file is 0644 on purpose (a Prometheus in a
    container may run as another user; it holds 127.0.0.1 addresses only), and HOME keeps it private."""
    assert _mode(home) == 0o700 and home.stat().st_uid == os.getuid()
    temp = Path(info.ray_temp_dir)
    assert temp.parent == home
    targets = home / "prometheus" / "targets" / "slipstream.json"
    # As if HOME were open: what the services wrote and what the loose HOME held (a log, a job dir) is
    # owner-only (Ray's directories aside).
    assert _exposed(home, skip=(temp, targets)) == []
    open_files = []
    for dirpath, _, filenames in os.walk(temp):
        for name in filenames:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                open_files.append(f"{p} {oct(stat.S_IMODE(st.st_mode))}")
    assert open_files == []  # Ray's logs, sockets, session files
    assert (
        "were readable or writable by others; now owner-only" in (home / "logs" / "cluster.log").read_text()
    )


def test_the_ray_temp_dir_for_a_long_home_sits_in_an_owner_only_directory(tmp_path):
    temp = cluster_state.ray_temp_dir(tmp_path / ("x" * 80))
    assert temp.parent.parent == Path("/tmp") and temp.parent.name.startswith("slipstream-ray-")
    cluster_state.private_dir(tmp_path, temp.parent)
    try:
        assert _mode(temp.parent) == 0o700 and temp.parent.stat().st_uid == os.getuid()
        temp.parent.chmod(0o777)  # left open by something else: tightened
        cluster_state.private_dir(tmp_path, temp.parent)
        assert _mode(temp.parent) == 0o700
    finally:
        shutil.rmtree(temp.parent)


def test_a_ray_temp_dir_of_another_user_or_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "ray"
    link.symlink_to(target)
    with pytest.raises(RuntimeError, match="not a directory"):
        cluster_state.private_dir(tmp_path, link)
    if os.getuid() == 0:  # as root, hand a directory to another user (nobody)
        not_ours, owner = tmp_path / "not-ours", 65534
        not_ours.mkdir(mode=0o700)
        os.chown(not_ours, owner, owner)
    else:
        not_ours, owner = Path("/"), 0
    with pytest.raises(RuntimeError, match=f"belongs to uid {owner}, not to this user"):
        cluster_state.private_dir(tmp_path, not_ours)


def test_an_older_homes_secrets_get_the_control_plane_password_owner_only(tmp_path):
    """A HOME from before the control plane had its own Redis password: `up` adds one, keeps the others, and
    the file stays 0600 even under a permissive umask."""
    import json

    old = {"redis_password": "admin", "api_token": "api", "ray_auth_token": "ray"}
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps(old))
    path.chmod(0o600)
    assert cluster_state.load_secrets(tmp_path, create=False) == old  # reading alone changes nothing
    umask = os.umask(0o000)
    try:
        sec = cluster_state.load_secrets(tmp_path, create=True)
    finally:
        os.umask(umask)
    assert {k: sec[k] for k in old} == old
    assert len(sec["redis_control_password"]) == 64 and sec["redis_control_password"] != sec["redis_password"]
    assert json.loads(path.read_text()) == sec and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cluster_state.load_secrets(tmp_path, create=True) == sec  # generated once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secrets.json"]


def test_each_job_has_its_own_redis_user_limited_to_its_keys(info, jobs):
    a_name, b_name = jobs
    url_file = cluster_state.job_redis_url_path(info.home, a_name)
    assert _mode(url_file) == 0o600
    assert cluster_state.job_redis_url(info.home, a_name).startswith(f"redis://job-{a_name}:")
    a = _job_client(info, a_name)
    assert int(a.get(f"slipstream:{a_name}:version")) == 2  # its own keys, written by its own processes
    for op in (
        lambda: a.get(f"slipstream:{b_name}:version"),
        lambda: a.set(f"slipstream:{b_name}:version", 0),
        lambda: a.xrange(f"slipstream:{b_name}:groups"),
        lambda: a.hgetall("slipstream:control:jobs"),
        lambda: a.hset("slipstream:control:jobs", "intruder", 1),
        lambda: a.scan(),
        lambda: a.script_flush(),
        lambda: a.flushall(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            op()
    control = redis.Redis.from_url(info.redis_url)
    assert int(control.get(f"slipstream:{b_name}:version")) == 2  # untouched
    with pytest.raises(redis.exceptions.NoPermissionError):
        control.script_flush()


def test_job_passwords_stay_out_of_command_lines_ray_and_job_files(info, home, jobs):
    from ray.job_submission import JobSubmissionClient

    passwords = {
        n: cluster_state.job_redis_url(info.home, n).rsplit("@", 1)[0].rsplit(":", 1)[1] for n in jobs
    }
    assert len(set(passwords.values())) == 2
    ray_jobs = JobSubmissionClient(
        info.dashboard_url, headers={"Authorization": f"Bearer {info.ray_auth_token}"}
    ).list_jobs()
    text = repr([(j.entrypoint, j.runtime_env, j.metadata) for j in ray_jobs])
    # Every file of the cluster but the jobs' own 0600 URL files: job.json, the jobs' logs, Ray's logs.
    files = [p for p in home.rglob("*") if p.is_file() and not p.is_symlink() and p.name != "redis_url"]
    assert any(p.name == "driver.log" for p in files)
    contents = "\n".join(p.read_bytes().decode(errors="replace") for p in files)
    for pw in passwords.values():
        assert pw not in text
        assert pw not in contents
        for p in psutil.process_iter(["cmdline"]):
            assert pw not in " ".join(p.info["cmdline"] or [])


def test_redis_has_the_configured_memory_limit_and_never_evicts(info):
    admin = redis.Redis.from_url(info.redis_admin_url)
    assert admin.config_get("maxmemory") == {"maxmemory": str(MAXMEMORY)}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert cluster_state.read_state(Path(info.home)).redis_maxmemory == str(
        MAXMEMORY
    )  # the next `up` keeps it
