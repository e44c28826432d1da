"""The job's restart budget on real Ray processes: a trainer rank that runs out of memory on every try is
restarted `supervision.out_of_memory_restarts` times, then the job fails with the cause and the keys to
change instead of looping; a full disk fails it at once with the path and its free space; failures that
make progress in between, or have no class, are bounded by `max_restarts` only. The errors are raised for
real in Ray processes (torch.OutOfMemoryError, a write to /dev/full), so what is classified is what
Ray hands the driver."""

from __future__ import annotations

import errno
import os
import time

import http_calls
import pytest
import ray
import torch
from prometheus_client import REGISTRY

import jobspec
from slipstream.job.supervise import (
    DISK_FULL,
    OTHER,
    OUT_OF_MEMORY,
    GiveUp,
    Restarts,
    classify,
    error_of,
)
from slipstream.job.trainers import TrainerPool
from trainer.faults import OOM_MESSAGE


@ray.remote
def _out_of_memory(rank: int) -> None:
    raise torch.OutOfMemoryError(OOM_MESSAGE)


@ray.remote
def _disk_full(path: str) -> None:
    try:
        with open("/dev/full", "wb", buffering=0) as f:  # the kernel's own ENOSPC
            f.write(b"\0")
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from e


@ray.remote
def _bug() -> None:
    raise ValueError("a plain bug")


class FailingRanks(TrainerPool):
    """A trainer pool whose ranks are Ray tasks that fail as `task` does (no model, Redis or engines): the
    real supervision of TrainerPool.check / restart around them."""

    def __init__(self, spec, task, *args, **kw) -> None:
        super().__init__(spec, "redis://127.0.0.1:1", *args, **kw)  # never connected
        self.task, self.started = task, 0

    def start(self, m: int, resume_from: str | None = None) -> None:
        self.ranks, self.runs = [None] * m, [self.task.remote(r) for r in range(m)]
        self.started += 1


def _spec(tmp_path, extra: str = "") -> jobspec.JobSpec:
    return jobspec.loads(f"name: sup\noutput_dir: {tmp_path}\n{extra}")


