"""Staleness without length bias, through a real job: response lengths of trained (and stale-dropped)
samples are reported per step, in the run's histograms and to the tracker; with the default admission
(`buffer.admission: oldest`) no group is dropped as stale while every trained group stays within the bound,
even with response lengths spread over the whole budget (the untrained tiny model stops at random)."""

import pytest

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_default_admission_drops_nothing_and_reports_lengths(tmp_path, tiny_model_dir):
    spec = jobspec.from_dict(
        {
            "name": "lengths",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"group_size": 4, "concurrency": 16, "sampling": {"max_new_tokens": 32}},
            "generators": {"num_engines": 1, "num_workers": 1},
            "algorithm": {"groups_per_step": 3, "total_steps": 4},
            "buffer": {"max_staleness": 1},
            "trainer": {"export_hf": False},
        }
    )
    assert spec.buffer.admission == "oldest"  # the default
    result = run_job(spec)
    assert result.version == 4
    st = result.buffer
    assert st["dropped_stale"] == 0 and st["recycled"] == 0
    assert max(st["staleness"]) <= 1 and sum(st["staleness"].values()) == st["consumed"] == 12
    for rec in result.progress:
        assert rec["stale_samples"] == 0 and rec["len_stale_mean"] is None
        assert 1 <= rec["len_trained_p50"] <= rec["len_trained_p90"] <= 32
        assert rec["len_trained_mean"] > 0
    trained = result.lengths["trained"]
    assert sum(trained.values()) == 12 * 4 and result.lengths["stale"] == {}
    assert len(trained) > 3  # lengths spread out: the bound held with long and short groups mixed
    by_step = [rec["len_trained_mean"] * rec["samples"] for rec in result.progress]
    assert sum(by_step) == pytest.approx(sum(n * c for n, c in trained.items()))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/len_trained_p90")] == [1, 2, 3, 4]
    assert "train/len_stale_mean" not in acc.Tags()["scalars"]  # null: nothing dropped
    assert (tmp_path / "run" / "report_lengths.png").exists()
