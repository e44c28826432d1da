"""Rewards over the final assistant text: math-verify correctness (on and off the main thread, never
hanging), the agreed answer formats, and the registry."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

import jobspec
from generator_fleet.rewards import MathVerifier, format_reward, math_verify_reward
from generator_fleet.tasks import REWARDS, build_reward
from generator_fleet.tasks.arith import ArithTask
from generator_fleet.tasks.problem import Problem, Response
from generator_fleet.tools.impl_check import TOOL_MODULES_ENV

HANGS_WITHOUT_TIMEOUT = "So the result is \\boxed{9^{9^{9^{9}}}}"


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42",
        "So we get \\boxed{42}.",
        "42.0",
        "3 * 14 = 42\n#### 42",
        "The answer is $42.",
        "$42$",
    ],
)
def test_math_verify_accepts_the_usual_ways_of_writing_42(text):
    assert math_verify_reward(text, "42") == 1.0


@pytest.mark.parametrize("text", ["The answer is 41", "\\boxed{24}", "I don't know", ""])
def test_math_verify_rejects_wrong_or_missing_answers(text):
    assert math_verify_reward(text, "42") == 0.0


def test_math_verify_reads_thousands_separators():
    assert math_verify_reward("They pay $10,063 in total. The answer is 10,063.", "10063") == 1.0


def test_unparseable_gold_is_a_dataset_error():
    with pytest.raises(ValueError, match="gold answer"):
        math_verify_reward("The answer is 42", "")


def test_math_verify_works_off_the_main_thread():
    texts = ["The answer is 42", "\\boxed{42}", "The answer is 41", "#### 42"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(pool.map(math_verify_reward, texts, ["42"] * 4)) == [1.0, 1.0, 0.0, 1.0]


def test_runaway_answer_times_out_on_the_main_thread():
    t0 = time.monotonic()
    assert MathVerifier(timeout_s=1)(HANGS_WITHOUT_TIMEOUT, "42") == 0.0
    assert time.monotonic() - t0 < 10


def test_runaway_answer_is_killed_off_the_main_thread_and_the_verifier_recovers():
    # math-verify's own limit (5 s) is longer than the hard one, so the helper process gets killed.
    verifier = MathVerifier(timeout_s=5, hard_timeout_s=1.0)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(verifier, "The answer is 42", "42").result() == 1.0  # starts the helper
            t0 = time.monotonic()
            assert pool.submit(verifier, HANGS_WITHOUT_TIMEOUT, "42").result() == 0.0
            assert time.monotonic() - t0 < 5
            assert pool.submit(verifier, "\\boxed{42}", "42").result() == 1.0
    finally:
        verifier.close()


@pytest.mark.parametrize(
    "text, reward",
    [
        ("so #### 42", 1.0),
        ("Hence \\boxed{x+1}", 1.0),
        ("The answer is 42.", 1.0),
        ("the final answer is: -3.5", 1.0),
        ("42", 0.0),
        ("The answer is forty-two", 0.0),
        ("\\boxed{}", 0.0),
    ],
)
def test_format_reward(text, reward):
    assert format_reward(text) == reward


def half_of_length(problem, response, format_weight):
    """A custom reward, named by import path in the test below."""
    return len(response.text) / 2


def test_registry_resolves_names_and_import_paths(monkeypatch):
    task = ArithTask(max_operand=3)
    seven = Problem("3+4", "3+4=", 7)

    def reward(name, text, finished=True, tool_reward=None, weight=0.1):
        rs = jobspec.RewardSpec(name=name, format_weight=weight)
        return build_reward(rs, task)(seven, Response(text=text, finished=finished, tool_reward=tool_reward))

    assert set(REWARDS) == {"arith", "qa", "math_verify", "number", "tool"}
    assert reward(None, "7") == reward("arith", "7") == pytest.approx(1.0)  # the task's own: arith
    assert reward("arith", "The answer is 7") == 0.0  # not a bare number
    assert reward("math_verify", "The answer is 7") == pytest.approx(1.0)
    assert reward("math_verify", "7", finished=False) == pytest.approx(0.9)  # cut off still counts
    assert reward("qa", "The answer is 7", finished=False) == 0.0  # cut off scores 0
    assert reward("qa", "The answer is 7") == pytest.approx(1.0)
    assert reward("tool", "7", tool_reward=0.25) == 0.25 and reward("tool", "7") == 0.0
    assert reward(f"{__name__}:half_of_length", "123456") == 3.0
    with pytest.raises(ValueError, match="unknown reward 'exact'.*arith.*math_verify.*qa.*tool"):
        build_reward(msgspec.structs.replace(jobspec.RewardSpec(), name="exact"), task)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        reward(f"{__name__}:nope", "7")
    monkeypatch.setenv(TOOL_MODULES_ENV, "[]")  # the operator's allow-list: builtins only
    with pytest.raises(ValueError, match="is not allowed on this cluster"):
        reward(f"{__name__}:half_of_length", "7")
    assert reward("arith", "7") == pytest.approx(1.0)  # registered rewards are always allowed


@pytest.mark.parametrize(
    "text, correct",
    [
        ("12 + 1 = 13. The answer is 13.", 1.0),
        ("The answer is 13 apples", 1.0),
        ("#### 13", 1.0),
        ("The answer is 1,300.", 0.0),  # a plain number, but the wrong one
        ("The answer is 1+12.", 0.0),  # an expression restating the sum: math-verify would accept it
        ("The answer is 22 + 0.", 0.0),
        ("The answer is 12. No wait, the answer is 13.", 1.0),  # the last stated answer counts
        ("13", 0.0),  # no agreed form
    ],
)
def test_number_reward_wants_the_right_plain_number(text, correct):
    from generator_fleet.rewards import stated_number_reward, stated_number_score

    assert stated_number_reward(text, "13") == correct
    assert REWARDS["number"] == "generator_fleet.rewards:stated_number_score"
    problem = Problem(prompt_id="p", prompt="12+1=", answer=13)
    score = stated_number_score(problem, Response(text=text, finished=True), 0.1)
    assert score == pytest.approx(0.9 * correct + 0.1 * (text != "13"))