def _supervise(pool: TrainerPool) -> None:
    """pool.check() as the driver's loop calls it, until the pool gives up (GiveUp) or 60 s pass."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pool.check()
        time.sleep(0.05)
    raise AssertionError("the pool never gave up")


def _restarts_counted(kind: str, cls: str) -> float:
    labels = {"kind": kind, "error_class": cls}
    return REGISTRY.get_sample_value("slipstream_job_restarts_total", labels) or 0.0


def test_errors_raised_in_ray_processes_are_classified(one_cpu_ray, tmp_path):
    oom = error_of(_out_of_memory.remote(0))
    assert classify(oom) == (OUT_OF_MEMORY, OOM_MESSAGE)
    full = error_of(_disk_full.remote(str(tmp_path / "ckpt")))
    cls, cause = classify(full)
    assert cls == DISK_FULL and "No space left on device" in cause and str(tmp_path / "ckpt") in cause
    assert classify(error_of(_bug.remote()))[0] == OTHER
    # a process killed outright leaves only words: Ray's memory monitor, a CUDA allocator's message
    assert classify("ActorDiedError: ... the node running low on memory ...")[0] == OUT_OF_MEMORY
    assert classify("RuntimeError: CUDA error: out of memory")[0] == OUT_OF_MEMORY


def test_a_memory_plan_that_cannot_fit_is_an_out_of_memory_failure():
    from trainer.memory import MemoryPlanError

    err = MemoryPlanError("a micro-batch of the longest sample (4096 tokens) needs 9.0 GiB ...")
    assert classify(err) == (OUT_OF_MEMORY, str(err))
    assert classify(f"Traceback ...\ntrainer.memory.MemoryPlanError: {err}")[0] == OUT_OF_MEMORY


def test_a_repeated_out_of_memory_fails_the_job_after_its_restarts_with_the_cause_and_the_fix(
    one_cpu_ray, tmp_path
):
    seen = []
    spec = _spec(tmp_path, "trainer: {micro_batch_tokens: 4096}")
    restarts = Restarts(spec, version=lambda: 7, on_failure=seen.append)
    pool = FailingRanks(spec, _out_of_memory, restarts=restarts)
    before = _restarts_counted("trainer_pool", OUT_OF_MEMORY)
    pool.start(1)
    with pytest.raises(GiveUp) as err:
        _supervise(pool)
    msg = str(err.value)
    print(msg)
    assert msg.startswith(
        "trainer rank 0 ran out of GPU memory 3 times (CUDA out of memory. Tried to allocate"
    )
    assert "lower trainer.micro_batch_tokens (now 4096)" in msg
    assert "turn on trainer.activation_checkpointing" in msg
    assert "supervision.out_of_memory_restarts: 2" in msg
    assert pool.started == 3 and restarts["trainer_pool"] == 2  # the first pool and two restarts, no more
    assert _restarts_counted("trainer_pool", OUT_OF_MEMORY) == before + 2
    assert [(f.times, f.action) for f in seen] == [
        (1, "restarted"),
        (2, "restarted"),
        (3, "failed the job"),
    ]
    assert restarts.latest is err.value.failure and restarts.latest.version == 7


def test_a_full_disk_fails_the_job_at_once_with_the_path_and_its_free_space(one_cpu_ray, tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000004" / "__0_0.distcp"
    (tmp_path / "checkpoints").mkdir()

    @ray.remote
    def full(rank: int) -> None:
        ray.get(_disk_full.remote(str(ckpt)))

    spec = _spec(tmp_path)
    restarts = Restarts(spec)
    pool = FailingRanks(spec, full, restarts=restarts)
    pool.start(1)
    with pytest.raises(GiveUp) as err:
        _supervise(pool)
    msg = str(err.value)
    print(msg)
    assert msg.startswith("trainer rank 0 found its disk full ([Errno 28] No space left on device")
    assert str(ckpt) in msg and "free of" in msg and f"at {tmp_path / 'checkpoints'}" in msg
    assert "lower trainer.keep_checkpoints (now 2)" in msg and "trainer.checkpoint_dir" in msg
    assert "The job failed at once (supervision.disk_full_restarts: 0)" in msg
    assert pool.started == 1 and restarts["trainer_pool"] == 0


def test_failures_with_progress_between_them_or_no_class_are_bounded_by_max_restarts_only():
    spec = jobspec.loads("supervision: {max_restarts: 5, out_of_memory_restarts: 1}")
    version = iter(range(100))
    restarts = Restarts(spec, version=lambda: next(version))  # each failure a version further on
    for _ in range(5):
        assert restarts.count("trainer_pool", error=torch.OutOfMemoryError(OOM_MESSAGE)).times == 1
    with pytest.raises(GiveUp, match=r"more than 5 replacements \(supervision.max_restarts\)"):
        restarts.count("trainer_pool", error=torch.OutOfMemoryError(OOM_MESSAGE))

    restarts = Restarts(spec)  # no progress at all, but no class that a restart cannot cure
    for n in range(1, 6):
        assert restarts.count("engines", "died", ValueError("boom"), "engine u").times == n
    with pytest.raises(GiveUp, match="The last one: engine u died"):
        restarts.count("engines", "died", ValueError("boom"), "engine u")


def test_another_class_in_between_starts_the_count_again():
    restarts = Restarts(jobspec.loads(""))
    oom, full = torch.OutOfMemoryError(OOM_MESSAGE), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    restarts.count("rollout_workers", error=oom)
    restarts.count("rollout_workers", error=ValueError("killed"))
    assert restarts.count("rollout_workers", error=oom).times == 1
    assert restarts.count("rollout_workers", error=oom).times == 2
    with pytest.raises(GiveUp, match=r"lower rollout.concurrency \(now 16\)"):
        restarts.count("rollout_workers", error=oom)
    with pytest.raises(GiveUp, match="found its disk full"):
        restarts.count("trainer_pool", error=full)


def test_the_driver_serves_the_restarts_metric_where_prometheus_finds_it(redis_server, redis_client, job_id):

    from replay_buffer.keys import JobKeys
    from slipstream.job.actors import serve_metrics

    serve_metrics(redis_server.url, job_id, "driver")  # what the job driver's main does
    address = redis_client.hget(JobKeys(job_id).metrics_targets, "driver")
    assert address is not None  # file_sd lists it as replica `driver` (slipstream/cluster/targets.py)
    address = address.decode() if isinstance(address, bytes) else address
    text = http_calls.get(f"http://{address}/metrics", timeout=10).text
    assert "# TYPE slipstream_job_restarts_total counter" in text
