"""The persistent cluster's state: HOME's layout, secrets, cluster.json, the addresses clients need.

HOME (`--home`, $SLIPSTREAM_HOME, default ~/.slipstream):

    secrets.json      0600: redis_password (admin), redis_control_password (user `slipstream`), api_token,
                      ray_auth_token; generated once, kept across down/up
    cluster.json      host, ports, pids, addresses (no secrets); ports are reused by the next `up`
    redis/            redis.conf (0600, holds the password) and the AOF
    ray/              Ray's --temp-dir (sessions, Ray's own logs); see `ray_temp_dir` for long HOMEs
    prometheus/       prometheus.yml (rendered from deploy/prometheus.yml), data/, targets/ (file_sd)
    logs/             <service>.log (each service's stdout/stderr) and cluster.log (one line per event)
    jobs/             per-job output directories (the job driver's)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import secrets
import stat
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)


SERVICES = ("redis", "ray", "prometheus", "api")
"""Start order; `down` stops them in reverse."""
RAY_TEMP_DIR_MAX_CHARS = 40
"""Ray puts Unix sockets at TEMP/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store (~64 chars after
TEMP) and a socket path must fit in 107 bytes: a longer TEMP gets a short directory under /tmp."""
RAY_TEMP_PARENT_PREFIX = "slipstream-ray-"
STARTUP_TIMEOUT_S = {"redis": 30.0, "ray": 180.0, "prometheus": 60.0, "api": 60.0}
"""Upper bounds on a service becoming ready (a loaded 2-core box starts Ray in ~10 s)."""
STOP_TIMEOUT_S = 30.0
"""SIGTERM, then this long for a clean exit (Redis flushes its AOF, Prometheus its head block), then SIGKILL."""
POLL_S = 0.2
JOB_STOP_TIMEOUT_S = 900.0
"""`down` waits this long (default; --job-timeout) for running jobs to stop with their checkpoint: the
current step, the checkpoint and the final export of a large model take minutes."""
JOB_PROGRESS_S = 10.0
"""How often `down` says which jobs it still waits for."""
PROMETHEUS_SKIPPED = "Prometheus skipped: no `prometheus` on PATH (Debian: apt-get install prometheus)"
RAY_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
"""Ray's head writes its nodes' metrics addresses here, under its temp dir (Prometheus file_sd)."""


class ClusterInfo(msgspec.Struct):
    """Where a cluster's services are and the credentials to use them (load_info builds it)."""

    home: str
    host: str
    redis_url: str
    """The control plane's ACL user `slipstream` (keys slipstream:* only), like ManagedRedis.url. A job's
    processes use the job's own user instead (`job_redis_url`)."""
    redis_admin_url: str
    ray_address: str
    """host:port of Ray's GCS, for `ray.init(address=...)` and `ray start --address`."""
    dashboard_url: str
    """http://host:port of Ray's dashboard and job-submission API (token auth: see ray_env)."""
    prometheus_url: str | None
    api_url: str
    api_token: str
    ray_auth_token: str
    pids: dict[str, int]
    running: bool
    ray_temp_dir: str = ""


class ClusterState(msgspec.Struct):
    """cluster.json: what `up` decided and started. No secrets in here: load_info adds them."""

    host: str
    ports: dict[str, int]
    ray_temp_dir: str
    services: list[str]
    """The services this cluster runs (prometheus and api are optional)."""
    pids: dict[str, int] = {}
    running: bool = False
    redis_address: str = ""
    ray_address: str = ""
    dashboard_url: str = ""
    prometheus_url: str | None = None
    api_url: str = ""
    updated: str = ""
    tool_modules: list[str] | None = None
    """The modules jobs' custom tools may come from ([]: builtin tools only; None: any): the API enforces it."""
    input_roots: list[str] | None = None
    """The directories jobs' input paths must lie in besides their own (`--input-root`; None: HOME, the
    project, the temp directory): the API enforces it at submit."""
    redis_maxmemory: str = ""
    """Redis' memory limit (`--redis-maxmemory`; "" = redis_server.DEFAULT_MAXMEMORY), kept for the next `up`."""
    redis_host: str = ""
    """Where Redis runs when not on `host` (a Kubernetes Service's name: slipstream/cluster/kube.py); "" = `host`."""


