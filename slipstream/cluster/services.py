"""A persistent local Slipstream cluster whose whole state lives in one directory (`make cluster-up`).

Services, started in this order and stopped in the reverse one: Redis (AOF, password, ACL user), a Ray
head (token auth, dashboard + job API), Prometheus (optional: skipped if no binary) and the control API
(slipstream/cluster/api.py). Each runs in its own session, so it outlives the command that started it; its pid
goes to HOME/cluster.json, and `down` signals exactly those processes (never `ray stop`, which kills every
Ray instance of the user on the machine).

HOME (`--home`, $SLIPSTREAM_HOME, default ~/.slipstream):

    secrets.json      0600: redis_password, api_token, ray_auth_token; generated once, kept across down/up
    cluster.json      host, ports, pids, addresses (no secrets); ports are reused by the next `up`
    redis/            redis.conf (0600, holds the password) and the AOF
    ray/              Ray's --temp-dir (sessions, Ray's own logs); see `ray_temp_dir` for long HOMEs
    prometheus/       prometheus.yml (rendered from deploy/prometheus.yml), data/, targets/ (file_sd)
    logs/             <service>.log (each service's stdout/stderr) and cluster.log (one line per event)
    jobs/             per-job output directories (the job driver's)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def project_pythonpath() -> str:
    """PYTHONPATH for processes Ray starts: the project first, then this process's own entries
    (packages installed with `pip --target`, as on the GPU machine, live only there)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


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


class _State(msgspec.Struct):
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
    redis_maxmemory: str = ""
    """Redis' memory limit (`--redis-maxmemory`; "" = redis_server.DEFAULT_MAXMEMORY), kept for the next `up`."""


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
        _event(home, f"{path}: {loose} entries were readable or writable by others; now owner-only")
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


def _load_secrets(home: Path, create: bool) -> dict[str, str]:
    path = home / "secrets.json"
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
        fresh = {k: secrets.token_hex(32) for k in ("redis_password", "api_token", "ray_auth_token")}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(fresh, f, indent=2)
    path.chmod(0o600)
    return json.loads(path.read_text())


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


def _read_state(home: Path) -> _State | None:
    path = home / "cluster.json"
    return msgspec.json.decode(path.read_bytes(), type=_State) if path.exists() else None


def _write_state(home: Path, state: _State) -> None:
    state.updated = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tmp = home / "cluster.json.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state), indent=2) + b"\n")
    tmp.replace(home / "cluster.json")


def _event(home: Path, message: str) -> None:
    """One line per state change, in HOME/logs/cluster.log and the log."""
    log.info(message)
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    with open(home / "logs" / "cluster.log", "a") as f:
        f.write(f"{stamp} {message}\n")


def _connect_host(host: str) -> str:
    """The address a local client dials for a service bound to `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


def _info(home: Path, state: _State, sec: dict[str, str]) -> ClusterInfo:
    from replay_buffer.redis_server import APP_USER

    h, pw = _connect_host(state.host), sec["redis_password"]
    return ClusterInfo(
        home=str(home),
        host=state.host,
        redis_url=f"redis://{APP_USER}:{pw}@{h}:{state.ports['redis']}/0",
        redis_admin_url=f"redis://:{pw}@{h}:{state.ports['redis']}/0",
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
    state = _read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    return _info(home, state, _load_secrets(home, create=False))


def ray_env(info: ClusterInfo) -> dict[str, str]:
    """Environment any process needs to talk to this Ray (ray.init, `ray job submit`, JobSubmissionClient)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": info.ray_auth_token}


# ---------------------------------------------------------------- processes


def _cmdline(pid: int) -> str | None:
    """The command line with every argument followed by a space (so " ARG " matches one argument)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return " " + raw.replace(b"\0", b" ").decode(errors="replace")


def _alive(pid: int) -> bool:
    """Running (not a zombie). Reaps the pid if it is our own exited child."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we know
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _markers(home: Path, state: _State, service: str) -> list[str]:
    """Strings in the command line of this cluster's `service` process: a recycled pid does not match."""
    return {
        "redis": [
            "redis-server",
            f":{state.ports['redis']} ",
        ],  # Redis sets its title to "redis-server HOST:PORT"
        "ray": [" ray.scripts.scripts start ", f" --temp-dir {state.ray_temp_dir} "],
        "prometheus": [f" --config.file={home / 'prometheus' / 'prometheus.yml'} "],
        "api": [" slipstream.cluster.api ", f" --home {home} "],
    }[service]


