"""Evaluation during training: the held-out split (disjoint, deterministic, kept out of rollouts), the
accuracy and pass@k math against hand-computed values, the spec's checks, the engine's priority queue, and
the evaluator against a real built-in engine and Redis, checked against greedy decoding of the same model."""

from __future__ import annotations

import asyncio
import json
import random

import http_calls
import msgspec
import pytest
import torch
from tiny_engine_model import build_noisy_model
from transformers import AutoModelForCausalLM

import jobspec
from generator_fleet.client import GenerateResult
from generator_fleet.engine import EngineServer
from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner
from generator_fleet.evaluation import (
    Evaluator,
    eval_set,
    one_version,
    pass_at_k,
    response_of,
    scores,
    split_heldout,
    training_task,
)
from generator_fleet.rollout import RolloutWorker
from generator_fleet.tasks.arith import ArithTask
from generator_fleet.tasks.problem import Problem
from models.tokenizers import load_tokenizer
from replay_buffer.keys import JobKeys
from replay_buffer.schema import decode

KEY = "eval-test-key"
MAX_NEW = 4


def shares_a_digit(problem, response, format_weight):
    """1.0 when the answer holds a digit of the sum: the noisy tiny model gets some right, some not."""
    return 1.0 if set(str(problem.answer)) & set(response.text) else 0.0


# --- the split -----------------------------------------------------------------------------------------
def test_split_is_disjoint_deterministic_and_order_free():
    problems = ArithTask(max_operand=9).problems
    train, held = split_heldout(problems, 20, seed=3)
    assert len(held) == 20 and len(train) == len(problems) - 20
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held}
    assert {p.prompt_id for p in train} | {p.prompt_id for p in held} == {p.prompt_id for p in problems}
    shuffled = list(problems)
    random.Random(1).shuffle(shuffled)
    assert split_heldout(shuffled, 20, seed=3)[1] == held  # the same set, in the same order
    assert [p.prompt_id for p in train] == [p.prompt_id for p in problems if p not in held]  # order kept
    assert {p.prompt_id for p in split_heldout(problems, 20, seed=4)[1]} != {p.prompt_id for p in held}
    with pytest.raises(ValueError, match=r"\$\.eval\.heldout"):
        split_heldout(problems, len(problems), seed=0)


def test_training_task_drops_the_heldout_problems():
    spec = jobspec.from_dict({"dataset": {"max_operand": 9}, "eval": {"heldout": 30}})
    task = training_task(ArithTask(max_operand=9), spec.eval)
    _, held = eval_set(spec.eval_config())
    assert len(task.problems) == 100 - 30 and len(held) == 30
    assert not {p.prompt_id for p in task.problems} & {p.prompt_id for p in held}
    rng = random.Random(0)
    assert all(task.sample(rng).prompt_id not in {p.prompt_id for p in held} for _ in range(500))


def test_eval_set_is_capped_by_max_samples():
    spec = jobspec.from_dict({"eval": {"heldout": 50, "k": 4, "max_samples": 22}})
    assert spec.eval.per_problem == 5
    assert len(eval_set(spec.eval_config())[1]) == 4  # 22 // (greedy 1 + n 4)


# --- the math ------------------------------------------------------------------------------------------
def test_pass_at_k_unbiased_estimator_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(3, 2, 2) == 1.0  # fewer wrong samples than k: every draw holds a right one
    assert pass_at_k(4, 4, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 0, 3)


def test_scores_by_hand():
    out = scores([1.0, 0.1, 1.0, 0.0], [[1, 0, 0, 0], [0, 0, 0, 0]], k=2, correct=1.0)
    assert out["accuracy"] == 0.5
    assert out["greedy_reward"] == pytest.approx(0.525)
    assert out["pass@2"] == pytest.approx((1 - 3 / 6 + 0.0) / 2)  # problem 1: 1 - C(3,2)/C(4,2)
    assert scores(None, [[0.5, 0.9]], k=1, correct=0.9) == {"pass@1": 0.5}
    assert scores([0.2], None, k=0, correct=1.0) == {"accuracy": 0.0, "greedy_reward": 0.2}


def test_one_version_of_an_answer():
    def res(versions, v="7"):
        return GenerateResult(
            output_ids=[1] * len(versions),
            output_logprobs=[],
            finish_reason="stop",
            token_versions=versions,
            weight_version=v,
            prompt_tokens=1,
        )

    assert one_version(res([3, 3, 3])) == 3
    assert one_version(res([3, 4])) is None  # a weight update landed mid-answer
    assert one_version(res([], v="5")) == 5