# ---------------------------------------------------------------- home, secrets, state


def resolve_home(home: str | Path | None = None) -> Path:
    return Path(home or os.environ.get("SLIPSTREAM_HOME") or "~/.slipstream").expanduser().resolve()


def ray_temp_dir(home: Path) -> Path:
    """HOME/ray, or /tmp/slipstream-ray-<hash of HOME>/ray where HOME/ray would make Ray's socket paths too
    long. Either way its parent is an owner-only directory (HOME, or that /tmp one): Ray makes some of
    the directories it creates in its temp dir world-writable, and the parent keeps every other user out."""
    d = home / "ray"
    if len(str(d)) <= RAY_TEMP_DIR_MAX_CHARS:
        return d
    return (
        Path("/tmp") / f"{RAY_TEMP_PARENT_PREFIX}{hashlib.sha1(str(home).encode()).hexdigest()[:12]}" / "ray"
    )


def private_dir(home: Path, path: Path) -> None:
    """Make `path` an owner-only directory of this user (0700, and nothing in it readable by others):
    created 0700, or an existing one tightened; one that is a symlink or belongs to another user is
    refused (under /tmp anyone could have made it first)."""
    try:
        path.mkdir(mode=0o700, parents=True)
        created = True
    except FileExistsError:
        created = False
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a directory (a symlink?): refusing to keep cluster state there")
    if st.st_uid != os.getuid():
        raise RuntimeError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): refusing to keep cluster "
            "state there; remove it or choose another --home"
        )
    if created:
        return
    loose = _tighten(path)
    if loose and (home / "logs").is_dir():
        event(home, f"{path}: {loose} entries were readable or writable by others; now owner-only")
    elif loose:
        log.warning("%s: %d entries were readable or writable by others; now owner-only", path, loose)