def _owned(pid: int | None, markers: list[str]) -> bool:
    if not pid or not _alive(pid):
        return False
    cmd = _cmdline(pid)
    return cmd is None or all(m in cmd for m in markers)


def _port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((_connect_host(host), port), timeout=1).close()
        return True
    except OSError:
        return False


def _free_port(host: str) -> int:
    from common.net import free_port

    return free_port(host)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _spawn(home: Path, service: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session (it outlives us; Ctrl-C in our terminal does not reach it)."""
    with open(home / "logs" / f"{service}.log", "ab") as out:
        out.write(
            f"\n==== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n".encode()
        )
        out.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            umask=0o077,  # its files (AOF, TSDB, logs, sockets) owner-only
            # Not HOME: Ray jobs inherit this cwd, and its ray/ directory would shadow the ray package.
            cwd=REPO_ROOT,
        )


def _wait_ready(home: Path, service: str, proc: subprocess.Popen, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S[service]
    logfile = home / "logs" / f"{service}.log"
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{service} exited with code {proc.returncode} while starting; end of {logfile}:\n{_tail(logfile)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{service} not ready after {STARTUP_TIMEOUT_S[service]:.0f}s; end of {logfile}:\n{_tail(logfile)}"
            )
        time.sleep(POLL_S)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)
    return left


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop_pid(pid: int) -> None:
    _signal(pid, signal.SIGTERM)
    if _wait_gone([pid], STOP_TIMEOUT_S):
        _signal(pid, signal.SIGKILL)
        _wait_gone([pid], 5.0)


def _ray_leftovers(temp_dir: str) -> list[int]:
    """Processes of this cluster's Ray (gcs_server, raylet, agents...): their command lines name its session dir."""
    marker, me = f"{temp_dir}/session_", os.getpid()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid != me and marker in (_cmdline(pid) or "") and _alive(pid):
            pids.append(pid)
    return pids


def _stop_ray(pid: int | None, temp_dir: str) -> None:
    """SIGTERM to `ray start --block`, which shuts down its node's processes itself; then whatever is left
    of its process group (workers) and of its session (any process naming the session dir), with SIGKILL."""
    if pid and _alive(pid):
        _signal(pid, signal.SIGTERM)
        _wait_gone([pid], STOP_TIMEOUT_S)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(1.0 if sig == signal.SIGTERM else 0)
        _wait_gone([pid], 5.0)
    if left := _ray_leftovers(temp_dir):
        for p in left:
            _signal(p, signal.SIGTERM)
        for p in _wait_gone(left, 10.0):
            _signal(p, signal.SIGKILL)
        _wait_gone(left, 5.0)


# ---------------------------------------------------------------- services


def _start_redis(home: Path, state: _State, sec: dict[str, str]) -> int:
    from replay_buffer.redis_server import DEFAULT_MAXMEMORY, ManagedRedis

    server = ManagedRedis(
        data_dir=home / "redis",
        port=state.ports["redis"],
        password=sec["redis_password"],
        host=state.host,
        log_path=home / "logs" / "redis.log",
        maxmemory=state.redis_maxmemory or DEFAULT_MAXMEMORY,
    )
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"redis did not start: {e}") from None
    return server.proc.pid


