"""Releasing and resuming a built-in engine's memory (/release_memory_occupation,
/resume_memory_occupation; SGLang's routes and payloads), against an engine serving in its own process
(`python -m generator_fleet.engine`, behind an API key) and driven by the weight bus's EngineClient.

Every test leaves the engine with nothing released. Greedy outputs are checked against a cache-free
forward of the model the engine serves, so a resume that lost or changed a byte of the weights or
corrupted the re-allocated KV pool shows up as different tokens. The GPU tests check that the freed memory
really goes back to the device (`torch.cuda.mem_get_info`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import http_calls
import msgspec
import pytest
import torch
from metrics_text import sample
from tiny_engine_model import build_noisy_model, greedy_reference

from common.net import free_port
from generator_fleet.engine.memory import TAGS, resolve_tags
from weight_bus import ipc
from weight_bus.engine_client import EngineClient
from weight_bus.errors import Refused
from weight_bus.group import broadcast, new_group, shutdown_group
from weight_bus.schema import MemoryOccupation, UpdateWeightsFromTensor

ROOT = Path(__file__).resolve().parents[3]
KEY = "memory-key"
CONTEXT = 512
PROMPT = [3, 4, 5, 6]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models of the same shape and different weights: the served one and an update."""
    root = tmp_path_factory.mktemp("memory")
    a, _ = build_noisy_model(root / "a", seed=3)
    b, _ = build_noisy_model(root / "b", seed=4)
    return {"a": (root / "a", a), "b": (root / "b", b)}


