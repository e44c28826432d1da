"""A short real job with `bus.backend: ipc`: the trainer hands every update to the built-in engines
(local Ray actors on this host) through /update_weights_from_tensor and shared memory, no process group."""

import pytest

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_short_job_publishes_over_ipc(tmp_path, tiny_model_dir):
    spec = jobspec.from_dict(
        {
            "name": "ipc",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 4}},
            "generators": {"num_engines": 2, "num_workers": 1},
            "algorithm": {"groups_per_step": 2, "total_steps": 3},
            "buffer": {"max_staleness": 0},
            "bus": {"backend": "ipc", "bucket_bytes": 64 * 1024},
        }
    )
    seen = []
    result = run_job(spec, on_progress=seen.append)

    assert result.version == 3
    assert [p["version"] for p in seen] == [1, 2, 3]
    assert all(p["publish_s"] > 0 for p in seen)  # every version reached the engines
    assert all(p["publish_call_s"] >= p["pause_s"] >= p["publish_s"] for p in seen)
    st = result.buffer
    assert st["staleness"] == {0: st["consumed"]} and st["dropped_stale"] == 0  # on-policy: versions landed
    assert st["consumed"] == 3 * 2
