"""A persistent local Slipstream cluster whose whole state lives in one directory (`make cluster-up`).

Services, started in this order and stopped in the reverse one: Redis (AOF, password, ACL user), a Ray
head (token auth, dashboard + job API), Prometheus (optional: skipped if no binary) and the control API
(slipstream/cluster/api.py). Each runs in its own session, so it outlives the command that started it; its pid
goes to HOME/cluster.json, and `down` signals exactly those processes (never `ray stop`, which kills every
Ray instance of the user on the machine).

HOME's layout: slipstream/cluster/state.py.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.net import free_port
from slipstream.cluster.processes import (
    markers,
    owned,
    port_open,
    ray_leftovers,
    spawn,
    stop_pid,
    stop_ray,
    wait_ready,
)
from slipstream.cluster.state import (
    JOB_PROGRESS_S,
    JOB_STOP_TIMEOUT_S,
    POLL_S,
    PROMETHEUS_SKIPPED,
    RAY_DISCOVERY_FILE,
    RAY_SIDE_PORTS,
    RAY_TEMP_PARENT_PREFIX,
    SERVICES,
    ClusterInfo,
    ClusterState,
    cluster_info,
    connect_host,
    event,
    load_secrets,
    private_dir,
    ray_env,
    ray_node_env,
    ray_temp_dir,
    read_state,
    resolve_home,
    write_state,
)
from slipstream.job.prepare import REPO_ROOT, project_pythonpath

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- services


def _start_redis(home: Path, state: ClusterState, sec: dict[str, str]) -> int:
    from replay_buffer.redis_server import DEFAULT_MAXMEMORY, ManagedRedis

    server = ManagedRedis(
        data_dir=home / "redis",
        port=state.ports["redis"],
        password=sec["redis_password"],
        app_password=sec["redis_control_password"],
        host=state.host,
        log_path=home / "logs" / "redis.log",
        maxmemory=state.redis_maxmemory or DEFAULT_MAXMEMORY,
    )
    try:
        server.start()
    except (RuntimeError, TimeoutError) as e:
        raise RuntimeError(f"redis did not start: {e}") from None
    return server.proc.pid


def _set_control_password(state: ClusterState, sec: dict[str, str]) -> None:
    """A running Redis keeps the ACL it started with; make its control plane user's password secrets.json's
    (an older `up` gave that user the admin's password)."""
    import redis

    from replay_buffer.redis_server import set_app_password

    url = f"redis://:{sec['redis_password']}@{connect_host(state.host)}:{state.ports['redis']}/0"
    with redis.Redis.from_url(url, socket_connect_timeout=5) as admin:
        set_app_password(admin, sec["redis_control_password"])


def _start_ray(home: Path, state: ClusterState, sec: dict[str, str], num_cpus, num_gpus) -> int:
    import httpx

    temp_dir = Path(state.ray_temp_dir)
    if temp_dir.parent.name.startswith(RAY_TEMP_PARENT_PREFIX):  # the /tmp fallback's owner-only parent
        private_dir(home, temp_dir.parent)
    # Ray chmods the directories it makes in there 0777 (every Ray process does, at start): the owner-only
    # parent is what keeps others out. Its files and sockets are owner-only (umask 077, see spawn).
    private_dir(home, temp_dir)
    if left := ray_leftovers(str(temp_dir)):  # a previous head that died without its children
        event(home, f"ray: stopping {len(left)} leftover processes of {temp_dir}")
        stop_ray(None, str(temp_dir))
    host, p = state.host, state.ports
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
    cmd += ["--port", str(p["ray"]), "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    cmd += ["--include-dashboard", "true", "--dashboard-host", host, "--dashboard-port", str(p["dashboard"])]
    # Ray's defaults for these (10001, 52365; the metrics servers' 44217, 44227 and a random exporter port)
    # clash with any other Ray on the machine: each cluster has its own, remembered in cluster.json.
    cmd += [
        "--ray-client-server-port",
        str(p["ray_client"]),
        "--dashboard-agent-listen-port",
        str(p["ray_agent"]),
        "--metrics-export-port",
        str(p["ray_metrics"]),
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
        # No `ray start` option: the dashboard head's and the autoscaler monitor's metrics ports.
        "DASHBOARD_METRIC_PORT": str(p["ray_dashboard_metrics"]),
        "AUTOSCALER_METRIC_PORT": str(p["ray_autoscaler_metrics"]),
        **ray_node_env(host),
        # Job entrypoints run through /bin/sh with this PATH: `python` there is this environment's.
        "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
    }
    proc = spawn(home, "ray", cmd, env)
    dashboard = f"http://{connect_host(host)}:{p['dashboard']}"
    auth = {"Authorization": f"Bearer {sec['ray_auth_token']}"}

    def ready() -> bool:
        if not port_open(host, p["ray"]):
            return False
        try:  # the job API answers (its dashboard module starts last) and takes our token
            r = httpx.get(f"{dashboard}/api/jobs/", headers=auth, timeout=5)
        except httpx.HTTPError:
            return False
        if r.status_code in (401, 403):
            raise RuntimeError(f"Ray's dashboard refused the cluster's token: {r.status_code} {r.text[:200]}")
        return r.status_code == 200

    try:
        wait_ready(home, "ray", proc, ready)
    except BaseException:
        stop_ray(proc.pid, str(temp_dir))
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


def _start_prometheus(home: Path, state: ClusterState, binary: str) -> int:
    config = render_prometheus_config(home, state.ray_temp_dir)
    (home / "prometheus" / "targets").mkdir(parents=True, exist_ok=True)
    url = f"http://{connect_host(state.host)}:{state.ports['prometheus']}"
    cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'prometheus' / 'data'}"]
    cmd += [f"--web.listen-address={state.host}:{state.ports['prometheus']}"]
    return _serving(home, "prometheus", spawn(home, "prometheus", cmd), f"{url}/-/ready")


def _serving(home: Path, service: str, proc: subprocess.Popen, url: str) -> int:
    """Wait until `proc` answers 200 at `url` (stopping it if it never does); its pid."""
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_ready(home, service, proc, ready)
    except BaseException:
        stop_pid(proc.pid)
        raise
    return proc.pid


def _start_api(home: Path, state: ClusterState, info: ClusterInfo) -> int:

    cmd = [sys.executable, "-m", "slipstream.cluster.api", "--home", str(home), "--host", state.host]
    cmd += ["--port", str(state.ports["api"])]
    if state.tool_modules is not None:
        cmd += ["--tool-modules", ",".join(state.tool_modules)]
    for root in state.input_roots or []:
        cmd += ["--input-root", root]
    env = {
        **os.environ,
        "PYTHONPATH": project_pythonpath(),
        "HF_HUB_OFFLINE": "1",
        **ray_env(info),
    }
    return _serving(home, "api", spawn(home, "api", cmd, env), f"{info.api_url}/healthz")


# ---------------------------------------------------------------- up / down / status


SERVICE_PORTS = {
    "redis": ["redis"],
    "ray": ["ray", "dashboard", *RAY_SIDE_PORTS],
    "prometheus": ["prometheus"],
    "api": ["api"],
}


def _check_ports_free(state: ClusterState, service: str) -> None:
    """Fail fast and clearly on a port someone else holds (Ray alone would retry its GCS for ~40 s)."""
    for name in SERVICE_PORTS[service]:
        if port_open(state.host, state.ports[name]):
            flag = (
                f" or pass --{name}-port"
                if name in ("redis", "ray", "dashboard", "api", "prometheus")
                else ""
            )
            raise RuntimeError(
                f"{service}: port {state.ports[name]} ({name}) on {state.host} is in use by another process; "
                f"free it{flag}"
            )


def _service_alive(home: Path, state: ClusterState, service: str) -> bool:
    if not owned(state.pids.get(service), markers(home, state, service)):
        return False
    port = state.ports["dashboard" if service == "ray" else service]
    return port_open(state.host, port)


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


# Long: the cluster's services started in order, each undone if a later one fails
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
    input_roots: list[str] | None = None,
) -> ClusterInfo:
    """Start whatever of the cluster at HOME is not running; services already running are left alone.

    A port of 0 takes the one remembered in cluster.json, else a free one (then remembered). If a service
    fails to start, the services this call started are stopped again and the error carries its log's end.
    `tool_modules`: the modules jobs' custom tools may come from ([]: builtin tools only; None: any);
    `redis_maxmemory` (e.g. "4gb"; None: the remembered one, else 2gb) applies when Redis (re)starts.
    `input_roots`: the directories jobs' input paths must lie in besides their own (None: HOME, the
    project, the temp directory)."""
    home = resolve_home(home)
    private_dir(home, home)
    for d in ("redis", "prometheus/targets", "logs", "jobs"):
        (home / d).mkdir(mode=0o700, parents=True, exist_ok=True)
    sec = load_secrets(home, create=True)
    old = read_state(home)
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
        **{name: 0 for name in RAY_SIDE_PORTS},
    }
    ports = {}
    for name, port in wanted.items():
        kept = old.ports.get(name) if old else None
        is_running = (name in running) or (name in ("dashboard", *RAY_SIDE_PORTS) and "ray" in running)
        ports[name] = kept if is_running and kept else port or kept or 0
    for name in ports:  # distinct: a port just probed free can be handed out again by the next probe
        while not ports[name]:
            candidate = free_port(host)
            ports[name] = 0 if candidate in ports.values() else candidate

    binary = prometheus_binary() if start_prometheus else None
    if binary and not os.access(binary, os.X_OK):
        raise RuntimeError(f"the Prometheus binary {binary} ($SLIPSTREAM_PROMETHEUS?) is not executable")
    if start_prometheus and binary is None:
        event(home, PROMETHEUS_SKIPPED)
    services = ["redis", "ray"] + (["prometheus"] if binary else []) + (["api"] if start_api else [])
    state = ClusterState(
        host=host,
        ports=ports,
        # Kept while a service uses it; else today's (a long HOME's once sat directly in /tmp).
        ray_temp_dir=old.ray_temp_dir
        if old and {"ray", "prometheus"} & set(running)
        else str(ray_temp_dir(home)),
        services=services,
        tool_modules=tool_modules,
        input_roots=None
        if input_roots is None
        else [str(Path(r).expanduser().resolve()) for r in input_roots],
        pids={s: pid for s, pid in (old.pids if old else {}).items() if s in running},
        redis_maxmemory=redis_maxmemory or (old.redis_maxmemory if old else ""),
    )
    h = connect_host(host)
    state.redis_address = f"{h}:{ports['redis']}"
    state.ray_address = f"{h}:{ports['ray']}"
    state.dashboard_url = f"http://{h}:{ports['dashboard']}"
    state.prometheus_url = f"http://{h}:{ports['prometheus']}" if binary else None
    state.api_url = f"http://{h}:{ports['api']}"
    write_state(home, state)

    started: list[str] = []
    try:
        for service in services:
            if service in running:
                event(home, f"{service} already running (pid {state.pids[service]})")
                if service == "redis":
                    _set_control_password(state, sec)
                continue
            _check_ports_free(state, service)
            event(home, f"{service} starting (log {home / 'logs' / f'{service}.log'})")
            if service == "redis":
                pid = _start_redis(home, state, sec)
            elif service == "ray":
                pid = _start_ray(home, state, sec, num_cpus, num_gpus)
            elif service == "prometheus":
                pid = _start_prometheus(home, state, binary)
            else:
                pid = _start_api(home, state, cluster_info(home, state, sec))
            state.pids[service] = pid
            started.append(service)
            write_state(home, state)
            event(home, f"{service} started (pid {pid})")
    except BaseException as e:
        event(home, f"start failed ({type(e).__name__}); stopping what this call started: {started}")
        for service in reversed(started):
            _stop_service(home, state, service)
        write_state(home, state)
        raise
    state.running = True
    write_state(home, state)
    event(home, f"cluster up: {', '.join(services)}")
    return cluster_info(home, state, sec)


