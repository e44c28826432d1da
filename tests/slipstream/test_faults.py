"""Faults injected into a running job's real processes (local Ray, real redis-server, built-in engines,
gloo trainer): kill -9 a rollout worker mid-episode, kill -9 an engine mid-generation, hang an engine
(SIGSTOP) while the trainer keeps publishing, kill -9 the trainer mid-step. The job driver
(slipstream/driver.py) replaces each; the job runs to its last step; then the buffer's books must
balance and the trained-group ledger must hold every group at most once.

Each step prints what it injected and what it checked (visible with `pytest -s`)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import redis

from replay_buffer import JobKeys, ReplayBuffer
from slipstream import driver as driver_mod
from slipstream import jobspec
from slipstream.jobs import JobStore
from slipstream.redis_server import ManagedRedis

pytestmark = pytest.mark.slow

STEPS = 100_000
"""Never reached: the test stops the job (as `slipstream stop` does) once every fault was handled."""
WAIT_S = 120


def _spec(tmp_path: Path, model_dir: Path, name: str) -> jobspec.JobSpec:
    return jobspec.loads(
        f"""
name: {name}
output_dir: {tmp_path / "out"}
model: {{path: {model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 2, num_workers: 2}}
algorithm: {{groups_per_step: 2, total_steps: {STEPS}, lr: 1.0e-3}}
buffer: {{max_staleness: 2, worker_lease_s: 2.0, ledger: true, reclaim_idle_ms: 2000}}
trainer: {{checkpoint_every: 5}}
bus: {{backend: gloo, timeout_s: 5.0}}
"""
    )


class Job:
    """A JobDriver running in a thread of the test process, over a local Ray and a private Redis."""

    def __init__(self, spec, redis_url: str) -> None:
        self.spec, self.r = spec, redis.Redis.from_url(redis_url)
        self.store = store = JobStore(self.r)
        store.create(spec.name, jobspec.to_json(spec), spec.generators.num_engines, spec.trainer.num_trainers)
        self.driver = driver_mod.JobDriver(spec, redis_url, store)
        self.buffer = ReplayBuffer(self.r, spec.name)
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.driver.run()
        except BaseException as e:  # reported by wait()
            self.error = e

    def version(self) -> int:
        return self.buffer.version()

    def wait(self, what: str, cond) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            assert self.error is None, f"job failed while waiting for {what}: {self.error!r}"
            assert self.result is None, f"job ended while waiting for {what}: {self.result}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def wait_progress(self, what: str, steps: int = 3) -> None:
        v0 = self.version()
        self.wait(f"{steps} more steps after {what}", lambda: self.version() >= min(v0 + steps, STEPS - 1))


@pytest.fixture
def job(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(driver_mod, "LAPSED_S", 3.0)  # a hung engine is replaced 3 s after its lease ran out
    with ManagedRedis(data_dir=tmp_path / "redis") as server:
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1"}},
        )
        j = Job(_spec(tmp_path, tiny_model_dir, "faults"), server.url)
        try:
            yield j
        finally:
            j.driver.close()
            j.thread.join(60)
            ray.shutdown()
            j.r.close()


def _kill(pid: int, sig=signal.SIGKILL) -> None:
    os.kill(pid, sig)


def test_job_survives_killed_and_hung_processes(job):
    d, keys = job.driver, JobKeys("faults")
    job.wait("the first steps", lambda: job.version() >= 3)

    # 1. a rollout worker, killed while it has prompts in flight (its list freezes when it dies; the
    # lease outlives the read below by ~2 s). A worker that had just put its last group is tried again.
    for attempt in range(1, 6):
        actor, _ = d.workers[0]
        pid = ray.get(actor.pid.remote())
        mine = f"-{pid}-".encode()

        def in_flight() -> int:
            return sum(job.r.llen(k) for k in job.r.scan_iter(keys.inflight("*")) if mine in k)  # noqa: B023

        job.wait("the worker to have prompts in flight", lambda: in_flight() > 0)
        _kill(pid)
        n_in_flight = in_flight()
        print(f"injected: kill -9 rollout worker pid {pid} with {n_in_flight} prompts in flight")
        job.wait("the worker's replacement", lambda: d.restarts["rollout_workers"] == attempt)  # noqa: B023
        if n_in_flight:
            break
    assert n_in_flight > 0
    job.wait("its prompts reissued", lambda: int(job.r.hget(keys.stats, "reissued") or 0) >= n_in_flight)
    job.wait_progress("the worker kill")
    print(
        f"checked: replaced, {job.r.hget(keys.stats, 'reissued').decode()} prompts reissued, training goes on"
    )

    # 2. an engine, killed while generating (its requests are retried on the other)
    url, old = d.engine_urls[0], d.engines[0]
    pid = ray.get(old.pid.remote())
    _kill(pid)
    print(f"injected: kill -9 engine {url} (pid {pid})")
    job.wait("the engine's replacement", lambda: d.engines[0] is not old)
    assert d.restarts["engines"] == 1
    new_url = d.engine_urls[0]  # the OS may give the new engine the dead one's port
    job.wait("the new engine to be promoted", lambda: new_url.encode() in _live(job.r, "faults"))
    job.wait_progress("the engine kill")
    print(f"checked: replaced by {new_url}, which got the weights and takes traffic")

    # 3. an engine that hangs (SIGSTOP): the trainer must not hang on it; it is evicted and replaced
    url, old = d.engine_urls[1], d.engines[1]
    pid = ray.get(old.pid.remote())
    v0 = job.version()
    _kill(pid, signal.SIGSTOP)
    print(f"injected: SIGSTOP engine {url} (pid {pid}) at version {v0}")
    try:
        job.wait("the hung engine's replacement", lambda: d.engines[1] is not old)
    finally:
        try:
            _kill(pid, signal.SIGCONT)  # let Ray reap it if it is still there
        except ProcessLookupError:
            pass
    assert job.version() > v0, "the trainer stalled on the hung engine"
    job.wait_progress("the engine hang")
    print(
        f"checked: trainer went on from {v0} to {job.version()} while it hung; replaced by {d.engine_urls[1]}"
    )

    # 4. the trainer, killed mid-step: the pool restarts from the latest checkpoint
    pid = ray.get(d.trainers[0].pid.remote())
    v0 = job.version()
    _kill(pid)
    print(f"injected: kill -9 trainer rank 0 pid {pid} at version {v0}")
    job.wait("the trainer pool's restart", lambda: d.restarts["trainer_pool"] == 1)
    resumed = job.version()
    assert resumed <= v0  # back to the latest checkpoint (every 5 steps)
    job.wait_progress("the trainer kill")
    print(f"checked: the pool resumed at version {resumed} (killed at {v0}) and trains on ({job.version()})")

    job.store.request_stop("faults")
    job.thread.join(WAIT_S)
    assert job.error is None, job.error
    assert job.result is not None and job.result["version"] >= resumed + 3

    # the books: every group produced was trained, dropped as stale, dead-lettered or is still there
    st = job.buffer.stats()
    ledger = [g.decode() for g in job.r.lrange(keys.ledger, 0, -1)]
    print(
        f"checked: produced {st['produced']}, consumed {st['consumed']}, dropped stale "
        f"{st['dropped_stale']}, dead letters {st['dead_letter']}, duplicates skipped {st['duplicates']}, "
        f"ledger {len(ledger)} ({len(set(ledger))} distinct), reissued {st['reissued']}, restarts {d.restarts}"
    )
    assert len(ledger) == len(set(ledger)), "a group was trained twice"
    assert len(ledger) == st["consumed"]
    assert st["dead_letter"] == 0
    assert st["reissued"] >= n_in_flight and st["reissue_queue"] == 0  # every reissued prompt was served
    unacked = st["pending"] + st["unread"]
    assert st["produced"] == st["consumed"] + st["dropped_stale"] + st["duplicates"] + unacked, st


def _live(r: redis.Redis, job: str) -> list[bytes]:
    from generator_fleet.registry import engines_key

    return r.zrange(engines_key(job), 0, -1)
