"""The engine's prefix cache with its generation thread running for real (CPU, tiny model): the next turn of
an episode (the previous prompt, its response and a tool's output) prefills only its new tokens and
generates what a cold engine generates; a weight update empties the cache; a pool too small for the work
evicts the cache first and loses no block; prompt logprobs asked for are still computed."""

from __future__ import annotations

import copy

import http_calls
import pytest
from tiny_engine_model import build_noisy_model, greedy_reference
from tiny_engine_model import greedy_params as greedy

from generator_fleet.engine.request import Request
from generator_fleet.engine.runner import Runner

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix") / "m"
    m, _ = build_noisy_model(path, seed=9)
    return path, m


@pytest.fixture
def runner(model):
    r = Runner(str(model[0]), context_length=512, max_batch_size=16, block_size=BS)
    r.start()
    yield r
    r.stop()


def ask(runner: Runner, rid: str, prompt: list[int], n: int, **kw):
    return runner.submit(Request(rid, prompt, greedy(n), return_logprob=True, **kw)).result(120)


def idle_accounted(runner: Runner) -> None:
    """Idle: every block is free or in the prefix cache."""
    px, cache = runner.prefix, runner.cache
    assert cache.free_blocks + px.cached_blocks == cache.capacity_blocks
    assert px.evictable == px.cached_blocks


def test_the_next_turn_prefills_only_its_new_tokens_and_generates_the_same(model, runner):
    path, m = model
    prompt = [3 + i % 11 for i in range(21)]
    first = ask(runner, "t1", prompt, 20)
    turn2 = prompt + first.output_ids + [5, 6, 7, 8, 9]  # the response, then a tool's output
    second = ask(runner, "t2", turn2, 12)
    kv_len = len(prompt) + 20 - 1  # the last sampled token was never fed
    assert runner.stats.prefix_cached_tokens_total == kv_len // BS * BS
    assert second.output_ids == greedy_reference(m, turn2, 12)
    cold = Runner(str(path), context_length=512, max_batch_size=16, block_size=BS, prefix_cache=False)
    cold.start()
    try:
        want = cold.submit(Request("c", turn2, greedy(12), return_logprob=True)).result(120)
    finally:
        cold.stop()
    assert cold.prefix is None and cold.stats.prefix_cached_tokens_total == 0
    assert second.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
    idle_accounted(runner)


def test_a_weight_update_empties_the_cache(model, runner):
    path, m = model
    prompt = [4 + i % 7 for i in range(40)]
    first = ask(runner, "a", prompt, 4)
    # other weights: the cached K/V would now be wrong
    named = [(n, t * 0.5 if "mlp" in n else t.clone()) for n, t in m.state_dict().items()]
    runner.load_weights(named, weight_version="1")
    m2 = copy.deepcopy(m)
    m2.load_state_dict(dict(named))
    assert runner.prefix.cached_blocks == 0 and runner.cache.free_blocks == runner.cache.capacity_blocks
    cached = runner.stats.prefix_cached_tokens_total
    again = ask(runner, "b", prompt + first.output_ids, 4)
    assert runner.stats.prefix_cached_tokens_total == cached  # nothing from before the update
    assert again.weight_version == "1"
    assert again.output_ids == greedy_reference(m2, prompt + first.output_ids, 4)
    idle_accounted(runner)


def test_a_small_pool_evicts_the_cache_first_and_loses_no_block(model):
    """Episodes of three turns each on a pool of a few sequences: the cache gives way (evictions), the
    outputs equal the reference and, idle, every block is free or cached."""
    path, m = model
    runner = Runner(str(path), context_length=512, max_batch_size=8, block_size=BS, kv_cache_tokens=12 * BS)
    runner.start()
    try:
        episodes = [[3 + (i * 5 + j) % 10 for j in range(18 + i)] for i in range(6)]
        for turn in range(3):
            futs = [runner.submit(Request(f"e{i}-{turn}", p, greedy(10))) for i, p in enumerate(episodes)]
            outs = [f.result(120).output_ids for f in futs]
            for i, (p, o) in enumerate(zip(episodes, outs, strict=True)):
                assert o == greedy_reference(m, p, 10), (i, turn)
                episodes[i] = p + o + [4, 4]
        assert runner.stats.prefix_cached_tokens_total > 0
        assert runner.prefix.evicted_blocks_total > 0
        idle_accounted(runner)
    finally:
        runner.stop()


def test_prompt_logprobs_asked_for_are_computed_not_taken_from_the_cache(model, runner):
    prompt = [5 + i % 9 for i in range(40)]
    ask(runner, "w", prompt, 2)
    start = 30
    got = ask(runner, "l", prompt + [7, 7], 1, logprob_start_len=start)
    cached = runner.stats.prefix_cached_tokens_total
    assert 0 < cached <= start - 1  # the blocks before the first logprob asked for
    runner.prefix.flush()
    cold = ask(runner, "l2", prompt + [7, 7], 1, logprob_start_len=start)
    assert runner.stats.prefix_cached_tokens_total == cached
    assert len(got.input_logprobs) == len(prompt) + 2 - start
    assert got.input_logprobs == pytest.approx(cold.input_logprobs, abs=1e-4)


def test_an_episode_over_http_hits_the_cache_and_metrics_say_so(model):
    """What a rollout worker does: /generate a turn, then the next with the response and a tool's output
    appended; meta_info.cached_tokens and /metrics count the prompt tokens the cache served, /metrics the
    tokens it holds; /flush_cache empties it."""
    from prometheus_client.parser import text_string_to_metric_families

    from generator_fleet.engine import EngineServer

    key = "prefix-cache-key"
    server = EngineServer(str(model[0]), api_key=key, context_length=512).start()
    headers = {"Authorization": f"Bearer {key}"}
    try:

        def generate(ids: list[int], cached: int) -> list[int]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            r = http_calls.post(server.url + "/generate", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["cached_tokens"] == cached
            return r.json()["output_ids"]

        prompt = [3 + i % 10 for i in range(40)]
        ids = prompt + generate(prompt, cached=0) + [4, 5, 6]
        generate(ids, cached=32)
        text = http_calls.get(server.url + "/metrics", headers=headers, timeout=10).text
        r = http_calls.post(server.url + "/flush_cache", headers=headers, timeout=10)
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        generate(ids, cached=0)  # computed again: the flush emptied the cache
    finally:
        server.stop()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["slipstream_engine_prefix_cached_tokens_total"] == 32  # two full blocks of the first turn
    assert got["slipstream_engine_prefix_cache_tokens"] >= 32
    assert got["slipstream_engine_prefix_evicted_tokens_total"] == 0


def test_flush_cache_waits_for_no_request_to_be_resident(model):
    """SGLang's rule: /flush_cache does nothing (400) while a request is running or queued."""
    r = Runner(str(model[0]), context_length=512, max_batch_size=16, block_size=BS)
    try:
        fut = r.submit(Request("queued", [3 + i % 10 for i in range(40)], greedy(4)))  # not started: queued
        assert not r.flush_cache()
        r.start()
        fut.result(120)
        assert r.prefix.cached_blocks == 2
        assert r.flush_cache()
        assert r.prefix.cached_blocks == 0 and r.cache.free_blocks == r.cache.capacity_blocks
    finally:
        r.stop()
