"""Token budgets against the model's real context: a `rollout.sampling.max_new_tokens` (or an eval's
`max_new_tokens`) that leaves no room for a prompt in the model's max_position_embeddings is refused with its
key and the numbers by `validate`, by a submit to the control API (on the real JobControl over a real
Redis) and by a local `run` once its model exists; while the model is not built yet nothing is claimed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_helpers import control_without_ray

import jobspec
from slipstream import cli
from slipstream.cluster.control import ControlError
from slipstream.job.local import run_job

CONTEXT = 64
"""The tiny models' max_position_embeddings (model_zoo/tiny.py)."""


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": CONTEXT}))
    return path


def _spec(model: Path, name: str = "ctx", **sections) -> str:
    return json.dumps({"name": name, "model": {"path": str(model)}, **sections})


def _sampling(tokens: int) -> dict:
    return {"sampling": {"max_new_tokens": tokens}}


def test_the_largest_budget_that_fits_passes_and_one_more_is_refused(model):
    # An engine holds context - 1 = 63 tokens per sequence; a prompt has at least one.
    jobspec.check_context(jobspec.loads(_spec(model, rollout=_sampling(62))))
    with pytest.raises(jobspec.JobSpecError) as e:
        jobspec.check_context(jobspec.loads(_spec(model, rollout=_sampling(63))))
    msg = str(e.value)
    assert msg.endswith("at most 62 - at `$.rollout.sampling.max_new_tokens`"), msg
    assert "max_new_tokens 63" in msg and "context of 64" in msg and str(model / "config.json") in msg


def test_eval_budget_is_checked_and_an_agents_episode_budget_is_not(model):
    with pytest.raises(
        jobspec.JobSpecError, match=r"eval\.max_new_tokens 64 .* - at `\$\.eval\.max_new_tokens`"
    ):
        jobspec.check_context(jobspec.loads(_spec(model, eval={"max_new_tokens": 64})))
    # A budget over an episode's turns, each of which asks for rollout.sampling.max_new_tokens at most.
    jobspec.check_context(jobspec.loads(_spec(model, agent={"max_total_tokens": 512}, rollout=_sampling(8))))


def test_sglang_context_length_is_the_engines_context(model):
    spec = _spec(
        model, rollout=_sampling(100), generators={"engine": "sglang", "sglang": {"context_length": 256}}
    )
    jobspec.check_context(jobspec.loads(spec))
    spec = _spec(
        model, rollout=_sampling(30), generators={"engine": "sglang", "sglang": {"context_length": 16}}
    )
    with pytest.raises(jobspec.JobSpecError, match=r"generators\.sglang\.context_length"):
        jobspec.check_context(jobspec.loads(spec))


def test_a_model_not_built_yet_is_not_checked(tmp_path):
    spec = jobspec.loads(_spec(tmp_path / "not-built", rollout=_sampling(4096)))
    jobspec.check_context(spec)


def test_validate_submit_and_run_refuse_a_budget_over_the_context(model, tmp_path, capsys):
    text = _spec(model, name="overlong", rollout=_sampling(200))
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "`$.rollout.sampling.max_new_tokens`" in err and "200" in err and "Traceback" not in err, err

    with control_without_ray(tmp_path / "home") as control:
        with pytest.raises(ControlError) as e:
            control.submit(text, [], str(tmp_path))
        assert e.value.status == 422
        assert "`$.rollout.sampling.max_new_tokens`" in str(e.value)
        assert not control.store.exists("overlong")

    # `run` (the model exists: nothing is built) stops before any Redis or Ray starts.
    out = tmp_path / "out"
    with pytest.raises(jobspec.JobSpecError, match=r"max_new_tokens 200"):
        run_job(jobspec.loads(text, [f"output_dir={out}"]))
    assert not (out / "redis").exists()