def _start_ray(home: Path, state: _State, sec: dict[str, str], num_cpus, num_gpus) -> int:
    import httpx

    temp_dir = Path(state.ray_temp_dir)
    if temp_dir.parent.name.startswith(RAY_TEMP_PARENT_PREFIX):  # the /tmp fallback's owner-only parent
        private_dir(home, temp_dir.parent)
    # Ray chmods the directories it makes in there 0777 (every Ray process does, at start): the owner-only
    # parent is what keeps others out. Its files and sockets are owner-only (umask 077, see _spawn).
    private_dir(home, temp_dir)
    if left := _ray_leftovers(str(temp_dir)):  # a previous head that died without its children
        _event(home, f"ray: stopping {len(left)} leftover processes of {temp_dir}")
        _stop_ray(None, str(temp_dir))
    host, p = state.host, state.ports
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    cmd += ["--port", str(p["ray"]), "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    cmd += ["--include-dashboard", "true", "--dashboard-host", host, "--dashboard-port", str(p["dashboard"])]
    # Ray's defaults for these (10001, 52365) clash with any other Ray on the machine.
    cmd += [
        "--ray-client-server-port",
        str(p["ray_client"]),
        "--dashboard-agent-listen-port",
        str(p["ray_agent"]),
    ]
    if host not in ("", "0.0.0.0"):
        cmd += ["--node-ip-address", host]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        cmd += ["--num-gpus", str(num_gpus)]
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": sec["ray_auth_token"],
        # On SIGTERM the head would first wait up to 30 s for its node to drain (for Serve replicas to
        # migrate); this node is the whole cluster, so there is nowhere to drain to.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "PYTHONPATH": project_pythonpath(),
        # Job entrypoints run through /bin/sh with this PATH: `python` there is this environment's.
        "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
    }
    proc = _spawn(home, "ray", cmd, env)
    dashboard = f"http://{_connect_host(host)}:{p['dashboard']}"
    auth = {"Authorization": f"Bearer {sec['ray_auth_token']}"}

    def ready() -> bool:
        if not _port_open(host, p["ray"]):
            return False
        try:  # the job API answers (its dashboard module starts last) and takes our token
            r = httpx.get(f"{dashboard}/api/jobs/", headers=auth, timeout=5)
        except httpx.HTTPError:
            return False
        if r.status_code in (401, 403):
            raise RuntimeError(f"Ray's dashboard refused the cluster's token: {r.status_code} {r.text[:200]}")
        return r.status_code == 200

    try:
        _wait_ready(home, "ray", proc, ready)
    except BaseException:
        _stop_ray(proc.pid, str(temp_dir))
        raise
    return proc.pid


def prometheus_binary() -> str | None:
    """$SLIPSTREAM_PROMETHEUS, else `prometheus` on PATH, else None."""
    return os.environ.get("SLIPSTREAM_PROMETHEUS") or shutil.which("prometheus")


def render_prometheus_config(home: Path, temp_dir: str) -> Path:
    """deploy/prometheus.yml with Ray's discovery file at this cluster's Ray temp dir, into HOME/prometheus/.

    Relative file_sd paths (targets/*.json) resolve against the config file's directory."""
    out = home / "prometheus" / "prometheus.yml"
    template = REPO_ROOT / "deploy" / "prometheus.yml"
    ray_sd = f"{temp_dir}/{RAY_DISCOVERY_FILE}"
    if template.exists():
        text = template.read_text().replace(f"/tmp/ray/{RAY_DISCOVERY_FILE}", ray_sd)
    else:
        text = (
            "global:\n  scrape_interval: 5s\n  evaluation_interval: 5s\n"
            "scrape_configs:\n"
            "  - job_name: slipstream\n    file_sd_configs:\n      - files: ['targets/*.json']\n"
            f"  - job_name: ray\n    file_sd_configs:\n      - files: ['{ray_sd}']\n"
        )
    out.write_text(f"# rendered by slipstream/cluster/services.py from {template}\n" + text)
    return out


def _start_prometheus(home: Path, state: _State, binary: str) -> int:
    config = render_prometheus_config(home, state.ray_temp_dir)
    (home / "prometheus" / "targets").mkdir(parents=True, exist_ok=True)
    url = f"http://{_connect_host(state.host)}:{state.ports['prometheus']}"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'prometheus' / 'data'}"]
    cmd += [f"--web.listen-address={state.host}:{state.ports['prometheus']}"]
    return _serving(home, "prometheus", _spawn(home, "prometheus", cmd), f"{url}/-/ready")


def _serving(home: Path, service: str, proc: subprocess.Popen, url: str) -> int:
    """Wait until `proc` answers 200 at `url` (stopping it if it never does); its pid."""
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_ready(home, service, proc, ready)
    except BaseException:
        _stop_pid(proc.pid)
        raise
    return proc.pid


