"""A multi-turn, tool-using job end to end: tiny ChatML model (short SFT warm-up so it calls the
calculator), real engines over HTTP, the real calculator, Redis, Ray, the trainer and the weight bus, and
the evaluation of its agent episodes on a held-out split beside training."""

import re

import pytest

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_tool_job_trains_on_multi_turn_episodes(tmp_path, tools_model_dir):
    spec = jobspec.from_dict(
        {
            "name": "tools-e2e",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tools_model_dir)},
            "dataset": {"name": "word_problems", "num_problems": 50, "difficulty": "easy"},
            "reward": {"name": "math_verify"},
            "agent": {"max_turns": 3, "max_total_tokens": 200, "tool_timeout_s": 5},
            "tools": [{"name": "calculator"}],
            "rollout": {
                "group_size": 4,
                "concurrency": 4,
                "sampling": {"temperature": 0.6, "max_new_tokens": 120},
            },
            "algorithm": {"groups_per_step": 2, "total_steps": 3},
            "buffer": {"max_staleness": 1},
            "eval": {"every": 2, "heldout": 8, "k": 2, "max_samples": 12},
        }
    )
    seen = []
    result = run_job(spec, on_progress=seen.append)
    seen = [p for p in seen if p.get("kind") != "eval"]  # the steps' records (evaluations: result.evals)
    assert result.version == 3 and [p["version"] for p in seen] == [1, 2, 3]
    st = result.buffer
    assert st["consumed"] == 6 and st["pending"] == 0
    assert st["produced"] == st["consumed"] + st["dropped_stale"] + st["unread"]
    # The warmed-up model calls the calculator: episodes have several turns and real tool calls.
    assert sum(p["tool_calls_mean"] for p in seen) > 0
    assert max(p["turns_mean"] for p in seen) > 1
    for p in seen:
        finished = p["finish_stop"] + p["finish_length"] + p["finish_tool_budget"] + p["finish_abort"]
        assert finished == pytest.approx(1.0)
    # One rendered trajectory per step (whichever the step's batch held first: it may or may not have
    # called a tool), model tokens and context tokens told apart where it did.
    blocks = re.split(r"^(?==== version )", (tmp_path / "run" / "samples.txt").read_text(), flags=re.M)[1:]
    assert [int(re.match(r"=== version (\d+) ", b).group(1)) for b in blocks] == [1, 2, 3]
    for b in blocks:
        assert "[prompt]" in b and "[model]" in b, b
        if int(re.search(r" tool_calls (\d+)\n", b).group(1)) > 0:
            assert "<tool_call>" in b and "[context]" in b, b
    # Evaluated at version 0 and the last, each record from one version, over whole agent episodes.
    versions = [e["version"] for e in result.evals]
    assert versions[0] == 0 and versions[-1] == 3 and versions == sorted(set(versions))
    for e in result.evals:
        res = e["eval"]
        assert res["problems"] == 4 and res["samples"] == 4 * 3  # 12 // (greedy + 2)
        assert 0.0 <= res["accuracy"] <= 1.0 and 0.0 <= res["pass@2"] <= 1.0
        assert 1.0 <= res["turns_mean"] <= 3.0  # agent.max_turns
    assert (
        sum(e["eval"]["tool_calls_mean"] for e in result.evals) > 0
    )  # eval episodes call the calculator too
