"""The job driver's rollout-worker supervision on real Ray tasks: workers that die right after they start
(a missing package, a reward that cannot load) fail the job after CRASH_LOOP of them with the cause in
the error, instead of being replaced MAX_RESTARTS times; workers that die after a while are replaced."""

import time

import pytest
import ray

from slipstream.job import driver as driver_mod

CAUSE = "No module named 'math_verify'"


@ray.remote
def _broken_worker():
    raise ModuleNotFoundError(CAUSE)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _driver() -> driver_mod.JobDriver:
    """A JobDriver with only what check_workers uses; its workers are tasks that fail at once."""
    d = object.__new__(driver_mod.JobDriver)
    d.workers, d.closing = [], False
    d.restarts = {"rollout_workers": 0, "engines": 0, "trainer_pool": 0}
    d._worker_born, d._early_deaths = {}, 0
    d.reports = 0

    def add_workers(count: int) -> None:
        for _ in range(count):
            ref = _broken_worker.remote()
            d._worker_born[ref] = time.monotonic()
            d.workers.append((None, ref))

    d.add_workers = add_workers
    d.report = lambda *a, **k: setattr(d, "reports", d.reports + 1)
    return d


def _supervise(d: driver_mod.JobDriver, deaths: int) -> None:
    """Run check_workers (as the driver's loop does) until `deaths` workers were handled."""
    deadline = time.monotonic() + 120
    while d.restarts["rollout_workers"] + d._early_deaths < deaths:
        d.check_workers()
        assert time.monotonic() < deadline, "workers were not handled"
        time.sleep(0.05)


def test_workers_dying_at_start_fail_the_job_with_the_cause(local_ray, monkeypatch):
    monkeypatch.setattr(driver_mod, "_kill", lambda actor: None)
    d = _driver()
    d.add_workers(1)
    with pytest.raises(RuntimeError) as err:
        _supervise(d, driver_mod.MAX_RESTARTS)
    msg = str(err.value)
    assert f"{driver_mod.CRASH_LOOP} in a row" in msg and CAUSE in msg
    assert d.restarts["rollout_workers"] == driver_mod.CRASH_LOOP - 1  # replaced until the loop was seen


def test_workers_dying_later_are_replaced(local_ray, monkeypatch):
    monkeypatch.setattr(driver_mod, "_kill", lambda actor: None)
    monkeypatch.setattr(driver_mod, "EARLY_DEATH_S", 0.0)  # every death counts as after a while
    d = _driver()
    d.add_workers(1)
    _supervise(d, driver_mod.CRASH_LOOP + 2)
    assert d._early_deaths == 0 and len(d.workers) == 1 and d.reports >= 1
