"""Evaluation of agent jobs against a real engine: each eval answer is an episode of the job's own workflow
(tools, parser, budgets), against a real built-in engine serving the warmed-up tiny tool model, a real
calculator and Redis. The oracle is the rollout workflow itself run greedily on the same problems; an
episode whose turns span weight versions is redone. Slow: they need the tool model's SFT warm-up, shared
with the tool job test."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest
from prometheus_client import REGISTRY

import jobspec
from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.evaluation import Evaluator, eval_set
from generator_fleet.tasks import build_task
from generator_fleet.tools.calculator import Calculator
from generator_fleet.workflow import AgentEpisodes, build_workflow
from models.tokenizers import load_tokenizer
from replay_buffer.keys import JobKeys

KEY = "agent-eval-test-key"
HELDOUT = 12


def shares_a_digit(problem, response, format_weight):
    """1.0 when the episode's final answer holds a digit of the gold answer: the briefly warmed-up tool
    model gets some right and some not (math_verify would score all of its answers wrong)."""
    return 1.0 if set(str(problem.answer)) & set(response.text) else 0.0


def _spec(job_id, model_dir, tools=None, **ev):
    return jobspec.from_dict(
        {
            "name": job_id,
            "model": {"path": str(model_dir)},
            "dataset": {"name": "word_problems", "num_problems": 200, "difficulty": "easy"},
            "reward": {"name": f"{__name__}:shares_a_digit"},
            "agent": {"max_turns": 3, "max_total_tokens": 200, "tool_timeout_s": 5},
            "tools": tools or [{"name": "calculator"}],
            "rollout": {"group_size": 2, "sampling": {"temperature": 1.0, "max_new_tokens": 120}},
            "algorithm": {"total_steps": 5},
            "eval": {"heldout": HELDOUT, "seed": 2, **ev},
        }
    )


@pytest.fixture(scope="module")
def engine(tools_model_dir):
    server = EngineServer(str(tools_model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oracle(tools_model_dir, engine):
    """(reward, tool calls, turns) of each held-out problem's greedy episode, from the rollout workflow the
    job's spec builds (temperature 0, the job's tools and budgets) over a plain client."""
    spec = _spec("oracle", tools_model_dir)
    greedy = msgspec.structs.replace(
        spec.rollout, sampling=msgspec.structs.replace(spec.rollout.sampling, temperature=0.0)
    )
    cfg = msgspec.structs.replace(spec.rollout_config(), rollout=greedy)
    tok = load_tokenizer(str(tools_model_dir))
    workflow = build_workflow(cfg, tok, build_task(cfg.dataset))
    assert isinstance(workflow, AgentEpisodes)
    _, problems = eval_set(spec.eval_config())

    async def run():
        async with EngineClient(engine.url, api_key=KEY) as client:

            async def generate(ids, params):
                return await client.generate_batch(ids, params, return_logprob=True)

            return [await workflow.run(p, generate, lambda: False) for p in problems]

    out = []
    for group in asyncio.run(run()):
        first = group[0]
        assert all(s.reward == first.reward for s in group)  # greedy: both episodes alike
        out.append((first.reward, first.tool_calls, first.num_turns))
    return out


def _evaluate(evaluator: Evaluator) -> dict | None:
    async def go():
        task = asyncio.create_task(evaluator.run())
        try:
            return await evaluator.evaluate_now(300)
        finally:
            evaluator.stop()
            await task

    return asyncio.run(go())


def _tokens_generated() -> float:
    return REGISTRY.get_sample_value("slipstream_rollout_generated_tokens_total") or 0.0


def test_agent_evaluation_equals_the_workflow_run_greedily(
    tools_model_dir, engine, oracle, redis_server, redis_client, job_id
):
    rewards = [r for r, _, _ in oracle]
    accuracy = sum(r >= 1.0 for r in rewards) / len(rewards)
    assert 0.0 < accuracy < 1.0, f"the check needs right and wrong answers: {oracle}"
    assert any(calls for _, calls, _ in oracle), "the check needs episodes that call the calculator"

    # temperature 1e-4 (not greedy to the engine, argmax in effect): each sample repeats the greedy episode
    spec = _spec(job_id, tools_model_dir, k=2, samples_per_problem=3, temperature=1e-4)
    before = _tokens_generated()
    rec = _evaluate(Evaluator(spec.eval_config(), redis_server.url, [engine.url], KEY))
    assert rec is not None and rec["kind"] == "eval" and rec["version"] == 0
    res = rec["eval"]
    assert res["problems"] == HELDOUT and res["samples"] == HELDOUT * 4 and res["redone"] == 0
    assert res["accuracy"] == pytest.approx(accuracy)
    assert res["greedy_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert res["pass@2"] == pytest.approx(accuracy)
    assert res["tool_calls_mean"] == pytest.approx(sum(c for _, c, _ in oracle) / len(oracle))
    assert res["turns_mean"] == pytest.approx(sum(t for _, _, t in oracle) / len(oracle))
    # in the progress stream, never in the buffer, and not counted as rollout tokens
    (stored,) = [json.loads(f[b"j"]) for _, f in redis_client.xrange(JobKeys(job_id).progress)]
    assert stored["eval"]["tool_calls_mean"] == res["tool_calls_mean"]
    assert redis_client.xlen(JobKeys(job_id).groups) == 0
    assert _tokens_generated() == before
    assert REGISTRY.get_sample_value("slipstream_eval_episode_mean", {"stat": "turns"}) == res["turns_mean"]


_bump: dict = {}
"""The engine whose version `BumpingCalculator` moves, and whether it did already."""


class BumpingCalculator(Calculator):
    """The calculator; its first call moves the engine's weight version to 7, as if a weight update landed
    between the turns of the episode that called it."""

    async def call(self, arguments, ctx):
        if not _bump.get("done"):
            _bump["done"] = True
            async with httpx.AsyncClient() as c:
                r = await c.post(
                    f"{_bump['url']}/update_weight_version",
                    json={"new_version": "7"},
                    headers={"Authorization": f"Bearer {KEY}"},
                )
                r.raise_for_status()
        return await super().call(arguments, ctx)


def test_an_episode_whose_turns_span_versions_is_redone(
    tools_model_dir, engine, oracle, redis_server, job_id, monkeypatch
):
    from generator_fleet import evaluation

    # one episode at a time, in problem order: those before the first tool call run at version 0, the one
    # calling it spans versions 0 and 7, every later one runs at 7
    monkeypatch.setattr(evaluation, "IN_FLIGHT", 1)
    first_call = next(i for i, (_, calls, _) in enumerate(oracle) if calls)
    tools = [{"name": "calculator", "impl": f"{__name__}:BumpingCalculator"}]
    spec = _spec(job_id, tools_model_dir, tools=tools, max_version_spread=0)  # one version per record
    _bump.clear()
    _bump["url"] = engine.url
    try:
        rec = _evaluate(Evaluator(spec.eval_config(), redis_server.url, [engine.url], KEY))
    finally:

        async def reset():
            async with EngineClient(engine.url, api_key=KEY) as c:
                await c.update_weight_version(0)

        asyncio.run(reset())
    assert _bump["done"] and rec is not None and rec["version"] == 7
    # the episodes kept at version 0 moved on with the weights, and the spanning one was asked again
    assert rec["eval"]["redone"] == first_call + 1
    rewards = [r for r, _, _ in oracle]
    assert rec["eval"]["accuracy"] == pytest.approx(sum(r >= 1.0 for r in rewards) / len(rewards))
    assert rec["eval"]["tool_calls_mean"] == pytest.approx(sum(c for _, c, _ in oracle) / len(oracle))
