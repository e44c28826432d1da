"""Faults injected into a running job's real processes (local Ray, real redis-server, two built-in
engines, gloo trainer; slipstream/job/faults.py): kill -9 a rollout worker mid-episode, kill -9 an engine
mid-generation, hang an engine (SIGSTOP) while the trainer keeps publishing, kill -9 the trainer
mid-step, kill -9 redis-server and restart it on its AOF (appendfsync always). The job driver replaces
each process and every client rides out the Redis outage; training goes on, and at the end no group is
lost or trained twice (group_id ledger).

Each step prints what it injected and what it checked (visible with `pytest -s`)."""

from __future__ import annotations

import pytest

import jobspec
from slipstream.job import faults
from slipstream.job import generators as generators_mod

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def _spec(tmp_path, model_dir, engines: int = 2) -> jobspec.JobSpec:
    return jobspec.loads(
        f"""
name: faults
output_dir: {tmp_path / "out"}
model: {{path: {model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: {engines}, num_workers: {engines}}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 2, worker_lease_s: 2.0, ledger: true, reclaim_idle_ms: 2000}}
trainer: {{checkpoint_every: 5}}
bus: {{backend: gloo, timeout_s: 5.0}}
redis: {{appendfsync: always}}
"""
    )  # total_steps is never reached: the test stops the job, as `slipstream stop` does


def test_job_survives_killed_and_hung_processes(tmp_path, tiny_model_dir, monkeypatch):
    # a hung engine is replaced 10 s after its lease ran out: the bus drops it after its timeouts (about
    # 10 s after the hang, streamed), so the trainer has several seconds of versions while it is still hung
    monkeypatch.setattr(generators_mod, "LAPSED_S", 10.0)
    with faults.LocalJob(_spec(tmp_path, tiny_model_dir), tmp_path) as job:
        d = job.driver
        job.wait("the first steps", lambda: job.version() >= 3, faults.START_WAIT_S)

        f = faults.kill_worker(job)
        job.wait_progress("the worker kill")
        print(
            f"injected {f}; checked: replaced, its {f['prompts_in_flight']} prompts reissued, training goes on"
        )

        f = faults.kill_engine(job, 0)
        job.wait_progress("the engine kill")
        print(f"injected {f}; checked: the replacement holds the current weights and takes traffic")

        f = faults.hang_engine(job, 1)
        assert f["versions_while_hung"] > 0, "the trainer stalled on the hung engine"
        job.wait_progress("the engine hang")
        print(f"injected {f}; checked: the trainer went on while it hung, and it was replaced")

        f = trainer_fault = faults.kill_trainer(job)
        assert f["resumed_at"] <= f["killed_at"]  # the latest checkpoint (every 5 steps)
        job.wait_progress("the trainer kill")
        print(f"injected {f}; checked: the pool resumed from its checkpoint and trains on")

        f = faults.restart_redis(job, down_s=1.0)
        job.wait_progress("the Redis restart")
        print(f"injected {f}; checked: every process reconnected and training goes on ({job.version()})")

        result = job.stop()
        assert result.version >= trainer_fault["resumed_at"] + 3
        assert (
            d.restarts["engines"] == 2
            and d.restarts["trainer_pool"] == 1
            and d.restarts["rollout_workers"] >= 1
        )
        b = faults.books(job)
        print(f"checked the books: {b}")
        assert b["lost"] == 0 and b["trained_twice"] == 0 and b["ledger_matches_consumed"]
        assert b["dead_letter"] == 0 and b["reissue_queue"] == 0
        assert b["reissued"] >= 1


def test_job_whose_only_engine_is_killed_trains_on(tmp_path, tiny_model_dir):
    """kill -9 the job's only engine: its replacement registers as joining, and no rollout can come until
    the weight bus admits it. The trainer, out of groups, publishes for it (bus.idle_sync_s) instead of
    waiting for a step that would never come."""
    with faults.LocalJob(_spec(tmp_path, tiny_model_dir, engines=1), tmp_path) as job:
        job.wait("the first steps", lambda: job.version() >= 3, faults.START_WAIT_S)
        # what a timed-out wait would report: the admission books and where the worker's coroutines wait
        seen = job.situation()
        print(f"situation: {seen}")
        assert "admission: started " in seen and " of cap " in seen, seen
        assert "rollout-0 tasks: " in seen and "rollout.py:" in seen, seen
        f = faults.kill_engine(job, 0)
        job.wait_progress("the kill of the only engine")
        print(
            f"injected {f}; checked: the replacement was admitted with no step to admit it, training goes on"
        )
        job.stop()
        assert job.driver.restarts["engines"] == 1
        b = faults.books(job)
        assert b["lost"] == 0 and b["trained_twice"] == 0 and b["ledger_matches_consumed"], b