def _start_api(home: Path, state: _State, info: ClusterInfo) -> int:

    cmd = [sys.executable, "-m", "slipstream.cluster.api", "--home", str(home), "--host", state.host]
    cmd += ["--port", str(state.ports["api"])]
    if state.tool_modules is not None:
        cmd += ["--tool-modules", ",".join(state.tool_modules)]
    env = {
        **os.environ,
        "PYTHONPATH": project_pythonpath(),
        "HF_HUB_OFFLINE": "1",
        **ray_env(info),
    }
    return _serving(home, "api", _spawn(home, "api", cmd, env), f"{info.api_url}/healthz")


# ---------------------------------------------------------------- up / down / status


SERVICE_PORTS = {
    "redis": ["redis"],
    "ray": ["ray", "dashboard", "ray_client", "ray_agent"],
    "prometheus": ["prometheus"],
    "api": ["api"],
}


def _check_ports_free(state: _State, service: str) -> None:
    """Fail fast and clearly on a port someone else holds (Ray alone would retry its GCS for ~40 s)."""
    for name in SERVICE_PORTS[service]:
        if _port_open(state.host, state.ports[name]):
            flag = (
                f" or pass --{name}-port"
                if name in ("redis", "ray", "dashboard", "api", "prometheus")
                else ""
            )
            raise RuntimeError(
                f"{service}: port {state.ports[name]} ({name}) on {state.host} is in use by another process; "
                f"free it{flag}"
            )


def _service_alive(home: Path, state: _State, service: str) -> bool:
    if not _owned(state.pids.get(service), _markers(home, state, service)):
        return False
    port = state.ports["dashboard" if service == "ray" else service]
    return _port_open(state.host, port)


def _owner_only(fn):
    """Run `fn` under umask 077: what it writes (cluster.json, cluster.log, directories) is owner-only."""

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        umask = os.umask(0o077)
        try:
            return fn(*args, **kw)
        finally:
            os.umask(umask)

    return wrapper


@_owner_only
def up(
    home: str | Path | None = None,
    host: str = "127.0.0.1",
    *,
    redis_port: int = 0,
    ray_port: int = 0,
    dashboard_port: int = 0,
    api_port: int = 0,
    prometheus_port: int = 0,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    start_api: bool = True,
    start_prometheus: bool = True,
    tool_modules: list[str] | None = None,
    redis_maxmemory: str | None = None,
) -> ClusterInfo:
    """Start whatever of the cluster at HOME is not running; services already running are left alone.

    A port of 0 takes the one remembered in cluster.json, else a free one (then remembered). If a service
    fails to start, the services this call started are stopped again and the error carries its log's end.
    `tool_modules`: the modules jobs' custom tools may come from ([]: builtin tools only; None: any);
    `redis_maxmemory` (e.g. "4gb"; None: the remembered one, else 2gb) applies when Redis (re)starts."""
    home = resolve_home(home)
    private_dir(home, home)
    for d in ("redis", "prometheus/targets", "logs", "jobs"):
        (home / d).mkdir(mode=0o700, parents=True, exist_ok=True)
    sec = _load_secrets(home, create=True)
    old = _read_state(home)
    if old is not None:
        running = [s for s in old.services if _service_alive(home, old, s)]
        if running and old.host != host:
            raise RuntimeError(
                f"the cluster at {home} runs on {old.host} ({', '.join(running)}): "
                f"`slipstream cluster down` first to move it to {host}"
            )
    else:
        running = []
    wanted = {
        "redis": redis_port,
        "ray": ray_port,
        "dashboard": dashboard_port,
        "api": api_port,
        "prometheus": prometheus_port,
        "ray_client": 0,
        "ray_agent": 0,
    }
    ports = {}
    for name, port in wanted.items():
        kept = old.ports.get(name) if old else None
        is_running = (name in running) or (
            name in ("dashboard", "ray_client", "ray_agent") and "ray" in running
        )
        ports[name] = kept if is_running and kept else port or kept or 0
    for name in ports:  # distinct: a port just probed free can be handed out again by the next probe
        while not ports[name]:
            candidate = _free_port(host)
            ports[name] = 0 if candidate in ports.values() else candidate

    binary = prometheus_binary() if start_prometheus else None
    if binary and not os.access(binary, os.X_OK):
        raise RuntimeError(f"the Prometheus binary {binary} ($SLIPSTREAM_PROMETHEUS?) is not executable")
    if start_prometheus and binary is None:
        _event(home, PROMETHEUS_SKIPPED)
    services = ["redis", "ray"] + (["prometheus"] if binary else []) + (["api"] if start_api else [])
    state = _State(
        host=host,
        ports=ports,
        # Kept while a service uses it; else today's (a long HOME's once sat directly in /tmp).
        ray_temp_dir=old.ray_temp_dir
        if old and {"ray", "prometheus"} & set(running)
        else str(ray_temp_dir(home)),
        services=services,
        tool_modules=tool_modules,
        pids={s: pid for s, pid in (old.pids if old else {}).items() if s in running},
        redis_maxmemory=redis_maxmemory or (old.redis_maxmemory if old else ""),
    )
    h = _connect_host(host)
    state.redis_address = f"{h}:{ports['redis']}"
    state.ray_address = f"{h}:{ports['ray']}"
    state.dashboard_url = f"http://{h}:{ports['dashboard']}"
    state.prometheus_url = f"http://{h}:{ports['prometheus']}" if binary else None
    state.api_url = f"http://{h}:{ports['api']}"
    _write_state(home, state)

    started: list[str] = []
    try:
        for service in services:
            if service in running:
                _event(home, f"{service} already running (pid {state.pids[service]})")
                continue
            _check_ports_free(state, service)
            _event(home, f"{service} starting (log {home / 'logs' / f'{service}.log'})")
            if service == "redis":
                pid = _start_redis(home, state, sec)
            elif service == "ray":
                pid = _start_ray(home, state, sec, num_cpus, num_gpus)
            elif service == "prometheus":
                pid = _start_prometheus(home, state, binary)
            else:
                pid = _start_api(home, state, _info(home, state, sec))
            state.pids[service] = pid
            started.append(service)
            _write_state(home, state)
            _event(home, f"{service} started (pid {pid})")
    except BaseException as e:
        _event(home, f"start failed ({type(e).__name__}); stopping what this call started: {started}")
        for service in reversed(started):
            _stop_service(home, state, service)
        _write_state(home, state)
        raise
    state.running = True
    _write_state(home, state)
    _event(home, f"cluster up: {', '.join(services)}")
    return _info(home, state, sec)