def _stop_service(home: Path, state: ClusterState, service: str) -> bool:
    """Stop one service if it is ours and alive; True if it was."""
    pid = state.pids.pop(service, None)
    if service == "ray":
        was = owned(pid, markers(home, state, "ray"))
        stop_ray(pid if was else None, state.ray_temp_dir)
    else:
        was = owned(pid, markers(home, state, service))
        if was:
            stop_pid(pid)
    if was:
        event(home, f"{service} stopped (pid {pid})")
    return was


def stop_jobs(home: Path, state: ClusterState, timeout_s: float = JOB_STOP_TIMEOUT_S) -> dict[str, dict]:
    """Stop every active job the way `slipstream stop` does (the trainer ends after its current step
    with a checkpoint) and wait for their drivers to end, saying every JOB_PROGRESS_S which ones it
    still waits for. Returns each job's final status; raises RuntimeError naming the jobs that did not
    end within `timeout_s` (their stop stays requested; `down --force` stops them without a checkpoint).
    Nothing to do when Redis or Ray is not running (no job runs then; the control API marks the jobs
    whose driver is gone when it starts again)."""
    if not (_service_alive(home, state, "redis") and _service_alive(home, state, "ray")):
        return {}
    from slipstream.cluster.control import JobControl
    from slipstream.job.records import known, status_dict
    from slipstream.job.store import ACTIVE_STATES

    info = cluster_info(home, state, load_secrets(home, create=False))
    control = JobControl(info)
    try:
        active = [j["name"] for j in control.list() if j["state"] in ACTIVE_STATES]
        for name in active:
            out = control.stop(name, reason="cluster down")
            event(home, f"job {name}: stop requested (cluster down): {out['message']}")
        ended: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        next_say = time.monotonic() + JOB_PROGRESS_S
        while True:
            for name in active:
                if name not in ended and (st := control.status(name)).state not in ACTIVE_STATES:
                    ended[name] = status_dict(st)
                    how = st.note or st.error or ""
                    event(home, f"job {name} {known(st.state)} at version {known(st.version, 0)}: {how}")
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
                    f"{n} ({known((st := control.store.status(n)).state)}, version {known(st.version, 0)})"
                    for n in waiting
                )
                event(home, f"waiting for job(s) to stop with their checkpoint: {states}")
            time.sleep(POLL_S)
    finally:
        control.r.close()


