"""Real-run script: a run that does not finish (its spec fails to run) writes a summary with the error and
is not clean."""

import yaml

from benchmarks.real_run import main


def test_unfinished_run_is_not_clean(tmp_path):
    """A spec that fails to run (no model there) writes a summary with the error and is not clean."""
    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "broken",
                "output_dir": str(tmp_path / "run"),
                "model": {"path": str(tmp_path / "none")},
                "algorithm": {"total_steps": 2},
            }
        )
    )
    summary = main([str(tmp_path / "job.yaml"), "--out-dir", str(tmp_path / "out")])
    assert not summary["clean"] and summary["error"] and summary["steps"] == 0
    assert "steps 0 < total_steps 2" in summary["problems"]
