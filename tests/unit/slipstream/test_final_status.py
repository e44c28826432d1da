"""A job's final state when its driver ends (slipstream/job/driver.py `final_status`), against a real Redis:
a forced stop whose SIGTERM surfaced inside Ray's C++ code (a SystemError whose context is the signal's
Stop) ends the job `stopped`, as a plain Stop does; the same without a stop request is `interrupted`; any
other error is `failed`."""

from __future__ import annotations

import types

import jobspec
from slipstream.job.driver import Stop, final_status
from slipstream.job.store import JobStore


def _raised_inside_ray() -> SystemError:
    """SystemError as CPython reports a C function that returned with the signal handler's exception set."""
    try:
        try:
            raise Stop("signal 15")
        except Stop:
            raise SystemError("<built-in method ...> returned a result with an exception set")  # noqa: B904
    except SystemError as e:
        return e


def _driver(redis_client, job_id, tmp_path, stop: bool):
    store = JobStore(redis_client)
    spec = jobspec.loads(f"name: {job_id}\noutput_dir: {tmp_path}")
    store.create(job_id, jobspec.to_json(spec), 1, 1)
    if stop:
        store.request_stop(job_id, reason="stop --force")
    return types.SimpleNamespace(job=job_id, store=store, spec=spec)


def test_a_forced_stop_that_surfaced_inside_ray_ends_the_job_stopped(redis_client, job_id, tmp_path):
    driver = _driver(redis_client, job_id, tmp_path, stop=True)
    assert final_status(driver, error=_raised_inside_ray())["state"] == "stopped"
    assert final_status(driver, error=Stop("signal 15"))["state"] == "stopped"


def test_without_a_stop_request_a_signal_is_an_interruption_and_an_error_a_failure(
    redis_client, job_id, tmp_path
):
    driver = _driver(redis_client, job_id, tmp_path, stop=False)
    final = final_status(driver, error=_raised_inside_ray())
    assert final["state"] == "interrupted" and "without a stop request" in final["error"]
    failed = final_status(driver, error=RuntimeError("boom"))
    assert failed["state"] == "failed" and "boom" in failed["error"]
