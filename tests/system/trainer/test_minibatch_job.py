"""Mini-batch PPO in a whole job: the progress records each batch's optimizer steps, the clip and the
engines' logprobs as pi_prox (the update itself is checked against the reference in
tests/unit/trainer/test_minibatch.py)."""

import pytest

import jobspec

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_a_job_with_minibatches_clips_and_records_it(tmp_path, tiny_model_dir):
    """A short real CPU job (Redis, Ray, a built-in engine, the weight bus) with 2 mini-batches per batch;
    staleness 0 makes every batch fully on-policy, so the engines' logprobs are pi_prox. The untrained
    model earns a reward in few groups, and a batch of uniform-reward groups has no gradient and so
    nothing to clip: dynamic sampling keeps those groups out, so every mini-batch has advantages."""
    from slipstream.job.local import run_job

    spec = jobspec.from_dict(
        {
            "name": "minibatch",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir)},
            "rollout": {
                "group_size": 4,
                "concurrency": 4,
                "sampling": {"max_new_tokens": 6},
                "dynamic_sampling": {"enabled": True},
            },
            "algorithm": {
                "groups_per_step": 2,
                "total_steps": 3,
                "ppo_minibatches": 2,
                "lr": 1e-2,
                "clip_eps": 0.05,
            },
            "buffer": {"max_staleness": 0},
            "trainer": {"export_hf": False},
        }
    )
    seen = []
    result = run_job(spec, on_progress=seen.append)
    assert result.version == 3 and [r["version"] for r in seen] == [1, 2, 3]  # one version per batch
    assert all(r["optimizer_steps"] == 2 and r["prox_source"] == "engine" for r in seen)
    assert all(r["reward_mean"] > 0 for r in seen)  # no batch of uniform groups only
    assert max(r["clip_fraction"] for r in seen) > 0
    assert all(r["ratio_min"] <= r["ratio_max"] for r in seen)