def _tighten(root: Path) -> int:
    """Clear the group and other bits of `root` and everything under it (symlinks are left alone, and
    not followed); how many entries had any."""
    changed = 0

    def fix(p: str) -> None:
        nonlocal changed
        try:
            st = os.lstat(p)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            return
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            try:
                os.chmod(p, mode & 0o700)
                changed += 1
            except OSError:
                pass

    fix(str(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            fix(os.path.join(dirpath, name))
    return changed


SECRET_KEYS = ("redis_password", "redis_control_password", "api_token", "ray_auth_token")
"""secrets.json's keys. redis_password is Redis' default (admin) user's; redis_control_password the control
plane's user `slipstream`'s, a different one so that the URL the control plane hands around is not admin."""


def load_secrets(home: Path, create: bool) -> dict[str, str]:
    path = home / "secrets.json"
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
        fresh = {k: secrets.token_hex(32) for k in SECRET_KEYS}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(fresh, f, indent=2)
    path.chmod(0o600)
    sec = json.loads(path.read_text())
    if create and (missing := [k for k in SECRET_KEYS if k not in sec]):
        # A HOME from before a key existed (the control plane's own Redis password): `up` adds it, written
        # beside the file 0600 and renamed over it, so the file is never partly written nor wider.
        sec |= {k: secrets.token_hex(32) for k in missing}
        tmp = home / "secrets.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(sec, f, indent=2)
        tmp.replace(path)
    return sec


def job_redis_url_path(home: str | Path, job: str) -> Path:
    """HOME/jobs/JOB/redis_url (0600): the URL with the job's own Redis credentials, for its driver."""
    return resolve_home(home) / "jobs" / job / "redis_url"


def write_job_redis_url(home: str | Path, job: str, url: str) -> None:
    path = job_redis_url_path(home, job)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")


def job_redis_url(home: str | Path, job: str) -> str:
    """The job's Redis URL (its ACL user: its own keys only), as the control plane wrote it at submission."""
    path = job_redis_url_path(home, job)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"job {job!r} has no Redis credentials at {path}: submit it through the control plane"
        ) from None


def read_state(home: Path) -> ClusterState | None:
    path = home / "cluster.json"
    return msgspec.json.decode(path.read_bytes(), type=ClusterState) if path.exists() else None


def write_state(home: Path, state: ClusterState) -> None:
    state.updated = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tmp = home / "cluster.json.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=2) + b"\n")
    tmp.replace(home / "cluster.json")


def event(home: Path, message: str) -> None:
    """One line per state change, in HOME/logs/cluster.log and the log."""
    log.info(message)
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    with open(home / "logs" / "cluster.log", "a") as f:
        f.write(f"{stamp} {message}\n")


def connect_host(host: str) -> str:
    """The address clients dial for a service bound to `host`. Bound to every interface (0.0.0.0), this
    host's address on its default route (no packet is sent): the URLs handed to jobs (Redis's among them)
    must work from their actors on other nodes too; 127.0.0.1 where there is no such route."""
    if host not in ("", "0.0.0.0"):
        return host
    from common.net import default_route_address

    return default_route_address() or "127.0.0.1"


def cluster_info(home: Path, state: ClusterState, sec: dict[str, str]) -> ClusterInfo:
    from replay_buffer.redis_server import APP_USER

    h, admin_pw = connect_host(state.host), sec["redis_password"]
    rh = connect_host(state.redis_host) if state.redis_host else h
    # A cluster whose Redis an older `up` started has no control password yet: its user still has the admin's.
    control_pw = sec.get("redis_control_password", admin_pw)
    return ClusterInfo(
        home=str(home),
        host=state.host,
        redis_url=f"redis://{APP_USER}:{control_pw}@{rh}:{state.ports['redis']}/0",
        redis_admin_url=f"redis://:{admin_pw}@{rh}:{state.ports['redis']}/0",
        ray_address=f"{h}:{state.ports['ray']}",
        dashboard_url=f"http://{h}:{state.ports['dashboard']}",
        prometheus_url=state.prometheus_url,
        api_url=f"http://{h}:{state.ports['api']}",
        api_token=sec["api_token"],
        ray_auth_token=sec["ray_auth_token"],
        pids=dict(state.pids),
        running=state.running,
        ray_temp_dir=state.ray_temp_dir,
    )


def load_info(home: str | Path | None = None) -> ClusterInfo:
    """The cluster at HOME (addresses, credentials, pids); raises FileNotFoundError if there is none."""
    home = resolve_home(home)
    state = read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    return cluster_info(home, state, load_secrets(home, create=False))


RAY_SIDE_PORTS = ("ray_client", "ray_agent", "ray_metrics", "ray_dashboard_metrics", "ray_autoscaler_metrics")
"""Ray's ports besides its GCS and dashboard that `up` picks free per cluster (cluster.json): the client
server, the dashboard agent's HTTP port, the agent's metrics exporter (`--metrics-export-port`), and the
dashboard head's and autoscaler monitor's metrics servers (DASHBOARD_METRIC_PORT, AUTOSCALER_METRIC_PORT)."""


def ray_node_env(host: str) -> dict[str, str]:
    """What keeps Ray's node address on loopback for a cluster on loopback. Ray replaces a loopback
    --node-ip-address with the host's IP (resolve_ip_for_localhost) unless it believes multi-node clusters
    are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Linux included); with its node address on loopback its
    metrics servers bind to 127.0.0.1 instead of 0.0.0.0. A loopback cluster is one node anyway: nothing
    elsewhere could reach it. Every process that joins this Ray (ray.init) needs it too, to find the node."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} if host in ("127.0.0.1", "localhost", "::1") else {}


def ray_env(info: ClusterInfo) -> dict[str, str]:
    """Environment any process needs to talk to this Ray (ray.init, `ray job submit`, JobSubmissionClient)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": info.ray_auth_token, **ray_node_env(info.host)}