# --- the spec ------------------------------------------------------------------------------------------
def test_spec_checks_name_the_key():
    with pytest.raises(jobspec.JobSpecError, match=r"temperature > 0 - at `\$\.eval\.temperature`"):
        jobspec.from_dict({"eval": {"k": 4, "temperature": 0.0}})
    with pytest.raises(jobspec.JobSpecError, match=r"none of the dataset's 400 .* `\$\.eval\.heldout`"):
        jobspec.from_dict({"eval": {"heldout": 400}})
    with pytest.raises(jobspec.JobSpecError, match=r"`\$\.eval\.samples_per_problem`"):
        jobspec.from_dict({"eval": {"k": 4, "samples_per_problem": 2}})
    with pytest.raises(jobspec.JobSpecError, match=r"`\$\.eval\.max_samples`"):
        jobspec.from_dict({"eval": {"k": 8, "max_samples": 4}})
    with pytest.raises(jobspec.JobSpecError, match=r"`\$\.eval\.heldout`"):
        jobspec.from_dict({"eval": {"heldout": 3, "dataset": {"name": "arith"}}})
    with pytest.raises(jobspec.JobSpecError, match=r"`\$\.eval\.every`"):
        jobspec.from_dict({"eval": {"every": 0}})
    from generator_fleet.tasks import check_import_paths
    from jobspec.spec import eval_task

    custom = jobspec.from_dict({"eval": {"heldout": 0, "dataset": {"name": "no_such_pkg.tasks:build"}}})
    why = check_import_paths("arith", None, None, eval_dataset_name=eval_task(custom))
    assert why is not None and why.endswith("- at `$.eval.dataset.name`")
    spec = jobspec.from_dict({"eval": {"k": 4, "samples_per_problem": 8}})
    assert spec.eval.n == 8 and spec.eval_config().max_new_tokens == spec.rollout.sampling.max_new_tokens
    assert jobspec.from_dict({}).eval is None and jobspec.from_dict({}).eval_config() is None


# --- the engine's priority queue -------------------------------------------------------------------------
def test_engine_serves_higher_priority_first(tiny_model_dir):
    runner = Runner(str(tiny_model_dir), max_batch_size=1)
    runner.start()
    order: list[str] = []
    try:
        runner.pause("in_place")  # queue everything first, then let the scheduler pick
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        futs = []
        for rid, prio in [("eval-0", -1), ("roll-0", 0), ("eval-1", -1), ("roll-1", 0), ("roll-2", 0)]:
            f = runner.submit(Request(rid, [3, 4, 5], params, priority=prio))
            f.add_done_callback(lambda f: order.append(f.result().rid))
            futs.append(f)
        runner.resume()
        for f in futs:
            f.result(60)
    finally:
        runner.stop()
    assert order == ["roll-0", "roll-1", "roll-2", "eval-0", "eval-1"]


# --- against a real engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def noisy_model_dir(tmp_path_factory):
    """Large random weights: greedy answers differ from problem to problem (an untrained one echoes)."""
    path = tmp_path_factory.mktemp("eval") / "m"
    build_noisy_model(path, seed=5)
    return path