@pytest.fixture(scope="module")
def reference(models) -> dict[str, list[int]]:
    """Cache-free greedy continuations of PROMPT (24 tokens) under model `a` and model `b`."""
    return {k: greedy_reference(m, PROMPT, 24) for k, (_, m) in models.items()}


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    """The URL of a built-in engine serving model `a` in its own process."""
    log_path = tmp_path_factory.mktemp("memory_log") / "engine.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "SLIPSTREAM_ENGINE_API_KEY": KEY,
    }
    cmd = [sys.executable, "-m", "generator_fleet.engine", "--model", str(models["a"][0]), "--port", "0"]
    cmd += ["--context-length", str(CONTEXT), "--torch-threads", "1", "--kv-cache-tokens", "2048"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready at "), (line, log_path.read_text())
        yield line.removeprefix("engine ready at ").strip(), log_path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client():
    with EngineClient(KEY, timeout_s=120.0) as c:
        yield c


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def generate(url: str, n: int, prompt: list[int] = PROMPT) -> dict:
    r = http_calls.post(
        f"{url}/generate",
        json={"input_ids": prompt, "sampling_params": _greedy(n)},
        headers=_headers(),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def internal(client: EngineClient, url: str) -> dict:
    return client.server_info(url)["internal_states"][0]


def metrics(url: str) -> str:
    return http_calls.get(f"{url}/metrics", timeout=10).text


@pytest.fixture
def url(engine, client, models):
    """The engine's URL, with its weights back to model `a` and nothing released after the test."""
    url, _ = engine
    yield url
    client.resume_memory_occupation(url)
    client.post(url, "/update_weights_from_disk", {"model_path": str(models["a"][0])})


@pytest.mark.parametrize(
    "tags",
    [None, ["kv_cache"], ["weights"], ["cuda_graph"], ["weights", "cuda_graph"]],
)
def test_release_then_resume_leaves_greedy_generation_identical(url, client, reference, tags):
    expected = reference["a"]
    assert generate(url, 24)["output_ids"] == expected
    out = client.release_memory_occupation(url, tags)
    assert out["released"] == resolve_tags(tags)
    assert set(out["freed_bytes"]) == set(resolve_tags(tags))
    assert internal(client, url)["memory_released"] == resolve_tags(tags)
    assert client.server_info(url)["memory_released"] == resolve_tags(tags)
    text = metrics(url)
    for tag in TAGS:
        value = sample(text, "slipstream_engine_memory_released", tag=tag)
        assert value == (1.0 if tag in resolve_tags(tags) else 0.0), tag
    out = client.resume_memory_occupation(url, tags)
    assert out["resumed"] == resolve_tags(tags) and out["released"] == []
    assert generate(url, 24)["output_ids"] == expected


def test_requests_sent_while_released_wait_and_complete_after_resume(url, client, reference):
    expected = reference["a"]
    client.release_memory_occupation(url)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(generate, url, 24) for _ in range(2)]
        deadline = time.monotonic() + 30
        while internal(client, url)["num_queue_reqs"] < 2:  # both reached the engine and wait there
            assert time.monotonic() < deadline, internal(client, url)
            time.sleep(0.02)
        time.sleep(0.3)
        assert not any(c.done() for c in calls)
        r = http_calls.get(f"{url}/health_generate", headers=_headers(), timeout=30)
        assert r.status_code == 503 and "released" in r.text
        assert http_calls.get(f"{url}/health", timeout=10).status_code == 200  # alive, just not generating
        # Weights back (the colocated order: weights, then the update, then the rest): still waiting.
        client.resume_memory_occupation(url, ["weights"])
        time.sleep(0.3)
        assert not any(c.done() for c in calls)
        assert internal(client, url)["memory_released"] == ["kv_cache", "cuda_graph"]
        client.resume_memory_occupation(url, ["kv_cache", "cuda_graph"])
        outs = [c.result(60) for c in calls]
    assert [o["output_ids"] for o in outs] == [expected, expected]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


def test_a_request_in_flight_at_release_is_retracted_and_completes_after_resume(url, client):
    n = 400
    expected = generate(url, n)["output_ids"]  # uninterrupted (the 24-token prefix is checked above)
    body = {"input_ids": PROMPT, "sampling_params": _greedy(n), "stream": True}
    with http_calls.stream("POST", f"{url}/generate", json=body, headers=_headers(), timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first.removeprefix("data:"))["meta_info"]["finish_reason"] is None  # running
        client.release_memory_occupation(url)
        state = internal(client, url)
        assert (state["num_running_reqs"], state["num_queue_reqs"]) == (0, 1)  # retracted: KV given back
        client.resume_memory_occupation(url)
        events = [
            json.loads(x.removeprefix("data:")) for x in lines if x.startswith("data:") and "[DONE]" not in x
        ]
    last = events[-1]
    assert last["output_ids"] == expected
    assert last["meta_info"]["num_retractions"] == 1


def test_a_request_paused_in_place_is_retracted_by_a_release(url, client):
    """pause_generation(in_place) keeps a request's KV; a release frees the pool, so it is retracted and
    re-prefilled once both the memory is back and generation continues."""
    expected = generate(url, 300)["output_ids"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(generate, url, 300)
        deadline = time.monotonic() + 30
        while internal(client, url)["num_running_reqs"] == 0:
            assert time.monotonic() < deadline and not call.done()
            time.sleep(0.005)
        client.pause_generation(url, "in_place")
        client.release_memory_occupation(url, ["kv_cache"])
        client.resume_memory_occupation(url, ["kv_cache"])
        time.sleep(0.2)
        assert not call.done()  # still paused by the caller
        client.continue_generation(url)
        out = call.result(60)
    assert out["output_ids"] == expected
    assert out["meta_info"]["num_retractions"] == 1


def test_weight_updates_are_refused_while_the_weights_are_released(url, client, models, reference):
    path_b, _ = models["b"]
    client.release_memory_occupation(url)
    r = http_calls.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(path_b)}, headers=_headers(), timeout=60
    )
    assert r.status_code == 400 and r.json()["success"] is False
    assert "released" in r.json()["message"] and "resume_memory_occupation" in r.json()["message"]
    # The colocated order: weights back, the update lands while the KV pool is still released, then the rest.
    client.resume_memory_occupation(url, ["weights"])
    client.post(url, "/update_weights_from_disk", {"model_path": str(path_b), "weight_version": "7"})
    client.resume_memory_occupation(url, ["kv_cache", "cuda_graph"])
    out = generate(url, 24)
    assert out["output_ids"] == reference["b"]
    assert out["meta_info"]["weight_version"] == "7"


def test_a_broadcast_update_while_released_is_refused_and_the_group_stays_usable(
    url, client, models, reference
):
    """/update_weights_from_distributed refuses after the broadcast (the collective completes), so the
    group stays in step and the next update, once the weights are back, lands."""
    _, model_b = models["b"]
    port = free_port()
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    join |= {"group_name": "memory_test", "backend": "gloo"}
    weights = {n: p.detach().clone() for n, p in model_b.named_parameters()}
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in weights.values()])
    bucket = {
        "names": list(weights),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": "memory_test",
        "load_format": "flattened_bucket",
        "weight_version": "9",
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.post, url, "/init_weights_update_group", join)
        group = new_group("127.0.0.1", port, 0, 2, "gloo", "memory_test")
        joined.result()
        try:
            client.release_memory_occupation(url, ["weights"])
            answer = pool.submit(client.post, url, "/update_weights_from_distributed", bucket)
            broadcast(group, flat)
            with pytest.raises(Refused, match="released"):
                answer.result()
            client.resume_memory_occupation(url, ["weights"])
            answer = pool.submit(client.post, url, "/update_weights_from_distributed", bucket)
            broadcast(group, flat)
            answer.result()
        finally:
            client.post(url, "/destroy_weights_update_group", {"group_name": "memory_test"})
            shutdown_group(group)
    out = generate(url, 24)
    assert out["output_ids"] == reference["b"] and out["meta_info"]["weight_version"] == "9"


