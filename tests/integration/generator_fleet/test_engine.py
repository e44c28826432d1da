"""The built-in engine over real HTTP: SGLang's /generate contract, pause/abort, weight updates over a real
gloo group, and the EngineClient that rollout workers use against it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import http_calls
import httpx
import msgspec
import pytest
import torch
from metrics_text import sample
from oracles import response_logprobs
from tiny_engine_model import build_noisy_model, greedy_reference

from generator_fleet.client import EngineClient, EngineError
from generator_fleet.engine import EngineServer
from weight_bus.group import broadcast, dtype_name, new_group

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The tiny model's config says 64 positions; its RoPE works past that, and the long requests that pause
# tests interrupt need room to still be running when the pause lands.
CONTEXT_LENGTH = 4096
LONG = 3000
"""max_new_tokens of a request that is still running when the test interrupts it."""
DEADLINE_S = 30.0


class Models(msgspec.Struct):
    path_a: Path
    path_b: Path
    model_a: torch.nn.Module
    model_b: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("models")
    model_a, tok = build_noisy_model(root / "a", seed=0)
    model_b, _ = build_noisy_model(root / "b", seed=1)
    return Models(root / "a", root / "b", model_a, model_b, tok)


@pytest.fixture(scope="module")
def engine(models, engine_kind, start_engine) -> EngineServer:
    """The engine under contract: the built-in one, and real SGLang when installed (conftest.py)."""
    server = start_engine(engine_kind, models.path_a, API_KEY, CONTEXT_LENGTH)
    yield server
    server.stop()


@pytest.fixture
def fresh_engine(models) -> EngineServer:
    """An engine whose weights and version a test may change."""
    server = EngineServer(str(models.path_a), api_key=API_KEY, context_length=CONTEXT_LENGTH).start()
    yield server
    server.stop()


def post(engine: EngineServer, path: str, body: object = None, **kw) -> httpx.Response:
    return http_calls.post(f"{engine.url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def get(engine: EngineServer, path: str) -> httpx.Response:
    return http_calls.get(f"{engine.url}{path}", headers=AUTH, timeout=60)


def prompt_ids(models: Models, text: str) -> list[int]:
    return models.tokenizer(text).input_ids


def metric(engine: EngineServer, name: str) -> float:
    value = sample(http_calls.get(f"{engine.url}/metrics").text, name)
    assert value is not None, f"{name} not in /metrics"
    return value


async def wait_until(cond: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll server state until `cond` holds; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)  # poll interval, not synchronisation: the condition decides


def internal_state(info: dict) -> dict:
    return info["internal_states"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- /generate contract --------------------------------------------------------------------------


def test_generate_response_shape_and_length_finish(engine, models):
    prompt = prompt_ids(models, "12+7=")
    r = post(
        engine,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "rid": "shape-1",
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == 6 == len(body["output_ids"])
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "0"
    assert "weight_versions" not in meta  # one version only
    assert meta["output_token_logprobs_length"] == 6
    for (lp, tok, text), out in zip(meta["output_token_logprobs"], body["output_ids"], strict=True):
        assert tok == out and text is None and lp <= 0.0
    assert meta["e2e_latency"] > 0
    assert body["output_ids"] == greedy_reference(models.model_a, prompt, 6)
    assert body["text"] == models.tokenizer.decode(body["output_ids"], skip_special_tokens=True)


def test_stop_finish_reasons(engine, models):
    prompt = prompt_ids(models, "3+4=")
    free = greedy_reference(models.model_a, prompt, 8)
    stop_tok = free[2]
    cut = free.index(stop_tok) + 1

    def gen(**sp) -> dict:
        r = post(engine, "/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0, **sp}})
        assert r.status_code == 200, r.text
        return r.json()

    # a stop token ends the output (and is kept in output_ids, trimmed from text)
    out = gen(max_new_tokens=8, stop_token_ids=[stop_tok])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["output_ids"] == free[:cut]
    assert out["meta_info"]["completion_tokens"] == cut
    assert out["text"] == models.tokenizer.decode(free[: cut - 1], skip_special_tokens=True)
    # ignore_eos also ignores stop tokens (SGLang's check_finished)
    out = gen(max_new_tokens=8, stop_token_ids=[stop_tok], ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    # EOS, forced by logit_bias; min_new_tokens holds it back
    eos = models.tokenizer.eos_token_id
    out = gen(max_new_tokens=8, logit_bias={str(eos): 100.0})
    assert out["output_ids"] == [eos]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    out = gen(max_new_tokens=8, logit_bias={str(eos): 100.0}, min_new_tokens=3)
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == eos and eos not in out["output_ids"][:3]
    # max_new_tokens 0 is prefill only
    out = gen(max_new_tokens=0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_batch_and_n(engine, models):
    prompts = [prompt_ids(models, t) for t in ("1+1=", "19+19=", "5+12=")]  # different lengths: left padding
    r = post(
        engine,
        "/generate",
        {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "rid": "b",
        },
    )
    assert r.status_code == 200
    out = r.json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1", "b_2"]
    for o, p in zip(out, prompts, strict=True):
        assert o["output_ids"] == greedy_reference(models.model_a, p, 5)

    # n > 1 turns one prompt into a list of n samples with fresh rids; text prompts are tokenized
    r = post(
        engine, "/generate", {"text": "2+2=", "sampling_params": {"max_new_tokens": 4, "n": 3}, "rid": "x"}
    )
    out = r.json()
    assert len(out) == 3 and len({o["meta_info"]["id"] for o in out}) == 3
    assert all(o["meta_info"]["prompt_tokens"] == len(prompt_ids(models, "2+2=")) for o in out)
    r = post(engine, "/generate", {"text": ["2+2=", "3+3="], "sampling_params": [{"n": 2}, {"n": 2}]})
    assert len(r.json()) == 4


def test_greedy_and_seeded_sampling_are_deterministic(engine, models):
    prompt = prompt_ids(models, "8+9=")

    def sample(**sp) -> list[int]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True, **sp}}
        return post(engine, "/generate", body).json()["output_ids"]

    assert sample(temperature=0) == sample(temperature=0)
    seeded = sample(temperature=1.0, sampling_seed=123)
    assert seeded == sample(temperature=1.0, sampling_seed=123)
    assert any(sample(temperature=1.0, sampling_seed=s) != seeded for s in (1, 2, 3))
    # top_k 1 is greedy whatever the temperature
    assert sample(temperature=1.0, top_k=1, sampling_seed=5) == sample(temperature=0)


def test_logprobs_match_trainer_recomputation(engine, models):
    prompts = [prompt_ids(models, t) for t in ("4+15=", "11+2=", "0+0=")]
    body = {
        "input_ids": prompts,
        "sampling_params": {
            "max_new_tokens": 12,
            "temperature": 0.7,
            "top_p": 0.9,
            "min_p": 0.01,
            "sampling_seed": 7,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = post(engine, "/generate", body).json()
    for o, p in zip(out, prompts, strict=True):
        engine_lp = torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]])
        trainer_lp = response_logprobs(models.model_a, p, o["output_ids"], temperature=0.7).detach()
        torch.testing.assert_close(engine_lp, trainer_lp, atol=1e-3, rtol=0)
        # input logprobs: None for the first prompt token, then each prompt token given its prefix
        inp = o["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in inp] == p and inp[0][0] is None
        full = response_logprobs(models.model_a, p[:1], p[1:]).detach()
        torch.testing.assert_close(torch.tensor([e[0] for e in inp[1:]]), full, atol=1e-3, rtol=0)


# ---- errors and auth -----------------------------------------------------------------------------


def test_auth(engine):
    body = {"input_ids": [5, 3], "sampling_params": {"max_new_tokens": 1}}
    r = http_calls.post(f"{engine.url}/generate", json=body)
    assert r.status_code == 401 and r.json() == {"error": {"message": "Unauthorized"}}
    r = http_calls.post(f"{engine.url}/generate", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert http_calls.get(f"{engine.url}/get_model_info").status_code == 401
    assert http_calls.post(f"{engine.url}/pause_generation", json={}).status_code == 401
    assert http_calls.get(f"{engine.url}/health").status_code == 200
    assert http_calls.get(f"{engine.url}/metrics").status_code == 200
    assert post(engine, "/generate", body).status_code == 200


@pytest.mark.builtin_only
def test_bad_requests_get_sglang_error_shapes(engine):
    def validation(body: object, where: str) -> None:
        r = post(engine, "/generate", body)
        assert r.status_code == 400
        err = r.json()
        assert {k: err[k] for k in ("object", "type", "param", "code")} == {
            "object": "error",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
        assert where in err["message"]

    validation(
        {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "$.sampling_params.temperature"
    )
    validation({"input_ids": [1, 2], "sampling_params": {"no_such_key": 1}}, "no_such_key")
    validation({"input_ids": "12"}, "$.input_ids")
    r = http_calls.post(f"{engine.url}/generate", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and r.json()["object"] == "error"

    def value_error(body: object, needle: str) -> None:
        r = post(engine, "/generate", body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text

    value_error({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p")
    value_error({"input_ids": [1, 2], "text": "1+1="}, "Either text or input_ids")
    value_error(
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}}, "context length"
    )
    value_error({"input_ids": [1, 2], "sampling_params": {"regex": "(a+"}}, "invalid regex")
    # known-but-unused keys are accepted
    ok = {
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "custom_params": {},
    }
    assert (
        post(
            engine, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, **ok}}
        ).status_code
        == 200
    )

    r = post(engine, "/pause_generation", {"mode": "sideways"})
    assert r.status_code == 400 and r.json()["success"] is False and "sideways" in r.json()["message"]
    r = post(
        engine, "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}
    )
    assert (
        r.status_code == 400
        and r.json()["success"] is False
        and "no weight update group" in r.json()["message"]
    )


@pytest.mark.builtin_only
def test_info_routes(engine, models):
    for path in ("/model_info", "/get_model_info"):
        info = get(engine, path).json()
        assert info["is_generation"] is True and info["model_type"] == "qwen2"
        assert info["architectures"] == ["Qwen2ForCausalLM"] and info["weight_version"] == "0"
    for path in ("/server_info", "/get_server_info"):
        info = get(engine, path).json()
        assert info["version"] == "slipstream-builtin" and info["max_batch_size"] == 256
        assert internal_state(info)["paused"] is False
    assert get(engine, "/get_weight_version").json() == {"weight_version": "0"}
    assert get(engine, "/health_generate").status_code == 200
    assert post(engine, "/flush_cache").text.startswith("Cache flushed.")
    text = http_calls.get(f"{engine.url}/metrics").text
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "num_paused_reqs",
        "prompt_tokens_total",
    ):
        assert f"sglang:{name}{{model_name=" in text
    assert metric(engine, "sglang:generation_tokens_total") > 0


# ---- pause, abort, continue (through the client) -------------------------------------------------


@pytest.mark.builtin_only
def test_pause_abort_returns_partial_and_holds_new_requests(engine, models):
    prompt = prompt_ids(models, "6+6=")

    async def scenario() -> None:
        async with EngineClient(engine.url, api_key=API_KEY) as client:
            base = metric(engine, "sglang:generation_tokens_total")
            running = asyncio.create_task(
                client.generate(prompt, {"max_new_tokens": LONG, "ignore_eos": True}, rid="long-1")
            )

            async def has_tokens() -> bool:
                return metric(engine, "sglang:generation_tokens_total") >= base + 3

            await wait_until(has_tokens, "the long request to produce tokens")
            await client.pause("abort")
            res = await asyncio.wait_for(running, DEADLINE_S)
            assert res.finish_reason == "abort" and 3 <= len(res.output_ids) < LONG
            assert len(res.output_logprobs) == len(res.output_ids) == res.meta_info["completion_tokens"]
            assert res.token_versions == [0] * len(res.output_ids)

            # while paused, a new call waits (no error) and is not aborted by the pause
            assert (await asyncio.to_thread(get, engine, "/health_generate")).status_code == 503
            waiting = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 3, "temperature": 0}))

            async def queued() -> bool:
                return internal_state(await client.server_info())["num_queue_reqs"] == 1

            await wait_until(queued, "the new call to wait at the pause")
            await client.continue_generation()
            res = await waiting
            assert res.finish_reason == "length" and res.output_ids == greedy_reference(
                models.model_a, prompt, 3
            )

            # abort by rid prefix
            running = asyncio.create_task(
                client.generate(prompt, {"max_new_tokens": LONG, "ignore_eos": True}, rid="job7-s0")
            )

            async def is_running() -> bool:
                return internal_state(await client.server_info())["num_running_reqs"] == 1

            await wait_until(is_running, "the request to run")
            await client.abort("job7")
            assert (await running).finish_reason == "abort"

    asyncio.run(scenario())
    assert metric(engine, "slipstream_engine_pause_seconds_count") >= 1


@pytest.mark.builtin_only
def test_pause_in_place_keeps_requests_and_versions_span(engine, models):
    prompt = prompt_ids(models, "9+1=")
    n_new = 200

    async def scenario() -> None:
        async with EngineClient(engine.url, api_key=API_KEY) as client:
            base = metric(engine, "sglang:generation_tokens_total")
            task = asyncio.create_task(
                client.generate(prompt, {"max_new_tokens": n_new, "ignore_eos": True, "temperature": 0})
            )

            async def has_tokens() -> bool:
                return metric(engine, "sglang:generation_tokens_total") >= base + 2

            await wait_until(has_tokens, "tokens before the pause")
            await client.pause("in_place")

            async def parked() -> bool:
                return internal_state(await client.server_info())["num_paused_reqs"] == 1

            await wait_until(parked, "the running request to park")
            produced = int(metric(engine, "sglang:generation_tokens_total") - base)
            assert not task.done() and 2 <= produced < n_new
            await client.update_weight_version("7")
            await client.continue_generation()
            res = await task
            await client.update_weight_version("0")  # the module engine's version for later tests

            assert res.finish_reason == "length" and len(res.output_ids) == n_new
            # no token lost or repeated across the pause: same tokens as an uninterrupted greedy run
            assert res.output_ids == greedy_reference(models.model_a, prompt, n_new)
            assert res.meta_info["weight_versions"] == [
                {"version": "0", "start": 0, "end": produced},
                {"version": "7", "start": produced, "end": n_new},
            ]
            assert res.token_versions == [0] * produced + [7] * (n_new - produced)
            assert res.weight_version == "7"

    asyncio.run(scenario())


@pytest.mark.builtin_only
def test_requests_return_when_they_finish_not_when_their_batch_ends(engine, models):
    prompt = prompt_ids(models, "2+5=")

    async def scenario() -> None:
        async with EngineClient(engine.url, api_key=API_KEY) as client:
            # hold both calls at the pause so that they start as one batch on continue
            await client.pause("in_place")
            long = asyncio.create_task(client.generate(prompt, {"max_new_tokens": LONG, "ignore_eos": True}))
            short = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 2, "ignore_eos": True}))

            async def both_queued() -> bool:
                return internal_state(await client.server_info())["num_queue_reqs"] == 2

            await wait_until(both_queued, "both calls to wait at the pause")
            await client.continue_generation()
            assert len((await short).output_ids) == 2
            assert not long.done()
            await client.abort(abort_all=True)
            assert (await long).finish_reason == "abort"

    asyncio.run(scenario())


def test_client_errors_and_health(engine):
    async def scenario() -> None:
        async with EngineClient(engine.url, api_key=API_KEY) as client:
            assert await client.health()
            assert (await client.model_info())["weight_version"] == "0"
            with pytest.raises(EngineError) as exc:
                await client.generate([], {})
            assert exc.value.status_code == 400 and "input_ids cannot be empty" in exc.value.message
            await client.flush_cache()
        async with EngineClient(engine.url) as no_key:
            with pytest.raises(EngineError) as exc:
                await no_key.server_info()
            assert exc.value.status_code == 401 and exc.value.message == "Unauthorized"
        async with EngineClient(f"http://127.0.0.1:{free_port()}") as dead:
            assert not await dead.health()

    asyncio.run(scenario())


# ---- weight updates over a real gloo group -------------------------------------------------------


def _trainer_join(pool: ThreadPoolExecutor, engine: EngineServer, group_name: str):
    """Trainer rank 0: send the engine's HTTP call first (it blocks until rank 0 joins), then join."""
    port = free_port()
    pending = pool.submit(
        post,
        engine,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": str(port),  # clients also send it as a string
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group_name,
            "backend": "gloo",
        },
    )
    group = new_group("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name=group_name)
    r = pending.result(timeout=DEADLINE_S)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    return group


def _trainer_send(pool, engine, group, group_name: str, named: dict, version: str, load_format: str | None):
    tensors = [t.detach().contiguous() for t in named.values()]
    body = {
        "names": list(named),
        "dtypes": [dtype_name(t.dtype) for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "group_name": group_name,
        "weight_version": version,
        "load_format": load_format,
        "flush_cache": False,
    }
    pending = pool.submit(post, engine, "/update_weights_from_distributed", body)
    if load_format == "flattened_bucket":
        broadcast(group, torch.cat([t.view(-1).view(torch.uint8) for t in tensors]))
    else:
        for t in tensors:
            broadcast(group, t)
    return pending.result(timeout=DEADLINE_S)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_distributed_weight_update_mid_request(fresh_engine, models, load_format):
    engine, group_name = fresh_engine, f"wu-{load_format}"
    prompt = prompt_ids(models, "14+3=")
    ref_a = greedy_reference(models.model_a, prompt, 8)
    ref_b = greedy_reference(models.model_b, prompt, 8)
    assert ref_a != ref_b, "test needs two models that decode differently"
    n_new = LONG  # still running when the pause lands, also on a loaded box

    async def scenario() -> None:
        async with EngineClient(engine.url, api_key=API_KEY) as client:
            greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert (await client.generate(prompt, greedy)).output_ids == ref_a

            # a request in flight across the update: pause in place, update, continue
            task = asyncio.create_task(client.generate(prompt, {**greedy, "max_new_tokens": n_new}))

            async def has_tokens() -> bool:
                return metric(engine, "sglang:generation_tokens_total") >= 8 + 2

            await wait_until(has_tokens, "tokens before the update")
            await client.pause("in_place")

            async def parked() -> bool:
                return internal_state(await client.server_info())["num_paused_reqs"] == 1

            await wait_until(parked, "the running request to park")
            produced = int(metric(engine, "sglang:generation_tokens_total")) - 8

            with ThreadPoolExecutor(2) as pool:
                group = await asyncio.to_thread(_trainer_join, pool, engine, group_name)
                r = await asyncio.to_thread(
                    _trainer_send,
                    pool,
                    engine,
                    group,
                    group_name,
                    models.model_b.state_dict(),
                    "1",
                    load_format,
                )
                assert r.status_code == 200 and r.json()["success"] is True, r.text
                # unknown names are refused after the tensors were received, and change nothing
                bad = {"model.no_such.weight": torch.zeros(3)}
                r = await asyncio.to_thread(
                    _trainer_send, pool, engine, group, group_name, bad, "9", load_format
                )
                assert r.status_code == 400 and "unknown parameter names" in r.json()["message"]

            await client.continue_generation()
            res = await task
            assert res.finish_reason == "length"
            assert res.token_versions == [0] * produced + [1] * (n_new - produced)
            assert res.meta_info["weight_versions"][-1] == {"version": "1", "start": produced, "end": n_new}

            after = await client.generate(prompt, greedy)
            assert after.output_ids == ref_b and after.weight_version == "1"
            lp_b = response_logprobs(models.model_b, prompt, after.output_ids).detach()
            torch.testing.assert_close(torch.tensor(after.output_logprobs), lp_b, atol=1e-3, rtol=0)
            assert (await client.model_info())["weight_version"] == "1"

        r = post(engine, "/destroy_weights_update_group", {"group_name": group_name})
        assert r.status_code == 200 and r.json()["success"] is True
        r = post(engine, "/destroy_weights_update_group", {"group_name": group_name})
        assert r.status_code == 400 and r.json()["success"] is False

        # and back from disk
        r = post(
            engine, "/update_weights_from_disk", {"model_path": str(models.path_a), "weight_version": "2"}
        )
        assert r.status_code == 200 and r.json()["success"] is True
        out = post(engine, "/generate", {"input_ids": prompt, "sampling_params": greedy}).json()
        assert out["output_ids"] == ref_a and out["meta_info"]["weight_version"] == "2"
        assert metric(engine, "slipstream_engine_weight_updates_total") == 2

    asyncio.run(scenario())


@pytest.mark.builtin_only
def test_an_engine_in_a_process_that_goes_on_gives_its_torch_threads_back(models):
    """`torch_threads` is process-wide while the engine serves; a test or notebook process keeps its own
    count once the engine stopped."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        server = EngineServer(str(models.path_a), api_key=API_KEY, torch_threads=1).start()
        try:
            assert torch.get_num_threads() == 1
        finally:
            server.stop()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
