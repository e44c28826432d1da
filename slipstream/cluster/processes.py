"""Process supervision for the cluster's services: spawn in their own session, wait until ready, find and stop
exactly the processes this cluster started (by pid and command-line markers), never another user's."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from slipstream.cluster.state import (
    POLL_S,
    STARTUP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    ClusterState,
    connect_host,
)
from slipstream.job.prepare import REPO_ROOT

log = logging.getLogger(__name__)


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


def markers(home: Path, state: ClusterState, service: str) -> list[str]:
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


def owned(pid: int | None, markers: list[str]) -> bool:
    if not pid or not _alive(pid):
        return False
    cmd = _cmdline(pid)
    return cmd is None or all(m in cmd for m in markers)


def port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((connect_host(host), port), timeout=1).close()
        return True
    except OSError:
        return False


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def spawn(home: Path, service: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
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


def wait_ready(home: Path, service: str, proc: subprocess.Popen, ready: Callable[[], bool]) -> None:
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


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(POLL_S / 2)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop_pid(pid: int) -> None:
    _signal(pid, signal.SIGTERM)
    if _wait_gone([pid], STOP_TIMEOUT_S):
        _signal(pid, signal.SIGKILL)
        _wait_gone([pid], 5.0)


def ray_leftovers(temp_dir: str) -> list[int]:
    """Processes of this cluster's Ray (gcs_server, raylet, agents...): their command lines name its session dir."""
    marker, me = f"{temp_dir}/session_", os.getpid()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid != me and marker in (_cmdline(pid) or "") and _alive(pid):
            pids.append(pid)
    return pids


def stop_ray(pid: int | None, temp_dir: str) -> None:
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
            if sig == signal.SIGTERM:  # a second for the group to go, no longer than it takes
                _wait_group_gone(pid, 1.0)
        _wait_gone([pid], 5.0)
    if left := ray_leftovers(temp_dir):
        for p in left:
            _signal(p, signal.SIGTERM)
        for p in _wait_gone(left, 10.0):
            _signal(p, signal.SIGKILL)
        _wait_gone(left, 5.0)
