"""What the job driver's loop reports about its surroundings: the free space of the job's output and
checkpoint disks as a metric, read from real directories every poll; and a full Redis (maxmemory reached,
on a real redis-server with a tiny limit) met by the driver's command poll fails the job with the
documented "Redis is full (used X of maxmemory Y)" error, not redis-py's bare OutOfMemoryError."""

from __future__ import annotations

import secrets
import shutil

import pytest
import redis
from prometheus_client import REGISTRY

import jobspec
from replay_buffer.client import connect
from replay_buffer.redis_server import ManagedRedis, job_user, set_job_user
from replay_buffer.stream import RedisFullError
from slipstream.job.driver import JobDriver
from slipstream.job.store import JobStore
from slipstream.job.supervise import record_disk_free

MAXMEMORY = 4 << 20
"""Small enough to fill in a moment, above what an empty redis-server uses (~1 MB)."""


def _free(label: str) -> float | None:
    return REGISTRY.get_sample_value("slipstream_job_disk_free_bytes", {"dir": label})


def test_free_space_of_the_output_and_checkpoint_disks_is_a_metric(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    record_disk_free({"output": out, "checkpoints": out / "checkpoints" / "not-yet"})
    free = shutil.disk_usage(tmp_path).free
    for label in ("output", "checkpoints"):  # a directory not made yet: the disk it will be made on
        assert _free(label) == pytest.approx(free, rel=0.01), label  # other processes write meanwhile
    record_disk_free({"output": tmp_path / "gone"})  # its parent's disk: still a value, no error
    assert _free("output") > 0


def _fill(admin: redis.Redis) -> None:
    """Fill Redis until even a small write is refused (a large one alone frees its query buffer after)."""
    i = 0
    for size in (65536, 8192, 1024, 128, 16):
        try:
            while True:
                admin.set(f"fill:{i}", b"x" * size)
                i += 1
        except redis.exceptions.OutOfMemoryError:
            pass


class _Pools:
    """The driver's two pools, started and quiet (no Ray): the trainer pool's check fills Redis, as a
    buffer nobody drains would, reports a replacement from its second poll on, and ends the job after 20
    polls if nothing failed."""

    def __init__(self, admin: redis.Redis) -> None:
        self.admin, self.polls = admin, 0
        # one engine and one rank, as the job's record wants: the driver has nothing to scale
        self.engines, self.ranks, self.workers, self.evaluator, self.scalable, self.size = (
            [None],
            [None],
            [],
            None,
            False,
            0,
        )
        self.engine_states = (1, 0, 0)  # running, starting, waiting (slipstream_job_engines)

    def check(self):
        """Keeps Redis full (a refused write can free its query buffer) and says a process was replaced,
        so the driver records its state on that poll, as it does after any restart."""
        self.polls += 1
        _fill(self.admin)
        return ({"version": 0} if self.polls > 20 else None), self.polls >= 2

    waiting_notes: dict[str, str] = {}  # no engine replacement waits here
    target = 1

    def check_workers(self) -> bool:
        return False

    check_engines = check_workers

    def check_evaluator(self) -> None:
        pass


def test_a_full_redis_at_the_drivers_command_poll_fails_with_the_clear_error(tmp_path):
    job = "full-driver"
    with ManagedRedis(data_dir=tmp_path / "r", maxmemory=MAXMEMORY) as server:
        admin = redis.Redis.from_url(server.admin_url)
        password = secrets.token_hex(16)
        set_job_user(admin, job, password)
        url = f"redis://{job_user(job)}:{password}@{server.host}:{server.port}/0"
        spec = jobspec.loads(f"name: {job}\noutput_dir: {tmp_path / 'out'}")
        (tmp_path / "out").mkdir()
        JobStore(admin).create(job, jobspec.to_json(spec), 1, 1)  # the control plane's record
        driver = JobDriver(spec, url, JobStore(connect(url)))  # the driver reads it as the job's user
        driver.start = lambda desired: None  # its pools are the stand-in below
        driver.generators = driver.trainers = pools = _Pools(admin)
        with pytest.raises(RedisFullError) as err:
            driver.run()
        msg = str(err.value)
        assert msg.startswith("Redis is full (used ") and f"of maxmemory {MAXMEMORY} bytes)" in msg, msg
        assert "--redis-maxmemory" in msg and f"job {job!r} cannot record its state" in msg, msg
        assert isinstance(err.value.__cause__, redis.exceptions.OutOfMemoryError)
        assert pools.polls < 20  # the first poll after Redis filled failed, not the end of the job
        assert _free("output") == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