def _stop_service(home: Path, state: _State, service: str) -> bool:
    """Stop one service if it is ours and alive; True if it was."""
    pid = state.pids.pop(service, None)
    if service == "ray":
        was = _owned(pid, _markers(home, state, "ray"))
        _stop_ray(pid if was else None, state.ray_temp_dir)
    else:
        was = _owned(pid, _markers(home, state, service))
        if was:
            _stop_pid(pid)
    if was:
        _event(home, f"{service} stopped (pid {pid})")
    return was


def stop_jobs(home: Path, state: _State, timeout_s: float = JOB_STOP_TIMEOUT_S) -> dict[str, dict]:
    """Stop every active job the way `slipstream stop` does (the trainer ends after its current step
    with a checkpoint) and wait for their drivers to end, saying every JOB_PROGRESS_S which ones it
    still waits for. Returns each job's final status; raises RuntimeError naming the jobs that did not
    end within `timeout_s` (their stop stays requested; `down --force` stops them without a checkpoint).
    Nothing to do when Redis or Ray is not running (no job runs then; the control API marks the jobs
    whose driver is gone when it starts again)."""
    if not (_service_alive(home, state, "redis") and _service_alive(home, state, "ray")):
        return {}
    from slipstream.cluster.control import JobControl
    from slipstream.cluster.job_store import ACTIVE_STATES

    info = _info(home, state, _load_secrets(home, create=False))
    control = JobControl(info)
    saved = {k: os.environ.get(k) for k in ray_env(info)}  # JobControl exports Ray's auth variables
    try:
        active = [j["name"] for j in control.list() if j["state"] in ACTIVE_STATES]
        for name in active:
            out = control.stop(name, reason="cluster down")
            _event(home, f"job {name}: stop requested (cluster down): {out['message']}")
        ended: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        next_say = time.monotonic() + JOB_PROGRESS_S
        while True:
            for name in active:
                if name not in ended and (st := control.get(name)).get("state") not in ACTIVE_STATES:
                    ended[name] = st
                    how = st.get("note") or st.get("error") or ""
                    _event(home, f"job {name} {st['state']} at version {st.get('version', 0)}: {how}")
            waiting = [n for n in active if n not in ended]
            if not waiting:
                return ended
            now = time.monotonic()
            if now >= deadline:
                raise RuntimeError(
                    f"job(s) {', '.join(waiting)} did not stop within {timeout_s:.0f} s (their stop stays "
                    "requested: each ends after its current step with a checkpoint); run `slipstream "
                    "cluster down` again to wait longer, or `slipstream cluster down --force` to stop them "
                    "now without a checkpoint (a resubmission with trainer.resume_from: latest resumes "
                    "from their latest one); nothing was stopped"
                )
            if now >= next_say:
                next_say = now + JOB_PROGRESS_S
                states = ", ".join(
                    f"{n} ({(st := control.store.status(n)).get('state')}, version {st.get('version', 0)})"
                    for n in waiting
                )
                _event(home, f"waiting for job(s) to stop with their checkpoint: {states}")
            time.sleep(1.0)
    finally:
        control.r.close()
        for k, v in saved.items():  # a process that goes on (a test, an embedding program) keeps its own
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def down(
    home: str | Path | None = None, force: bool = False, job_timeout_s: float = JOB_STOP_TIMEOUT_S
) -> None:
    """Stop the running jobs (`stop_jobs`: each with a checkpoint; `force`: skip that, they are killed and
    marked `interrupted` when the cluster comes back), then the control API, Prometheus, Ray and Redis
    (in that order). All data stays in HOME."""
    home = resolve_home(home)
    state = _read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    if not force:
        stop_jobs(home, state, job_timeout_s)
    for service in reversed(SERVICES):
        if service in state.services or service in state.pids:
            _stop_service(home, state, service)
    state.running = False
    _write_state(home, state)
    _event(home, "cluster down (data kept)")