def active_jobs(home: Path, state: ClusterState) -> dict[str, dict]:
    """The jobs that hold resources (submitted ... stopping) and their status; {} when Redis or Ray is
    not running (no job runs then)."""
    if not (_service_alive(home, state, "redis") and _service_alive(home, state, "ray")):
        return {}
    from slipstream.cluster.control import JobControl
    from slipstream.job.store import ACTIVE_STATES

    control = JobControl(cluster_info(home, state, load_secrets(home, create=False)))
    try:
        return {j["name"]: j for j in control.list() if j["state"] in ACTIVE_STATES}
    finally:
        control.r.close()


def down(
    home: str | Path | None = None, force: bool = False, job_timeout_s: float = JOB_STOP_TIMEOUT_S
) -> dict[str, dict]:
    """Stop the running jobs (`stop_jobs`: each with a checkpoint; `force`: skip that, they are killed and
    marked `interrupted` when the cluster comes back), then the control API, Prometheus, Ray and Redis
    (in that order). All data stays in HOME. Returns the jobs that were running, each with its status:
    its final one (stopped, with its checkpoint), or with `force` its last one before it was killed, so
    the operator is told which jobs the cluster's stop ended."""
    home = resolve_home(home)
    state = read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    jobs = active_jobs(home, state) if force else stop_jobs(home, state, job_timeout_s)
    for service in reversed(SERVICES):
        if service in state.services or service in state.pids:
            _stop_service(home, state, service)
    state.running = False
    write_state(home, state)
    event(home, "cluster down (data kept)")
    return jobs


def status(home: str | Path | None = None) -> dict[str, bool]:
    """Service -> alive (its recorded process runs and its port answers), for the services of this cluster."""
    home = resolve_home(home)
    state = read_state(home)
    if state is None:
        raise FileNotFoundError(f"no cluster at {home}: run `make cluster-up`")
    return {s: _service_alive(home, state, s) for s in state.services}
