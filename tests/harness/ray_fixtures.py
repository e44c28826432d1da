"""One local Ray for the whole-job tests of a pytest run (fixture `shared_ray`): `run_job` and `LocalJob`
use the Ray this process is connected to and leave it running, so consecutive job tests skip Ray's start
and stop (about 5 s each on 2 cores). A test whose job leaves Ray's resources taken gets the next test a
fresh Ray; a test that starts a Ray of its own calls `shutdown_shared_ray()` first."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

SHARED_CPUS = 4
"""Logical CPUs of the shared Ray: what LocalJob asks for (slipstream/job/faults.py); run_job's own Ray
would have max(2, cores)."""
RELEASE_WAIT_S = 15.0
"""How long a finished job's actors may take to give their resources back before Ray is restarted."""


_started = False
"""Whether the Ray this process is connected to is the shared one (started by `shared_ray`)."""


def shutdown_shared_ray() -> None:
    """Stop the shared Ray if it is up (a module's own Ray, started by its fixture, is left alone)."""
    global _started
    import ray

    if _started and ray.is_initialized():
        ray.shutdown()
    _started = False


def _resources_free(ray) -> bool:
    """Every resource the cluster has is available again (the job's actors are gone)."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        taken = {
            k: v - free.get(k, 0.0)
            for k, v in total.items()
            if not k.startswith("node:")
            and k not in ("memory", "object_store_memory")
            and free.get(k, 0.0) < v
        }
        if not taken:
            return True
        if time.monotonic() > deadline:
            log.warning("shared Ray: resources still taken after the test (%s): restarting it", taken)
            return False
        time.sleep(0.25)


def pytest_runtest_teardown(item, nextitem) -> None:
    """The shared Ray lives only across consecutive whole-job tests: the next test outside tests/system
    (unit, integration) finds no Ray connected, as it would alone."""
    system = Path(__file__).resolve().parents[1] / "system"
    if nextitem is None or system not in Path(nextitem.fspath).parents:
        shutdown_shared_ray()


@pytest.fixture(scope="session")
def _shared_ray_session():
    yield
    shutdown_shared_ray()


@pytest.fixture
def shared_ray(_shared_ray_session):
    """A local Ray this process is connected to, for the test's `run_job` / `LocalJob` to run on."""
    import ray

    from slipstream.job.prepare import init_local_ray

    global _started
    if not ray.is_initialized():
        init_local_ray(num_cpus=max(SHARED_CPUS, os.cpu_count() or 1))
        _started = True
    yield
    if _started and ray.is_initialized() and not _resources_free(ray):
        shutdown_shared_ray()


@pytest.fixture
def own_ray():
    """No shared Ray: the test's job starts a Ray of its own, whose processes inherit the environment the
    test set (fault injection through the environment)."""
    shutdown_shared_ray()
    yield
    shutdown_shared_ray()


@pytest.fixture(scope="module")
def one_cpu_ray():
    """A quiet private Ray of one logical CPU for a module's supervision tests (not the shared one)."""
    import ray

    shutdown_shared_ray()
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()
