"""Real-run script: a tiny CPU job runs to its last step and the summary file says it ran clean, with the
figures taken from the run's own records."""

import json

import pytest
import yaml

from benchmarks.real_run import main

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_tiny_job_runs_clean_and_writes_summary(tmp_path, tiny_model_dir):
    spec = {
        "name": "real-run-tiny",
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
        "algorithm": {"groups_per_step": 2, "total_steps": 3},
        "buffer": {"max_staleness": 1},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    summary = main([str(tmp_path / "job.yaml"), "--out-dir", str(tmp_path / "out"), "--window", "2"])
    [path] = (tmp_path / "out").glob("real_run-real-run-tiny-cpu-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(summary))
    assert summary["clean"] and summary["problems"] == [] and summary["error"] is None
    assert (summary["steps"], summary["total_steps"]) == (3, 3)
    records = [json.loads(x) for x in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert summary["reward_last"] == pytest.approx(sum(r["reward_mean"] for r in steps[-2:]) / 2)
    assert summary["logprob_abs_diff_mean"] >= 0 and summary["restarts"] == {
        "rollout_workers": 0,
        "engines": 0,
        "trainer_pool": 0,
    }