def test_a_tensor_handoff_while_released_is_refused_then_lands_after_the_weights_resume(
    url, client, models, reference
):
    """The colocated publish (/update_weights_from_tensor, shared memory on CPU): refused while the
    weights are released, loaded once they are back and the KV pool is still released."""
    _, model_b = models["b"]
    named = [(n, p.detach().clone()) for n, p in model_b.named_parameters()]
    body = UpdateWeightsFromTensor(serialized_named_tensors=[ipc.serialize(named)], weight_version="11")
    client.release_memory_occupation(url)
    with pytest.raises(Refused, match="released"):
        client.update_weights_from_tensor(url, body)
    client.resume_memory_occupation(url, ["weights"])
    client.update_weights_from_tensor(url, body)
    client.resume_memory_occupation(url, ["kv_cache", "cuda_graph"])
    out = generate(url, 24)
    assert out["output_ids"] == reference["b"] and out["meta_info"]["weight_version"] == "11"


def test_release_and_resume_are_idempotent(url, client):
    def count(tag: str) -> float:
        return sample(metrics(url), "slipstream_engine_memory_releases_total", tag=tag) or 0.0

    before = {t: count(t) for t in TAGS}
    first = client.release_memory_occupation(url, ["kv_cache"])
    assert first["message"] == "Memory released." and first["freed_bytes"]["kv_cache"] > 0
    again = client.release_memory_occupation(url, ["kv_cache"])
    assert again == {
        "success": True,
        "message": "Already released.",
        "released": ["kv_cache"],
        "freed_bytes": {},
    }
    # A release naming one released and one resident tag releases the resident one only.
    both = client.release_memory_occupation(url, ["kv_cache", "weights"])
    assert set(both["freed_bytes"]) == {"weights"} and both["released"] == ["kv_cache", "weights"]
    assert {t: count(t) - before[t] for t in TAGS} == {"kv_cache": 1.0, "weights": 1.0, "cuda_graph": 0.0}
    assert client.resume_memory_occupation(url, ["cuda_graph"])["resumed"] == []
    assert client.resume_memory_occupation(url)["resumed"] == ["kv_cache", "weights"]
    nothing = client.resume_memory_occupation(url)
    assert nothing["resumed"] == [] and nothing["message"] == "Nothing to resume."
    assert sample(metrics(url), "slipstream_engine_memory_seconds_count", op="release") >= 2


def test_the_routes_take_sglangs_payloads_and_answer_its_errors(url, client, engine):
    _, log_path = engine
    assert msgspec.json.encode(MemoryOccupation()) == b"{}"
    assert msgspec.json.decode(b'{"tags": ["weights"]}', type=MemoryOccupation).tags == ["weights"]
    # SGLang's api_route takes GET as well as POST; an empty body means all tags.
    r = http_calls.get(f"{url}/release_memory_occupation", headers=_headers(), timeout=60)
    assert r.status_code == 200 and r.json()["released"] == list(TAGS)
    r = http_calls.post(f"{url}/resume_memory_occupation", content=b"", headers=_headers(), timeout=60)
    assert r.status_code == 200 and r.json()["resumed"] == list(TAGS)
    # An unknown tag: SGLang's 400 {"error": {"message"}} naming it, and nothing released.
    r = http_calls.post(
        f"{url}/release_memory_occupation", json={"tags": ["kv_cache", "activations"]}, headers=_headers()
    )
    assert r.status_code == 400 and "activations" in r.json()["error"]["message"]
    assert client.server_info(url)["memory_released"] == []
    with pytest.raises(Refused, match="HTTP 400"):
        client.release_memory_occupation(url, ["gpu"])
    r = http_calls.post(f"{url}/release_memory_occupation", json={"tags": "kv_cache"}, headers=_headers())
    assert r.status_code == 400
    # Behind the key like every control route.
    assert http_calls.post(f"{url}/release_memory_occupation", json={}).status_code == 401
    assert http_calls.post(f"{url}/resume_memory_occupation", json={}).status_code == 401
    assert client.server_info(url)["memory_released"] == []
    # One log line per state change.
    text = log_path.read_text()
    assert "released memory ['kv_cache', 'weights', 'cuda_graph']" in text
    assert "resumed memory ['kv_cache', 'weights', 'cuda_graph']" in text


# ---- on a GPU --------------------------------------------------------------------------------------


