"""Experiment tracking of a real job: a short job run with run_job writes every step to TensorBoard and to a
W&B offline run in its output_dir, with the values of its progress records."""

import pytest
from tracking_files import tb_events, tracking_spec, wandb_history

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_a_short_job_tracks_every_step_in_tensorboard_and_wandb(tmp_path, tiny_model_dir):
    from slipstream.job.local import run_job

    out = tmp_path / "run"
    spec = tracking_spec(
        out,
        model={"path": str(tiny_model_dir)},
        rollout={"group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 4}},
        generators={"num_engines": 1, "num_workers": 1},
        algorithm={"groups_per_step": 2, "total_steps": 3},
    )
    result = run_job(spec)
    assert result.version == 3
    acc = tb_events(out)
    for tag in (
        "train/reward_mean",
        "train/loss",
        "train/staleness_mean",
        "train/tokens_per_s",
        "train/step_s",
    ):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3], tag
    assert [round(e.value, 6) for e in acc.Scalars("train/reward_mean")] == [
        round(p["reward_mean"], 6) for p in result.progress
    ]
    assert "config/spec/text_summary" in acc.Tags()["tensors"]
    rows = [r for r in wandb_history(out) if "train/reward_mean" in r]
    assert [r["_step"] for r in rows] == [1, 2, 3]
    assert [round(r["train/loss"], 6) for r in rows] == [round(p["loss"], 6) for p in result.progress]
