"""Evaluation of agent jobs, in one process: the spec takes `eval` with `agent` and keeps its other checks,
an episode's version is the one version of every turn, and the eval line shows tool calls and turns after
the scores."""

from __future__ import annotations

import pytest

import jobspec
from generator_fleet.client import GenerateResult
from generator_fleet.evaluation import episode_version


def test_spec_takes_eval_with_an_agent_and_keeps_the_other_checks():
    base = {
        "dataset": {"name": "word_problems", "num_problems": 50},
        "agent": {"max_turns": 2},
        "tools": [{"name": "calculator"}],
    }
    spec = jobspec.from_dict({**base, "eval": {"heldout": 8, "k": 2}})
    cfg = spec.eval_config()
    assert cfg.agent == spec.agent and [t.name for t in cfg.tools] == ["calculator"]
    assert cfg.max_new_tokens == spec.rollout.sampling.max_new_tokens  # per model turn
    assert jobspec.from_dict({"eval": {}}).eval_config().agent is None
    with pytest.raises(jobspec.JobSpecError, match=r"none of the dataset's 50 .* `\$\.eval\.heldout`"):
        jobspec.from_dict({**base, "eval": {"heldout": 50}})
    with pytest.raises(jobspec.JobSpecError, match=r"temperature > 0 - at `\$\.eval\.temperature`"):
        jobspec.from_dict({**base, "eval": {"heldout": 8, "k": 2, "temperature": 0.0}})


def test_episode_version_is_the_one_version_of_every_turn():
    def res(versions, finish="stop", v="4"):
        return GenerateResult(
            output_ids=[1] * len(versions),
            output_logprobs=[],
            finish_reason=finish,
            token_versions=versions,
            weight_version=v,
            prompt_tokens=1,
        )

    assert episode_version([res([4, 4]), res([4])]) == 4
    assert episode_version([res([4, 4]), res([5])]) is None  # a weight update between two turns
    assert episode_version([res([4, 5])]) is None  # ... or inside one
    assert episode_version([res([], "abort", v="3"), res([4])]) == 4  # aborted before any token
    assert episode_version([res([4], "abort"), res([5])]) is None  # a turn resumed at a new version


def test_agent_eval_lines_show_tool_calls_and_turns_after_the_scores():
    from generator_fleet.evaluation import format_scores

    res = {"accuracy": 0.5, "problems": 4.0, "turns_mean": 2.0, "tool_calls_mean": 1.25, "pass@2": 0.75}
    assert format_scores(res) == "accuracy 0.500  pass@2 0.750  turns_mean 2.000  tool_calls_mean 1.250"
    assert format_scores({"accuracy": 0.5}) == "accuracy 0.500"