def _qwen2(path: Path, hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from model_zoo.tiny import build_tokenizer

    tok = build_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789", ["abc"])
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


@CUDA
@pytest.mark.gpu
def test_on_cuda_a_release_gives_the_memory_back_and_a_resume_restores_it(tmp_path):
    from generator_fleet.engine import EngineServer

    _qwen2(tmp_path / "m", hidden=1024, layers=8)  # ~0.5 GB of bf16 weights
    server = EngineServer(
        str(tmp_path / "m"), device="cuda", context_length=CONTEXT, kv_cache_tokens=1 << 18, api_key=KEY
    ).start()
    try:
        runner = server.runner
        kv, weights = runner.cache.bytes, runner.weights_bytes()
        with EngineClient(KEY, 120.0) as c:
            prompts = [[3 + i, 4, 5, 6 + i] for i in range(8)]

            def batch() -> list[list[int]]:
                r = http_calls.post(
                    f"{server.url}/generate",
                    json={"input_ids": prompts, "sampling_params": _greedy(64)},
                    headers=_headers(),
                    timeout=300,
                )
                assert r.status_code == 200, r.text
                return [o["output_ids"] for o in r.json()]

            before = batch()  # captures decode graphs
            assert runner.graphs is not None and runner.graphs.graphs
            torch.cuda.synchronize()
            free0, _ = torch.cuda.mem_get_info()
            out = c.release_memory_occupation(server.url)
            free1, _ = torch.cuda.mem_get_info()
            assert out["freed_bytes"]["kv_cache"] == kv and out["freed_bytes"]["weights"] == weights
            assert free1 - free0 >= 0.95 * (kv + weights), (free1 - free0, kv, weights)
            assert not runner.graphs.graphs
            c.resume_memory_occupation(server.url)
            free2, _ = torch.cuda.mem_get_info()
            assert free1 - free2 >= 0.95 * (kv + weights), (free1 - free2, kv, weights)  # taken back
            assert batch() == before  # weights restored bit for bit, pool re-made, graphs captured again
            assert runner.graphs.graphs
    finally:
        server.stop()


@CUDA
@pytest.mark.gpu
def test_on_cuda_mem_fraction_static_sizes_the_pool_from_total_memory(tmp_path):
    from generator_fleet.engine.runner import Runner

    _qwen2(tmp_path / "m", hidden=256, layers=2)
    _, total = torch.cuda.mem_get_info()
    runner = Runner(
        str(tmp_path / "m"),
        device="cuda",
        context_length=CONTEXT,
        max_batch_size=1 << 16,
        mem_fraction_static=0.05,
    )
    try:
        budget = int(total * 0.05) - runner.weights_bytes()
        per_block = runner.cache.bytes // runner.cache.num_blocks
        assert budget - 2 * per_block <= runner.cache.bytes <= budget + 2 * per_block
    finally:
        runner.stop()
    with pytest.raises(ValueError, match="mem_fraction_static 1e-06"):
        Runner(str(tmp_path / "m"), device="cuda", context_length=CONTEXT, mem_fraction_static=1e-6)


@CUDA
@pytest.mark.gpu
def test_on_cuda_the_colocated_cycle_hands_weights_over_by_cuda_ipc_between_release_and_resume(tmp_path):
    """The sync schedule's order against an engine in its own process on this GPU: release everything,
    resume the weights, publish by CUDA IPC (/update_weights_from_tensor), resume the rest; the engine
    then generates what the same weights loaded from disk generate."""
    _qwen2(tmp_path / "a", hidden=256, layers=2, seed=0)
    model_b = _qwen2(tmp_path / "b", hidden=256, layers=2, seed=1)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "SLIPSTREAM_ENGINE_API_KEY": KEY,
    }
    cmd = [sys.executable, "-m", "generator_fleet.engine", "--model", str(tmp_path / "a"), "--port", "0"]
    cmd += ["--device", "cuda", "--context-length", str(CONTEXT), "--kv-cache-tokens", "65536"]
    with open(tmp_path / "engine.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready at "), (line, (tmp_path / "engine.log").read_text())
        url = line.removeprefix("engine ready at ").strip()
        with EngineClient(KEY, 120.0) as c:
            before = generate(url, 32)["output_ids"]
            free0, _ = torch.cuda.mem_get_info()
            out = c.release_memory_occupation(url)
            free1, _ = torch.cuda.mem_get_info()
            assert free1 - free0 >= 0.9 * (out["freed_bytes"]["kv_cache"] + out["freed_bytes"]["weights"])
            c.resume_memory_occupation(url, ["weights"])
            named = [(n, p.detach().to("cuda", torch.bfloat16)) for n, p in model_b.named_parameters()]
            body = UpdateWeightsFromTensor(
                serialized_named_tensors=[ipc.serialize(named)], weight_version="1"
            )
            c.update_weights_from_tensor(url, body)
            c.resume_memory_occupation(url, ["kv_cache", "cuda_graph"])
            handed = generate(url, 32)
            c.post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "b")})
            loaded = generate(url, 32)["output_ids"]
        assert handed["meta_info"]["weight_version"] == "1"
        assert handed["output_ids"] == loaded and loaded != before
    finally:
        proc.terminate()
        proc.wait(30)
