"""What the cluster test modules share: a real cluster per module, the small job spec they submit, and the
wait for a job's status to reach a condition (failing early, with the status, when the job ends instead)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from generator_fleet.engine.faults import STEP_DELAY_ENV
from slipstream.cluster import services as cluster
from slipstream.cluster.state import ClusterInfo

JOB_TIMEOUT_S = 300.0
"""How long a test waits for a job to reach a state (generous: a loaded 2-core CI box); never a measured value."""
ENDED = ("succeeded", "failed", "stopped", "interrupted")
QUICK_POLL_S = 0.25
"""A poll interval for waits on a job's next steps or state: a tiny job trains several steps a second, so
polling once a second would spend most of such a wait asleep; an API status read costs milliseconds."""

TEST_STEP_DELAY_S = "0.1"
"""The engines of a test cluster wait this long after each generation step (STEP_DELAY_ENV): the jobs its
tests submit train until stopped (spec_text), and unpaced each takes every core it can (30 steps a second
alone on 2 cores) while its test scales, checkpoints or restarts it, slowing the tests running beside it.
Paced, a tiny job still trains about 3 steps a second; the four busiest cluster test modules took 218
instead of 263 CPU-s (180 instead of 194 s) alone on a 2-core box, and `make test` 13-14 instead of 15.5-17
minutes there."""


@contextmanager
def paced_engines() -> Iterator[None]:
    """Processes started inside the block (a cluster's Ray, and through it every engine of its jobs) have
    STEP_DELAY_ENV set to TEST_STEP_DELAY_S; so would an engine started in this process (none is, in the
    cluster test modules)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STEP_DELAY_ENV, TEST_STEP_DELAY_S)
        yield


@contextmanager
def running_cluster(prefix: str = "ss-") -> Iterator[ClusterInfo]:
    """A real cluster (Redis, Ray head, control API; no Prometheus) in a fresh HOME under /tmp (short: Ray's
    socket paths must fit), brought down at the end without waiting for jobs still running. Its engines are
    paced (paced_engines) for the whole block: a test that restarts the cluster restarts it paced."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    with paced_engines():
        info = cluster.up(home, start_prometheus=False)
        try:
            yield info
        finally:
            cluster.down(home, force=True)


def spec_text(
    model_dir, name: str, max_staleness: int = 1, group_size: int = 4, groups_per_step: int = 2, **extra
) -> str:
    """A job that trains the tiny model for as long as the test lets it (total_steps is far away); `extra`
    adds top-level sections, e.g. `trainer="{checkpoint_every: 2}"`."""
    text = f"""
name: {name}
output_dir: out
model: {{path: {model_dir}}}
rollout: {{group_size: {group_size}, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1}}
algorithm: {{groups_per_step: {groups_per_step}, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: {max_staleness}}}
"""
    return text + "".join(f"{k}: {v}\n" for k, v in extra.items())


def wait_for(
    client,
    name: str,
    what: str,
    cond: Callable[[dict], bool],
    timeout_s: float = JOB_TIMEOUT_S,
    ended_ok: bool = False,
    poll_s: float = 1.0,
) -> dict:
    """Poll `client.get(name)` until `cond(status)`; fail with the status if the job ends first (unless
    `ended_ok`) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.get(name)
        if cond(st):
            return st
        assert ended_ok or st.get("state") not in ENDED, (what, st)
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(poll_s)


@contextmanager
def control_with_redis(home: Path, api_token: str = "unused", **control_kw) -> Iterator:
    """(control, redis): the real JobControl over a real Redis (a ManagedRedis, for fault tests that stop
    it), with nothing listening where Ray would be (what the control plane does before it reaches Ray:
    spec checks, job records, errors). A submission that passes every check fails on its refused connection
    after all its tries, without the backoff between them (nothing will start listening there)."""
    from common.net import free_port
    from replay_buffer.redis_server import ManagedRedis
    from slipstream.cluster.control import JobControl

    with ManagedRedis(data_dir=home / "redis") as redis:
        no_ray = f"127.0.0.1:{free_port()}"
        info = ClusterInfo(
            home=str(home), host="127.0.0.1", redis_url=redis.url, redis_admin_url=redis.admin_url,
            ray_address=no_ray, dashboard_url=f"http://{no_ray}", prometheus_url=None,
            api_url="", api_token=api_token, ray_auth_token="unused", pids={}, running=True,
        )  # fmt: skip
        control = JobControl(info, **{"submit_backoff_s": 0.0, **control_kw})
        try:
            yield control, redis
        finally:
            control.r.close()


@contextmanager
def control_without_ray(home: Path, api_token: str = "unused") -> Iterator:
    """The real JobControl of `control_with_redis`."""
    with control_with_redis(home, api_token) as (control, _):
        yield control


@contextmanager
def serving(app, **config) -> Iterator[str]:
    """The base URL of `app` served by uvicorn in a thread of this process (real HTTP on loopback)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)  # uvicorn has no startup event to wait on
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
