"""A running job whose built-in engine hits a CUDA error that poisons its context (local Ray, real
redis-server, the engine in its Ray actor, gloo trainer; slipstream/job/faults.py). The fault is injected
through the runner's testing hook (a file the first engine step after it appears takes and raises, as
a real sticky CUDA error would). The engine turns unhealthy and stops, its actor's watch() fails with
the cause, the driver logs that cause and replaces it, and training goes on with nothing lost."""

from __future__ import annotations

import logging

import pytest

import jobspec
from generator_fleet.engine.faults import FAULT_ENV
from slipstream.job import faults

pytestmark = pytest.mark.usefixtures("own_ray")  # its Ray processes inherit the fault set in the environment

STICKY = "CUDA error: an illegal memory access was encountered"


def _spec(tmp_path, model_dir) -> jobspec.JobSpec:
    return jobspec.loads(
        f"""
name: poisoned
output_dir: {tmp_path / "out"}
model: {{path: {model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 2, worker_lease_s: 2.0, ledger: true, reclaim_idle_ms: 2000}}
bus: {{backend: gloo, timeout_s: 5.0}}
"""
    )  # total_steps is never reached: the test stops the job, as `slipstream stop` does


def test_a_poisoned_engine_is_replaced_and_training_goes_on(tmp_path, tiny_model_dir, monkeypatch, caplog):
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, f"@{fault}")  # the job's Ray processes inherit it
    caplog.set_level(logging.WARNING, logger="slipstream.job.generators")
    with faults.LocalJob(_spec(tmp_path, tiny_model_dir), tmp_path) as job:
        d = job.driver.generators
        job.wait("the first steps", lambda: job.version() >= 2, faults.START_WAIT_S)
        old, url = d.engines[0], d.engine_urls[0]
        staged = tmp_path / "fault.staged"
        staged.write_text(STICKY)
        staged.rename(fault)  # appears whole: the engine's next step takes it
        print(f"injected: {STICKY!r} into engine {url} at version {job.version()}")
        job.wait("the poisoned engine's replacement", lambda: d.engines[0] is not old and not d.replacing(0))
        assert not fault.exists() and len(list(tmp_path.glob("fault.taken-*"))) == 1
        new_url = d.engine_urls[0]
        job.wait("the new engine to take traffic", lambda: new_url in faults.d_live(job))
        job.wait_progress("the poisoned engine's replacement")
        job.stop()
        assert job.driver.restarts["engines"] == 1
        why = [r.getMessage() for r in caplog.records if "replacing it" in r.getMessage()]
        print(f"the driver: {why}")
        assert len(why) == 1 and "engine unhealthy" in why[0] and STICKY in why[0], why
        b = faults.books(job)
        assert b["lost"] == 0 and b["trained_twice"] == 0 and b["ledger_matches_consumed"], b
