"""The engine core without HTTP: continuous batching, the paged KV cache under pressure (retraction and
re-prefill), pause modes, and the vectorised sampler, all checked against cache-free greedy decoding."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from tiny_engine_model import build_noisy_model, greedy_reference
from tiny_engine_model import greedy_params as greedy

from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer
from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner

CONTEXT = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sched") / "m"
    m, tok = build_noisy_model(path, seed=3)
    return path, m


def runner_for(path, **kw) -> Runner:
    r = Runner(str(path), context_length=CONTEXT, **kw)
    r.start()
    return r


VOCAB = 15
"""Token ids the prompts use (the tiny arithmetic tokenizer has a few more, all specials)."""


def prompts(k: int, seed: int = 0, lo: int = 2, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
        for _ in range(k)
    ]


def test_mixed_lengths_batched_equal_unbatched_reference(model):
    path, m = model
    runner = runner_for(path)
    try:
        ps = prompts(12)
        futs = [runner.submit(Request(f"r{i}", p, greedy(12))) for i, p in enumerate(ps)]
        outs = [f.result(60).output_ids for f in futs]
    finally:
        runner.stop()
    assert outs == [greedy_reference(m, p, 12) for p in ps]


def test_requests_join_and_leave_the_running_batch(model):
    """A short request sent while a long one decodes joins its batch and returns long before it."""
    path, m = model
    runner = runner_for(path)
    try:
        started = threading.Event()
        long_req = Request("long", [5, 6, 7], greedy(400))
        long_req.listener = started.set
        long_fut = runner.submit(long_req)
        assert started.wait(30)
        short = runner.submit(Request("short", [8, 9], greedy(5))).result(30)
        assert not long_fut.done(), "the short request waited for the long one's batch to end"
        assert short.output_ids == greedy_reference(m, [8, 9], 5)
        long_c = long_fut.result(120)
    finally:
        runner.stop()
    assert long_c.output_ids[:20] == greedy_reference(m, [5, 6, 7], 20)
    # one decode step per long-request token after its first: the short one rode along in those steps
    assert runner.stats.num_decode_steps_total == 399


def test_small_kv_pool_retracts_and_regenerates_identically(model):
    """Six requests that need ~6x the pool: the newest are retracted, re-prefilled, and every output
    still equals the reference; finished requests give their blocks back."""
    path, m = model
    runner = runner_for(path, kv_cache_tokens=96, block_size=16)
    try:
        ps = prompts(6, seed=1, lo=10, hi=20)
        futs = [runner.submit(Request(f"r{i}", p, greedy(60))) for i, p in enumerate(ps)]
        outs = [f.result(120) for f in futs]
        snap = runner.snapshot()
    finally:
        runner.stop()
    assert [c.output_ids for c in outs] == [greedy_reference(m, p, 60) for p in ps]
    assert runner.stats.num_retractions_total > 0
    assert sum(c.num_retractions for c in outs) == runner.stats.num_retractions_total
    assert snap["num_used_tokens"] == 0 and snap["num_running_reqs"] == 0


def test_request_larger_than_the_pool_is_aborted_with_a_reason(model):
    path, _ = model
    runner = runner_for(path, kv_cache_tokens=32, block_size=16)
    try:
        c = runner.submit(Request("big", [4 + i % 10 for i in range(40)], greedy(4))).result(30)
        ok = runner.submit(Request("ok", [4, 5], greedy(4))).result(30)
    finally:
        runner.stop()
    assert c.finish_reason["type"] == "abort" and "KV" in c.finish_reason["message"]
    assert ok.finish_reason["type"] == "length"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_modes_keep_every_token_and_version(model, mode):
    """Pause mid-request, change the version, continue: the output equals an uninterrupted run (same
    weights), and the tokens after the pause carry the new version."""
    path, m = model
    runner = runner_for(path)
    try:
        got_tokens = threading.Event()
        req = Request("p", [4, 9, 12], greedy(200))
        req.listener = lambda: len(req.output_ids) >= 5 and got_tokens.set()
        fut = runner.submit(req)
        assert got_tokens.wait(30)
        runner.pause(mode)
        snap = runner.snapshot()
        runner.set_weight_version("v2")
        runner.resume()
        c = fut.result(60)
    finally:
        runner.stop()
    if mode == "retract":
        assert snap["num_running_reqs"] == 0 and snap["num_queue_reqs"] == 1 and snap["num_used_tokens"] == 0
        assert c.num_retractions == 1
    else:
        assert snap["num_running_reqs"] == 1 and snap["num_paused_reqs"] == 1
    assert c.output_ids == greedy_reference(m, [4, 9, 12], 200)
    assert [s["version"] for s in c.weight_versions] == ["0", "v2"]
    assert c.weight_versions[0]["end"] == c.weight_versions[1]["start"] >= 5


def test_pause_abort_returns_partial_outputs_and_frees_the_pool(model):
    path, _ = model
    runner = runner_for(path)
    try:
        got_tokens = threading.Event()
        req = Request("a", [4, 9], greedy(300))
        req.listener = got_tokens.set
        fut = runner.submit(req)
        assert got_tokens.wait(30)
        runner.pause("abort")
        c = fut.result(0)  # pause(abort) returns only after the aborted request has returned
        snap = runner.snapshot()
        runner.resume()
    finally:
        runner.stop()
    assert c.finish_reason["type"] == "abort" and 0 < len(c.output_ids) < 300
    assert snap["num_used_tokens"] == 0


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 0.7, "top_p": 1e-6},
        {"temperature": 1.5, "min_p": 1.0},
    ],
)
def test_truncating_samplers_collapse_to_greedy(model, params):
    """top_k=1, a tiny top_p and min_p=1 leave only the argmax: the batched sampler must agree."""
    path, m = model
    runner = runner_for(path)
    try:
        ps = prompts(4, seed=2)
        sp = SamplingParams(max_new_tokens=10, ignore_eos=True, **params)
        outs = [runner.submit(Request(f"s{i}", p, sp)).result(60).output_ids for i, p in enumerate(ps)]
    finally:
        runner.stop()
    assert outs == [greedy_reference(m, p, 10) for p in ps]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))],
)
def test_sampling_follows_the_temperature_scaled_distribution(model, device):
    """3000 two-token samples at temperature 2 (the second token comes from a decode step: on CUDA the
    graph samples it). Its empirical distribution must match the mixture over the drawn first tokens of
    softmax(logits / 2) (total variation below 0.08; a false alarm is vanishingly unlikely)."""
    path, m = model
    runner = runner_for(path, device=device, dtype=torch.float32)
    prompt = [4, 9, 12]
    try:
        sp = SamplingParams(max_new_tokens=2, temperature=2.0, ignore_eos=True)
        futs = [runner.submit(Request(f"d{i}", prompt, sp)) for i in range(3000)]
        outs = [f.result(120).output_ids for f in futs]
    finally:
        runner.stop()
    with torch.no_grad():
        firsts = sorted({o[0] for o in outs})
        rows = m(torch.tensor([[*prompt, t] for t in firsts])).logits[:, -1]
        cond = dict(zip(firsts, torch.softmax(rows / 2.0, dim=-1), strict=True))
    expected = torch.stack([cond[o[0]] for o in outs]).mean(0)
    freq = torch.bincount(torch.tensor([o[1] for o in outs]), minlength=expected.shape[0]).float() / len(outs)
    assert 0.5 * (freq - expected).abs().sum() < 0.08


def test_pause_retract_over_http(model):
    """/pause_generation {"mode": "retract"} through the client: the running call is parked in the queue
    with its KV freed, and returns complete after /continue_generation."""
    path, m = model
    server = EngineServer(str(path), api_key="k", context_length=CONTEXT).start()

    async def scenario() -> dict:
        async with EngineClient(server.url, api_key="k") as client:
            call = asyncio.create_task(
                client.generate([4, 9, 12], {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True})
            )
            while server.runner.stats.generation_tokens_total < 5:
                await asyncio.sleep(0.005)
            await client.pause("retract")
            state = (await client.server_info())["internal_states"][0]
            await client.continue_generation()
            return state, await call

    try:
        state, result = asyncio.run(scenario())
    finally:
        server.stop()
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 1 and state["num_used_tokens"] == 0
    assert result.output_ids == greedy_reference(m, [4, 9, 12], 300)