def status(home: str | Path | None = None) -> dict[str, bool]:
    """Service -> alive (its recorded process runs and its port answers), for the services of this cluster."""
    home = resolve_home(home)
    state = _read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    return {s: _service_alive(home, state, s) for s in state.services}


# ---------------------------------------------------------------- CLI (`slipstream cluster ...`)


def add_parser(sub) -> None:
    """Register `cluster up|down|status` on slipstream's subcommand parser."""
    p = sub.add_parser(
        "cluster", help="the persistent local cluster (Redis, Ray head, Prometheus, control API)"
    )
    csub = p.add_subparsers(dest="cluster_cmd", required=True)
    home_help = "state directory (default: $SLIPSTREAM_HOME, else ~/.slipstream)"
    u = csub.add_parser("up", help="start the cluster's services (those already running are left alone)")
    u.add_argument("--home", help=home_help)
    u.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: accept other nodes)")
    for name in ("redis", "ray", "dashboard", "api", "prometheus"):
        u.add_argument(f"--{name}-port", type=int, default=0, help="0: remembered, else a free port")
    u.add_argument(
        "--redis-maxmemory",
        help="Redis memory limit, e.g. 4gb (default: the last one, else 2gb); at the limit writes fail "
        "with a clear error, nothing is evicted",
    )
    u.add_argument("--num-cpus", type=int)
    u.add_argument("--num-gpus", type=int)
    u.add_argument("--no-prometheus", action="store_true")
    u.add_argument("--no-api", action="store_true")
    tools = u.add_mutually_exclusive_group()
    tools.add_argument(
        "--tool-modules",
        metavar="MOD[,MOD...]",
        help="jobs' custom tools (tools[].impl) may come only from these modules and their submodules "
        "(default: any importable module; the API token is admin-equivalent either way)",
    )
    tools.add_argument("--builtin-tools-only", action="store_true", help="jobs may use builtin tools only")
    for name, help_ in (
        ("down", "stop running jobs (each with a checkpoint), then every service; data is kept"),
        ("status", "each service alive or dead"),
    ):
        csub.add_parser(name, help=help_).add_argument("--home", help=home_help)
    d = csub.choices["down"]
    d.add_argument(
        "--force",
        action="store_true",
        help="do not wait for running jobs to stop with a checkpoint: they are killed (marked interrupted)",
    )
    d.add_argument(
        "--job-timeout",
        type=float,
        default=JOB_STOP_TIMEOUT_S,
        help="seconds to wait for running jobs to stop (then refuse, naming them)",
    )


