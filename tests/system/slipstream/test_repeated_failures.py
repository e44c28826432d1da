"""A running job whose trainer fails in a way a restart does not cure (local Ray, real redis-server, a
built-in engine, a gloo trainer; slipstream/job/faults.py). The failure is injected into the real trainer
rank through its testing hook (trainer/faults.py): an out-of-memory error on the step that trains version 3,
every time it runs, as a batch too large for the GPU does; a real ENOSPC (/dev/full) inside the checkpoint
at version 2. Supervision restarts the out-of-memory pool `supervision.out_of_memory_restarts` (2) times,
then ends the job `failed`, never looping, with the cause, the count and the keys to change in its error and
status; the full disk ends it at once, its partial checkpoint removed."""

from __future__ import annotations

import pytest

import jobspec
from slipstream.job import faults
from slipstream.job.supervise import GiveUp
from trainer import checkpoint
from trainer.faults import FAULT_ENV

pytestmark = pytest.mark.usefixtures("own_ray")  # its Ray processes inherit the fault set in the environment


def _spec(tmp_path, model_dir) -> jobspec.JobSpec:
    return jobspec.loads(
        f"""
name: repeats
output_dir: {tmp_path / "out"}
model: {{path: {model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 2, worker_lease_s: 2.0, reclaim_idle_ms: 2000}}
trainer: {{checkpoint_every: 2, export_hf: false}}
bus: {{backend: gloo, timeout_s: 5.0}}
"""
    )  # total_steps is never reached: the fault ends the job


def _ended(job: faults.LocalJob) -> BaseException:
    job.thread.join(faults.WAIT_S * 2)
    assert not job.thread.is_alive(), f"the job is still running: {job.situation()}"
    assert job.result is None and job.error is not None
    return job.error


def test_a_trainer_out_of_memory_on_every_try_fails_the_job_after_two_restarts(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "oom@3")  # the job's Ray processes inherit it
    seen = []
    with faults.LocalJob(_spec(tmp_path, tiny_model_dir), tmp_path) as job:
        job.driver.restarts.on_failure = lambda f: (seen.append(f), job.driver.report())
        error = _ended(job)
        st = job.store.status(job.spec.name)
    print(f"status error: {st.error}")
    print(f"status failure: {st.failure}")
    print(f"failures at {[round(s.at - seen[0].at, 1) for s in seen]} s from the first")
    assert isinstance(error, GiveUp)
    assert st.state == "failed" and st.error == str(error)
    assert st.error.startswith(
        "trainer rank 0 ran out of GPU memory 3 times (CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert "lower trainer.micro_batch_tokens (now 8192)" in st.error
    assert "turn on trainer.activation_checkpointing" in st.error
    assert "(supervision.out_of_memory_restarts: 2)" in st.error
    assert st.restarts["trainer_pool"] == 2  # restarted twice, then no more
    f = st.failure
    assert (f["who"], f["error_class"], f["times"], f["action"]) == (
        "trainer rank 0",
        "out_of_memory",
        3,
        "failed the job",
    )
    # while it ran, the status said what failed and how often; each restart resumed at the checkpoint
    # of version 2, never below: the version did not regress further with each restart
    assert [(s.times, s.action, s.resumed_at) for s in seen] == [
        (1, "restarted", 2),
        (2, "restarted", 2),
        (3, "failed the job", None),
    ]
    assert st.checkpoint_version == 2 and "the job failed" in st.note


def test_a_full_disk_under_a_checkpoint_fails_the_job_at_once_and_leaves_no_partial_one(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "enospc@2")
    with faults.LocalJob(_spec(tmp_path, tiny_model_dir), tmp_path) as job:
        error = _ended(job)
        st = job.store.status(job.spec.name)
    print(f"status error: {st.error}")
    ckpts = tmp_path / "out" / "checkpoints"
    assert isinstance(error, GiveUp) and st.state == "failed"
    assert st.error.startswith("trainer rank 0 found its disk full ([Errno 28] No space left on device")
    assert f"writing checkpoint {checkpoint.step_dir(ckpts, 2)}" in st.error and "free of" in st.error
    assert "The job failed at once (supervision.disk_full_restarts: 0)" in st.error
    assert st.restarts["trainer_pool"] == 0 and st.failure["error_class"] == "disk_full"
    assert not list(ckpts.glob("*step-00000002*"))  # neither complete nor partial
