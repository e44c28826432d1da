"""DAPO in the rollout worker, against a real built-in engine and a real Redis: dynamic sampling keeps
uniform-reward groups out of the buffer and gives their admission slots back (capped per step, so a task
whose groups are all uniform still makes progress); overlong shaping penalises long responses and
masks out the ones cut off by the token budget."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest
from prometheus_client import REGISTRY

import jobspec
from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.rollout import RolloutWorker
from generator_fleet.tasks import build_task
from generator_fleet.workflow import build_workflow, overlong_penalty
from models.tokenizers import load_tokenizer
from replay_buffer.keys import JobKeys
from replay_buffer.schema import decode

KEY = "dapo-test-key"
G = 3

_calls = itertools.count()


def alternating_reward(problem, response, format_weight):
    """Even groups (by call order; a group's G calls are made back to back) all score 0.5: uniform. Odd
    groups score each sample differently."""
    n = next(_calls)
    return 0.5 if (n // G) % 2 == 0 else float(n)


def constant_reward(problem, response, format_weight):
    return 1.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    yield server
    server.stop()


def _filtered(reason: str) -> float:
    return REGISTRY.get_sample_value("slipstream_rollout_groups_filtered_total", {"reason": reason}) or 0.0


def _spec(job_id, tiny_model_dir, reward, groups_per_step, **dynamic):
    return jobspec.from_dict(
        {
            "name": job_id,
            "model": {"path": str(tiny_model_dir)},
            "reward": {"name": f"{__name__}:{reward}"},
            "rollout": {
                "group_size": G,
                "concurrency": 1,
                "sampling": {"max_new_tokens": 4},
                "dynamic_sampling": {"enabled": True, **dynamic},
            },
            "algorithm": {"groups_per_step": groups_per_step},
            "buffer": {"max_staleness": 0},
        }
    )


def _run_until(worker: RolloutWorker, produced: int, timeout_s: float = 60.0) -> dict:
    """Run the worker until it has put `produced` groups (fail after timeout_s: a worker whose slots
    were not given back blocks in admission forever)."""

    async def go():
        task = asyncio.create_task(worker.run())
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while getattr(worker, "produced", 0) < produced:
                assert asyncio.get_running_loop().time() < deadline, (
                    f"worker stuck at {getattr(worker, 'produced', 0)} groups, {worker.filtered} filtered"
                )
                assert not task.done(), task.result()
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
        return await task

    return asyncio.run(go())


def _stream(redis_client, job_id):
    return [decode(fields[b"d"]) for _, fields in redis_client.xrange(JobKeys(job_id).groups)]


def test_overlong_penalty_matches_dapo():
    # Lmax 20, buffer 5: no penalty up to 15, then linear to -1 at 20, -1 beyond.
    assert overlong_penalty(0, 20, 5) == 0.0
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(16, 20, 5) == pytest.approx(-0.2)
    assert overlong_penalty(18, 20, 5) == pytest.approx(-0.6)
    assert overlong_penalty(20, 20, 5) == pytest.approx(-1.0)
    assert overlong_penalty(21, 20, 5) == -1.0
    assert overlong_penalty(18, 20, 5, factor=0.5) == pytest.approx(-0.3)
    assert overlong_penalty(1000, 20, 0) == 0.0  # buffer 0: off
    # The buffer spans the whole budget: every token counts.
    assert overlong_penalty(0, 4, 4) == 0.0
    assert overlong_penalty(1, 4, 4) == pytest.approx(-0.25)
    assert overlong_penalty(4, 4, 4) == pytest.approx(-1.0)


def test_spec_bounds():
    spec = jobspec.from_dict({})
    assert not spec.rollout.dynamic_sampling.enabled and not spec.rollout.overlong_filter
    assert spec.reward.overlong_buffer_len == 0
    with pytest.raises(jobspec.JobSpecError, match="overlong_buffer_len"):
        jobspec.from_dict(
            {"reward": {"overlong_buffer_len": 9}, "rollout": {"sampling": {"max_new_tokens": 8}}}
        )
    with pytest.raises(jobspec.JobSpecError, match="max_filtered_per_step"):
        jobspec.from_dict({"rollout": {"dynamic_sampling": {"max_filtered_per_step": 0}}})
    with pytest.raises(jobspec.JobSpecError, match="overlong_penalty_factor"):
        jobspec.from_dict({"reward": {"overlong_penalty_factor": -1}})


def test_uniform_groups_are_filtered_and_their_slots_given_back(
    redis_server, redis_client, tiny_model_dir, engine, job_id
):
    global _calls
    _calls = itertools.count()
    # Admission lets (0 + max_staleness 0 + 1) * 3 = 3 groups through at version 0: the worker gets to 3
    # kept groups only if every filtered group's slot came back.
    spec = _spec(job_id, tiny_model_dir, "alternating_reward", groups_per_step=3)
    before = _filtered("uniform")
    worker = RolloutWorker(spec.rollout_config(), redis_server.url, [engine.url], KEY)
    result = _run_until(worker, produced=3)
    assert result["groups"] == 3 and result["filtered"] == 3  # groups 0, 2, 4 were uniform
    assert _filtered("uniform") - before == result["filtered"]
    groups = _stream(redis_client, job_id)
    assert len(groups) == 3
    for g in groups:  # only the groups with signal reached the buffer
        rewards = [s.reward for s in g.samples]
        assert len(set(rewards)) == G, rewards
    assert int(redis_client.get(JobKeys(job_id).started)) == 3  # the filtered groups' slots were returned


def test_cap_keeps_uniform_groups_and_warns_once(
    redis_server, redis_client, tiny_model_dir, engine, job_id, caplog
):
    spec = _spec(job_id, tiny_model_dir, "constant_reward", groups_per_step=2, max_filtered_per_step=2)
    before = _filtered("uniform")
    worker = RolloutWorker(spec.rollout_config(), redis_server.url, [engine.url], KEY)
    with caplog.at_level(logging.DEBUG, logger="generator_fleet.rollout"):
        result = _run_until(worker, produced=2)
    # Every group is uniform: 2 filtered at version 0, then kept, so the worker still fills its step.
    assert result == {"groups": 2, "filtered": 2}
    assert _filtered("uniform") - before == 2
    groups = _stream(redis_client, job_id)
    assert len(groups) == 2 and all(s.reward == 1.0 for g in groups for s in g.samples)
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "max_filtered_per_step" in r.message
    ]
    assert len(warnings) == 1
    assert sum("filtered (uniform)" in r.message for r in caplog.records if r.levelno == logging.DEBUG) == 2


def _group(spec, engine, tok):
    task = build_task(spec.dataset)
    workflow = build_workflow(spec.rollout_config(), tok, task)

    async def run():
        client = EngineClient(engine.url, api_key=KEY)
        try:

            async def generate(ids, params):
                return await client.generate_batch(ids, params, return_logprob=True)

            return await workflow.run(task.problems[0], generate, lambda: False)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_overlong_filter_and_penalty(engine, tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    base = {
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"group_size": 4, "sampling": {"temperature": 0.0, "max_new_tokens": 3}},
    }
    plain = _group(jobspec.from_dict(base), engine, tok)
    shaped = _group(
        jobspec.from_dict(
            {
                **base,
                "rollout": {**base["rollout"], "overlong_filter": True},
                "reward": {"overlong_buffer_len": 2, "overlong_penalty_factor": 0.5},
            }
        ),
        engine,
        tok,
    )
    assert any(s.finish_reason == "length" for s in plain)  # 3 tokens are too few for the untrained model
    for p, s in zip(plain, shaped, strict=True):
        assert s.view("response_ids").tolist() == p.view("response_ids").tolist()  # greedy: same responses
        assert s.reward == pytest.approx(p.reward + overlong_penalty(len(s), 3, 2, 0.5))
        assert p.view("loss_mask").all()
        if s.finish_reason == "length":
            assert len(s) == 3 and s.reward == pytest.approx(p.reward - 0.5)
            assert not s.view("loss_mask").any()
            assert not s.view("behavior_logprobs").any() and (s.view("token_versions") == -1).all()
        else:
            assert s.view("loss_mask").all()


def test_group_without_trainable_tokens_is_dropped(
    redis_server, redis_client, tiny_model_dir, engine, job_id
):
    spec = jobspec.from_dict(
        {
            "name": job_id,
            "model": {"path": str(tiny_model_dir)},
            "rollout": {
                "group_size": 2,
                "concurrency": 1,
                "sampling": {"max_new_tokens": 1},
                "overlong_filter": True,
            },
            "algorithm": {"groups_per_step": 1},
            "buffer": {"max_staleness": 0},
        }
    )
    before = _filtered("overlong")
    worker = RolloutWorker(spec.rollout_config(), redis_server.url, [engine.url], KEY)

    async def go():
        task = asyncio.create_task(worker.run())
        deadline = asyncio.get_running_loop().time() + 60
        while getattr(worker, "filtered", 0) < 2:
            assert asyncio.get_running_loop().time() < deadline and not task.done()
            await asyncio.sleep(0.05)
        worker.stop()
        return await task

    result = asyncio.run(go())
    # One token rarely is EOS: most groups are all `length`, masked out, dropped, their slots given back.
    assert result["filtered"] >= 2 and _filtered("overlong") - before == result["filtered"]
    for g in _stream(redis_client, job_id):
        assert any(s.view("loss_mask").any() for s in g.samples)
