"""The rollout workflow against a real engine: the reward the job spec names scores every single-turn
sample (the task's own reward when it names none), and the spec refuses unknown tasks and rewards."""

from __future__ import annotations

import asyncio

import pytest

import jobspec
from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.tasks import build_task, check_import_paths
from generator_fleet.tasks.arith import score as arith_score
from generator_fleet.workflow import AgentEpisodes, SingleTurn, build_workflow
from models.tokenizers import load_tokenizer

KEY = "workflow-test-key"


def length_reward(problem, response, format_weight):
    """A custom reward named by import path: the response's length, plus 100 when it finished itself."""
    return len(response.text) + 100.0 * response.finished


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def _group(spec, engine, tok):
    """One group of the first problem, greedy, through the workflow the spec resolves to."""
    task = build_task(spec.dataset)
    workflow = build_workflow(spec, tok, task)
    problem = task.problems[0]

    async def run():
        client = EngineClient(engine.url, api_key=KEY)
        try:

            async def generate(ids, params):
                return await client.generate_batch(ids, params, return_logprob=True)

            return await workflow.run(problem, generate, lambda: False)
        finally:
            await client.aclose()

    return workflow, problem, asyncio.run(run())


def _texts(samples, tok):
    """(text without EOS, ended by EOS) of each sample, as the reward sees it."""
    out = []
    for s in samples:
        ids = s.view("response_ids").tolist()
        eos = bool(ids) and ids[-1] == tok.eos_token_id and s.finish_reason == "stop"
        out.append((tok.decode(ids[:-1] if eos else ids), eos))
    return out


def test_single_turn_job_gets_the_reward_its_spec_names(engine, tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    base = {
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"group_size": 3, "sampling": {"temperature": 0.0, "max_new_tokens": 4}},
    }
    by_reward = {}
    for name in (None, "arith", f"{__name__}:length_reward", "tool"):
        spec = jobspec.from_dict({**base, "reward": {"name": name, "format_weight": 0.3}})
        workflow, problem, samples = _group(spec, engine, tok)
        assert isinstance(workflow, SingleTurn) and len(samples) == 3
        by_reward[name] = ([s.reward for s in samples], _texts(samples, tok))
    texts = by_reward[None][1]
    assert all(by_reward[name][1] == texts for name in by_reward)  # greedy: the same responses each time
    expected_arith = [arith_score(problem, text, eos, 0.3) for text, eos in texts]
    assert by_reward[None][0] == pytest.approx(expected_arith)  # no name: the arith task's own reward
    assert by_reward["arith"][0] == pytest.approx(expected_arith)
    custom = by_reward[f"{__name__}:length_reward"][0]
    assert custom == [len(text) + 100.0 * eos for text, eos in texts]
    assert custom != by_reward["arith"][0]  # the named reward took effect, not the task's
    assert by_reward["tool"][0] == [0.0, 0.0, 0.0]  # no tool ran in a single-turn job


def test_agent_spec_resolves_to_agent_episodes(tiny_model_dir):
    from model_zoo.tiny_tools import build_tokenizer

    tok = build_tokenizer()  # has a chat template, as agent episodes need
    spec = jobspec.from_dict(
        {"model": {"path": str(tiny_model_dir)}, "agent": {}, "reward": {"name": "tool"}}
    )
    assert isinstance(build_workflow(spec, tok, build_task(spec.dataset)), AgentEpisodes)


def test_spec_refuses_unknown_tasks_and_rewards():
    with pytest.raises(jobspec.JobSpecError, match=r"unknown task 'gsm8k'.*jsonl.*at `\$\.dataset\.name`"):
        jobspec.from_dict({"dataset": {"name": "gsm8k"}})
    with pytest.raises(
        jobspec.JobSpecError, match=r"unknown reward 'exact'.*math_verify.*at `\$\.reward\.name`"
    ):
        jobspec.from_dict({"reward": {"name": "exact"}})
    with pytest.raises(jobspec.JobSpecError, match=r"unknown reward 'a:b:c'"):
        jobspec.from_dict({"reward": {"name": "a:b:c"}})
    # Import paths are checked at submit: the allow-list, the module's source, the name defined there.
    spec = jobspec.from_dict({"reward": {"name": "os:system"}})
    assert "not allowed on this cluster" in check_import_paths(spec.dataset.name, spec.reward.name, [])
    why = check_import_paths("generator_fleet.tasks.arith:NoSuchTask", None, None)
    assert why == "module 'generator_fleet.tasks.arith' defines no 'NoSuchTask' - at `$.dataset.name`"
    assert "cannot find the Python source" in check_import_paths("arith", "no_such_module:f", None)
    assert check_import_paths("generator_fleet.tasks.arith:ArithTask.from_spec", None, None) is None


def test_ignore_eos_gives_every_response_exactly_max_new_tokens(engine, tiny_model_dir):
    """The demo model answers `a+b=` in a few tokens and then ends with EOS; with ignore_eos every sample
    runs to max_new_tokens (finish_reason length), without it some end earlier."""
    tok = load_tokenizer(str(tiny_model_dir))
    lengths = {}
    for ignore in (False, True):
        sampling = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": ignore}
        spec = jobspec.from_dict(
            {"model": {"path": str(tiny_model_dir)}, "rollout": {"group_size": 4, "sampling": sampling}}
        )
        _, _, samples = _group(spec, engine, tok)
        lengths[ignore] = [(len(s.view("response_ids")), s.finish_reason) for s in samples]
    assert lengths[True] == [(24, "length")] * 4
    assert any(n < 24 for n, _ in lengths[False])


def test_ignore_eos_is_refused_with_an_agent(tiny_model_dir):
    with pytest.raises(jobspec.JobSpecError, match="rollout.sampling.ignore_eos"):
        jobspec.from_dict(
            {
                "model": {"path": str(tiny_model_dir)},
                "agent": {},
                "rollout": {"sampling": {"ignore_eos": True}},
            }
        )
