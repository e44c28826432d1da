"""A short real job with evaluation: local Ray, built-in engines, one trainer, and the evaluator beside the
rollout workers. Evaluations at version 0 (before the first step) and at the last version, each from one
weight version, in the progress records, the report and the status; none of their samples in the buffer."""

import json

import pytest

import jobspec
from slipstream.job.local import run_job
from slipstream.job.progress import format_progress

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_job_evaluates_version_zero_and_the_last(tmp_path, tiny_model_dir):
    spec = jobspec.from_dict(
        {
            "name": "eval-job",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
            "algorithm": {"groups_per_step": 2, "total_steps": 3},
            "buffer": {"max_staleness": 0},
            "eval": {"every": 2, "heldout": 16, "k": 2, "max_samples": 24},
        }
    )
    seen = []
    result = run_job(spec, on_progress=seen.append)

    assert result.version == 3
    versions = [e["version"] for e in result.evals]
    assert versions[0] == 0 and versions[-1] == 3
    assert versions == sorted(set(versions))  # one evaluation per version
    for e in result.evals:
        assert e["kind"] == "eval" and e["attempt"] == 1
        assert set(e["eval"]) >= {"accuracy", "greedy_reward", "pass@2", "duration_s"}
        assert e["eval"]["problems"] == 8 and e["eval"]["samples"] == 8 * 3  # 24 // (greedy + 2)
        assert 0.0 <= e["eval"]["accuracy"] <= 1.0 and 0.0 <= e["eval"]["pass@2"] <= 1.0
    # the version-0 evaluation came before the first step; `slipstream run` prints each as a line
    kinds = [("eval" if r.get("kind") == "eval" else "step", r["version"]) for r in seen]
    assert kinds[0] == ("eval", 0) and kinds[-1] == ("eval", 3)
    assert [v for k, v in kinds if k == "step"] == [1, 2, 3]
    assert format_progress(seen[0], 3).startswith("eval  version    0  accuracy ")
    # the steps' records hold no evaluation (each is a step's, tagged so), and the buffer only the rollouts'
    # groups
    assert all(p["kind"] == "step" for p in result.progress)
    st = result.buffer
    assert st["consumed"] == 3 * 2
    assert st["produced"] == st["consumed"] + st["dropped_stale"] + st["unread"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines if x.get("kind") == "eval"] == versions
    assert (tmp_path / "run" / "report_eval.png").stat().st_size > 0