@pytest.fixture(scope="module")
def engine(noisy_model_dir):
    server = EngineServer(str(noisy_model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def _greedy_rewards(model_dir, problems: list[Problem]) -> list[float]:
    """The oracle: cache-free greedy decoding of the same weights, stopped at EOS, scored alike."""
    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for p in problems:
        ids = [tok.bos_token_id, *tok.encode(p.prompt)]
        gen: list[int] = []
        with torch.no_grad():
            while len(gen) < MAX_NEW:
                gen.append(int(model(torch.tensor([ids + gen])).logits[0, -1].argmax()))
                if gen[-1] == tok.eos_token_id:
                    break
        finish = "stop" if gen[-1] == tok.eos_token_id else "length"
        out.append(shares_a_digit(p, response_of(tok, gen, finish), 0.0))
    return out


def _eval_spec(job_id, model_dir, **ev):
    return jobspec.from_dict(
        {
            "name": job_id,
            "model": {"path": str(model_dir)},
            "reward": {"name": f"{__name__}:shares_a_digit"},
            "rollout": {"sampling": {"max_new_tokens": MAX_NEW}},
            "algorithm": {"total_steps": 5},
            "eval": {"heldout": 24, "seed": 1, **ev},
        }
    )


def _evaluate(evaluator: Evaluator, calls: int = 1) -> list[dict | None]:
    async def go():
        task = asyncio.create_task(evaluator.run())
        try:
            return [await evaluator.evaluate_now(120) for _ in range(calls)]
        finally:
            evaluator.stop()
            await task

    return asyncio.run(go())


def test_evaluator_scores_match_greedy_decoding(noisy_model_dir, engine, redis_server, redis_client, job_id):
    # temperature 1e-4 (not greedy to the engine, but argmax in effect): every sample equals the greedy
    # answer, so pass@k per problem is exactly that answer's correctness
    spec = _eval_spec(job_id, noisy_model_dir, k=2, samples_per_problem=3, temperature=1e-4)
    cfg = spec.eval_config()
    _, problems = eval_set(cfg)
    expected = _greedy_rewards(noisy_model_dir, problems)
    accuracy = sum(expected) / len(expected)
    assert 0.0 < accuracy < 1.0, "the check needs a mix of right and wrong answers"

    (rec,) = _evaluate(Evaluator(cfg, redis_server.url, [engine.url], KEY))
    assert rec["kind"] == "eval" and rec["version"] == 0
    res = rec["eval"]
    assert res["accuracy"] == pytest.approx(accuracy)
    assert res["greedy_reward"] == pytest.approx(accuracy)
    assert res["pass@2"] == pytest.approx(accuracy)
    assert res["problems"] == len(problems) == 24 and res["samples"] == 24 * 4
    assert res["redone"] == 0 and res["duration_s"] > 0
    # the record is in the job's progress stream, and nothing went to its buffer
    (stored,) = [json.loads(f[b"j"]) for _, f in redis_client.xrange(JobKeys(job_id).progress)]
    assert stored["kind"] == "eval" and stored["eval"]["accuracy"] == res["accuracy"]
    assert redis_client.xlen(JobKeys(job_id).groups) == 0


def test_evaluator_evaluates_the_engines_version_once(
    noisy_model_dir, engine, redis_server, redis_client, job_id
):
    from generator_fleet.client import EngineClient

    async def set_version(v):
        async with EngineClient(engine.url, api_key=KEY) as c:
            await c.update_weight_version(v)

    asyncio.run(set_version(3))
    try:
        spec = _eval_spec(job_id, noisy_model_dir, heldout=8)
        first, again = _evaluate(Evaluator(spec.eval_config(), redis_server.url, [engine.url], KEY), calls=2)
    finally:
        asyncio.run(set_version(0))
    assert first["version"] == 3 and again == first  # asked again at the same version: the same record
    assert redis_client.xlen(JobKeys(job_id).progress) == 1


_bump = {}
"""The engine whose weight version `bumps_the_version` moves, and whether it did already."""


def bumps_the_version(problem, response, format_weight):
    """shares_a_digit, and on its first call the engine's weight version moves to 7: as if a weight
    update landed while the evaluation ran."""
    if not _bump.get("done"):
        _bump["done"] = True
        http_calls.post(
            f"{_bump['url']}/update_weight_version",
            json={"new_version": "7"},
            headers={"Authorization": f"Bearer {KEY}"},
        ).raise_for_status()
    return shares_a_digit(problem, response, format_weight)


def _bumped_evaluation(job_id, model_dir, engine, redis_server, monkeypatch, **ev) -> tuple[dict, object]:
    """An evaluation during which the engine's weight version moves from 0 to 7 after the first answer."""
    from generator_fleet import evaluation
    from generator_fleet.client import EngineClient

    # one answer at a time: the first is generated at version 0, every later one after the bump
    monkeypatch.setattr(evaluation, "IN_FLIGHT", 1)
    spec = _eval_spec(job_id, model_dir, heldout=6, **ev)
    spec = jobspec.from_dict(
        {**msgspec.to_builtins(spec), "reward": {"name": f"{__name__}:bumps_the_version"}}
    )
    _bump.clear()
    _bump["url"] = engine.url
    try:
        (rec,) = _evaluate(Evaluator(spec.eval_config(), redis_server.url, [engine.url], KEY))
    finally:

        async def reset():
            async with EngineClient(engine.url, api_key=KEY) as c:
                await c.update_weight_version(0)

        asyncio.run(reset())
    return rec, spec


def test_by_default_an_evaluation_keeps_answers_of_later_versions(
    noisy_model_dir, engine, redis_server, redis_client, job_id, monkeypatch
):
    """A trainer that publishes faster than an evaluation runs must still get evaluations: the record is
    at the version the evaluation started at and names the newest version among its answers."""
    rec, spec = _bumped_evaluation(job_id, noisy_model_dir, engine, redis_server, monkeypatch)
    assert _bump["done"] and rec["version"] == 0 and rec["version_max"] == 7
    assert rec["eval"]["redone"] == 0
    _, problems = eval_set(spec.eval_config())
    expected = _greedy_rewards(noisy_model_dir, problems)
    assert rec["eval"]["accuracy"] == pytest.approx(sum(expected) / len(expected))


def test_evaluation_follows_the_weights_to_one_version(
    noisy_model_dir, engine, redis_server, redis_client, job_id, monkeypatch
):
    rec, spec = _bumped_evaluation(
        job_id, noisy_model_dir, engine, redis_server, monkeypatch, max_version_spread=0
    )
    # answers from version 0 were asked again: the record is of version 7 alone (same weights, same scores)
    assert _bump["done"] and rec["version"] == 7 and rec["version_max"] == 7
    assert rec["eval"]["redone"] == 1
    _, problems = eval_set(spec.eval_config())
    expected = _greedy_rewards(noisy_model_dir, problems)
    assert rec["eval"]["accuracy"] == pytest.approx(sum(expected) / len(expected))


def test_a_failed_evaluation_is_logged_and_the_evaluator_goes_on(
    noisy_model_dir, redis_server, redis_client, job_id, caplog
):
    from prometheus_client import REGISTRY

    def failed() -> float:
        return REGISTRY.get_sample_value("slipstream_eval_rounds_total", {"outcome": "failed"}) or 0.0

    before = failed()
    redis_client.set(JobKeys(job_id).version, 0)  # no engine answers: the trainer's version is the one due
    dead = "http://127.0.0.1:9"  # nothing listens there
    spec = _eval_spec(job_id, noisy_model_dir, heldout=4)
    evaluator = Evaluator(spec.eval_config(), redis_server.url, [dead], KEY)

    async def go():
        task = asyncio.create_task(evaluator.run())
        try:
            first = await evaluator.evaluate_now(60)
            redis_client.set(JobKeys(job_id).version, 1)
            second = await evaluator.evaluate_now(60)
            assert not task.done()  # still running: a failure never ends the evaluator
            return first, second
        finally:
            evaluator.stop()
            await task

    with caplog.at_level("ERROR", logger="generator_fleet.evaluation"):
        first, second = asyncio.run(go())
    assert first is None and second is None
    assert evaluator.failed == {0, 1} and failed() - before == 2
    assert "evaluation at version 0 failed" in caplog.text and "evaluation at version 1 failed" in caplog.text
    assert redis_client.xlen(JobKeys(job_id).progress) == 0


def test_rollouts_never_sample_heldout_problems(noisy_model_dir, engine, redis_server, redis_client, job_id):
    # 300 of the 400 problems held out: a worker sampling all 400 would hit one in 12 groups almost surely
    spec = jobspec.from_dict(
        {
            "name": job_id,
            "model": {"path": str(noisy_model_dir)},
            "rollout": {"group_size": 2, "concurrency": 4, "sampling": {"max_new_tokens": 2}},
            "algorithm": {"groups_per_step": 12},
            "buffer": {"max_staleness": 0},
            "eval": {"heldout": 300},
        }
    )
    held = {p.prompt_id for p in eval_set(spec.eval_config())[1]}
    assert len(held) == 300
    worker = RolloutWorker(spec.rollout_config(), redis_server.url, [engine.url], KEY)

    async def go():
        task = asyncio.create_task(worker.run())
        try:
            while redis_client.xlen(JobKeys(job_id).groups) < 12:
                assert not task.done(), task.result()
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
        await task

    asyncio.run(asyncio.wait_for(go(), 120))
    groups = [decode(f[b"d"]) for _, f in redis_client.xrange(JobKeys(job_id).groups)]
    assert len(groups) >= 12
    assert not {g.prompt_id for g in groups} & held
