"""The generator pool's rollout-worker supervision on real Ray tasks: workers that die right after they
start (a missing package, a reward that cannot load) fail the job after CRASH_LOOP of them with the cause
in the error, instead of being replaced MAX_RESTARTS times; workers that die after a while are replaced."""

import time

import pytest
import ray

import jobspec
from slipstream.job import generators as generators_mod
from slipstream.job.generators import GeneratorPool
from slipstream.job.supervise import MAX_RESTARTS

CAUSE = "No module named 'math_verify'"


@ray.remote
def _broken_worker():
    raise ModuleNotFoundError(CAUSE)


class BrokenWorkers(GeneratorPool):
    """A generator pool whose rollout workers are tasks that fail at once (no engine, no Redis)."""

    def _start_worker(self, index: int) -> tuple:
        return None, _broken_worker.remote()


def _pool(tmp_path) -> BrokenWorkers:
    spec = jobspec.loads(f"name: crash\noutput_dir: {tmp_path}\n")
    return BrokenWorkers(spec, "redis://127.0.0.1:1")  # never connected: supervision needs no Redis


def _supervise(pool: GeneratorPool, deaths: int) -> int:
    """Run check_workers (as the driver's loop does) until `deaths` workers were handled; how many of the
    calls said a worker was replaced."""
    deadline = time.monotonic() + 120
    replaced = 0
    while pool.restarts["rollout_workers"] + pool._early_deaths < deaths:
        replaced += pool.check_workers()
        assert time.monotonic() < deadline, "workers were not handled"
        time.sleep(0.05)
    return replaced


def test_workers_dying_at_start_fail_the_job_with_the_cause(one_cpu_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(generators_mod, "kill", lambda actor: None)
    pool = _pool(tmp_path)
    pool.add_workers(1)
    with pytest.raises(RuntimeError) as err:
        _supervise(pool, MAX_RESTARTS)
    msg = str(err.value)
    assert f"{generators_mod.CRASH_LOOP} in a row" in msg and CAUSE in msg
    assert (
        pool.restarts["rollout_workers"] == generators_mod.CRASH_LOOP - 1
    )  # replaced until the loop was seen


def test_workers_dying_later_are_replaced(one_cpu_ray, monkeypatch, tmp_path):
    monkeypatch.setattr(generators_mod, "kill", lambda actor: None)
    monkeypatch.setattr(generators_mod, "EARLY_DEATH_S", 0.0)  # every death counts as after a while
    pool = _pool(tmp_path)
    pool.add_workers(1)
    replaced = _supervise(pool, generators_mod.CRASH_LOOP + 2)
    assert pool._early_deaths == 0 and len(pool.workers) == 1 and replaced >= 1