def _this_host_ip() -> str:
    """This machine's address on its default route (no packet is sent), for `ray start --address`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
    except OSError:
        return "<this host's IP>"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _print_up(info: ClusterInfo, before: dict[str, bool], args) -> None:
    home = Path(info.home)
    secrets_file = home / "secrets.json"

    def state(service: str) -> str:
        pid = info.pids.get(service)
        return f"already running, pid {pid}" if before.get(service) else f"started, pid {pid}"

    redis_public = info.redis_url.split("@", 1)[1]
    print(f"Slipstream cluster at {home}")
    print(f"  redis       redis://slipstream@{redis_public}  ({state('redis')})")
    print(
        f"              password: {secrets_file} [redis_password] (user `slipstream`; the default user is admin)"
    )
    print(f"  ray         {info.ray_address}  ({state('ray')})")
    print(f"              dashboard + job API {info.dashboard_url}, token: {secrets_file} [ray_auth_token]")
    if info.prometheus_url:
        print(f"  prometheus  {info.prometheus_url}  ({state('prometheus')})")
        print(f"              targets: {home / 'prometheus' / 'targets'}/*.json")
    elif args.no_prometheus:
        print("  prometheus  not started (--no-prometheus)")
    else:
        print(f"  prometheus  {PROMETHEUS_SKIPPED}")
    if "api" in info.pids:
        print(f"  api         {info.api_url}  ({state('api')}), docs {info.api_url}/docs")
        print(f"              token: {secrets_file} [api_token]")
    print(f"  logs        {home / 'logs'}")
    port = info.ray_address.rsplit(":", 1)[1]
    if _is_loopback(info.host):  # other machines cannot reach a head that listens on loopback only
        print("More nodes: this head listens on loopback only; to add nodes, `slipstream cluster down`,")
        print("  then `slipstream cluster up --host 0.0.0.0` (or this host's IP)")
    else:
        ip = info.host if info.host != "0.0.0.0" else _this_host_ip()
        print("Connect more nodes (same Ray and Python versions):")
        print(
            f"  RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<ray_auth_token from {secrets_file}> ray start --address {ip}:{port}"
        )
    print("Submit a job:  slipstream submit JOB.yaml")
    print("Stop:          make cluster-down  (data is kept)")


def main(args: argparse.Namespace) -> int:
    """`slipstream cluster up|down|status`."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)  # one line per state change; not httpx's requests
    home = resolve_home(args.home)
    try:
        if args.cluster_cmd == "up":
            before = status(home) if (home / "cluster.json").exists() else {}
            info = up(
                home,
                args.host,
                redis_port=args.redis_port,
                ray_port=args.ray_port,
                dashboard_port=args.dashboard_port,
                api_port=args.api_port,
                prometheus_port=args.prometheus_port,
                num_cpus=args.num_cpus,
                num_gpus=args.num_gpus,
                start_api=not args.no_api,
                start_prometheus=not args.no_prometheus,
                tool_modules=[]
                if args.builtin_tools_only
                else None
                if args.tool_modules is None
                else [m.strip() for m in args.tool_modules.split(",") if m.strip()],
                redis_maxmemory=args.redis_maxmemory,
            )
            _print_up(info, before, args)
            return 0
        if args.cluster_cmd == "down":
            alive = status(home)
            info = load_info(home)
            down(home, force=args.force, job_timeout_s=args.job_timeout)
            stopped = [f"{s} (pid {info.pids.get(s)})" for s in reversed(SERVICES) if alive.get(s)]
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
            print(f"data kept in {home} (`slipstream cluster up` starts it again, same ports and secrets)")
            return 0
        alive = status(home)
        info = load_info(home)
        for service, ok in alive.items():
            print(
                f"{service:<11} {'alive' if ok else 'dead'}" + (f"  pid {info.pids[service]}" if ok else "")
            )
        return 0 if all(alive.values()) else 1
    except FileNotFoundError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"slipstream: cluster {args.cluster_cmd} failed: {e}", file=sys.stderr)
        return 1
