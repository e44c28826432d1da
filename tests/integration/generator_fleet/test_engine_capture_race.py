"""Weight updates, pause/continue and CUDA-graph capture never overlap in the built-in engine.

The GPU test serves a small Qwen2-architecture model on CUDA with graphs on, sends /generate calls of
varied batch sizes and prompt lengths (each new (batch, KV-length) bucket is captured on first use) and,
at the same time, fires weight updates through /update_weights_from_distributed (the weight route's own
code path: gloo group, flattened bucket on the device), half of them without any pause (the receive
then runs while the generation thread decodes and captures) and half between /pause_generation
(in_place) and /continue_generation, as the weight bus does. Then: no call failed, every version span
is one that was published and they only go forward, the engine holds the last weights bit for bit, and
greedy tokens after the storm equal a cache-free HF forward of the last weights. Skipped without CUDA.

The CPU tests check the discipline itself: a pause returns only once the step in flight has ended, and a
weight receive holds the engine's device lock (what a capture takes) exactly while it receives.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading

import http_calls
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common.net import free_port
from generator_fleet.engine import EngineServer
from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner
from model_zoo.tiny import build_tokenizer
from weight_bus.group import broadcast, new_group

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GROUP = "capture_race"


def _save_model(path, hidden: int, layers: int, context: int, seed: int) -> torch.nn.Module:
    tok = build_tokenizer(ALPHABET, [ALPHABET])
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # large weights: confident, varied greedy choices
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


def _variant(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Weights for one update: the model's plus fresh noise (so each version generates differently)."""
    g = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + torch.randn(p.shape, generator=g) * 0.3) for n, p in model.named_parameters()}


class _Trainer:
    """Rank 0 of a gloo weight group with one engine, driving its weight route the way the bus does:
    the HTTP announcement goes out first, then the broadcast joins it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(timeout=120)
        port = free_port()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": GROUP,
            "backend": "gloo",
        }
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(self.http.post, f"{url}/init_weights_update_group", json=body)
            self.group = new_group("127.0.0.1", port, 0, 2, "gloo", GROUP)
            assert joined.result().json()["success"]

    def update(self, weights: dict[str, torch.Tensor], version: str, device: str) -> None:
        names = list(weights)
        tensors = [weights[n].to(device) for n in names]
        body = {
            "names": names,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": GROUP,
            "load_format": "flattened_bucket",
            "weight_version": version,
        }
        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.http.post, f"{self.url}/update_weights_from_distributed", json=body)
            broadcast(self.group, flat)
            r = answer.result()
        assert r.status_code == 200 and r.json()["success"], r.text

    def close(self) -> None:
        self.http.post(f"{self.url}/destroy_weights_update_group", json={"group_name": GROUP})
        self.http.close()


def _generate(url: str, prompts: list[list[int]], max_new: list[int]) -> list[dict]:
    body = {
        "input_ids": prompts,
        "sampling_params": [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in max_new],
    }
    r = http_calls.post(f"{url}/generate", json=body, timeout=600)
    assert r.status_code == 200, f"/generate answered {r.status_code}: {r.text[:500]}"
    return r.json()


@CUDA
def test_weight_updates_racing_new_graph_buckets(tmp_path):
    context = 1024
    model = _save_model(tmp_path, hidden=256, layers=4, context=context, seed=0)
    vocab = model.config.vocab_size
    server = EngineServer(
        str(tmp_path), device="cuda", dtype="float32", context_length=context, max_batch_size=64
    ).start()
    trainer = _Trainer(server.url)
    runner = server.runner
    try:
        rng = random.Random(0)
        # Batch sizes over the graph's batch buckets, prompt + output lengths over its KV buckets
        # (256, 512, 1024 tokens): each call brings buckets no graph exists for yet.
        calls = []
        for bsz in [1, 3, 2, 7, 5, 12, 20, 33, 9, 17, 26, 41, 64, 50, 4, 30]:
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 700))] for _ in range(bsz)]
            calls.append((prompts, [rng.randrange(8, context - 1 - len(p)) % 200 + 8 for p in prompts]))
        published: list[str] = ["0"]
        stop = threading.Event()
        failures: list[BaseException] = []

        def updates() -> None:
            k = 0
            try:
                while not stop.is_set():
                    k += 1
                    pause = k % 2 == 0
                    if pause:
                        r = http_calls.post(
                            f"{server.url}/pause_generation", json={"mode": "in_place"}, timeout=120
                        )
                        assert r.status_code == 200, r.text
                    trainer.update(_variant(model, k), str(k), "cuda")
                    published.append(str(k))
                    if pause:
                        r = http_calls.post(f"{server.url}/continue_generation", json={}, timeout=120)
                        assert r.status_code == 200, r.text
            except BaseException as e:
                failures.append(e)

        updater = threading.Thread(target=updates, name="updates")
        updater.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda c: _generate(server.url, *c), calls))
        finally:
            stop.set()
            updater.join(300)
        assert not failures, failures
        assert not updater.is_alive()
        graphs_during = len(runner.graphs.graphs)
        deferred = getattr(runner.stats, "graph_captures_deferred_total", None)
        print(
            f"\nstorm: {len(calls)} calls, {sum(len(c[0]) for c in calls)} requests, {len(published) - 1} "
            f"weight updates, {graphs_during} graphs captured, {deferred} decode steps deferred a capture"
        )
        assert len(published) > 3, "the updates did not overlap the generation"
        assert graphs_during >= 8
        order = {v: i for i, v in enumerate(published)}
        for (_prompts, max_new), out in zip(calls, results, strict=True):
            for o, n in zip(out, max_new, strict=True):
                meta = o["meta_info"]
                assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]
                assert len(o["output_ids"]) == n
                spans = meta.get("weight_versions") or [
                    {"version": meta["weight_version"], "start": 0, "end": n}
                ]
                seen = [order[s["version"]] for s in spans]  # KeyError: a version nobody published
                assert seen == sorted(seen), spans

        # After the storm: the engine holds the last weights, bit for bit, under the last version ...
        last = published[-1]
        final = _variant(model, int(last)) if last != "0" else dict(model.named_parameters())
        state = runner.model.state_dict()
        for name, want in final.items():
            assert torch.equal(state[name].cpu(), want.detach().to(torch.float32)), name
        assert runner.weight_version == last
        # ... and its greedy tokens (graphs, varied batches, new buckets too) are the HF forward's argmax.
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).to("cuda").eval()
        hf.load_state_dict({n: t.to("cuda") for n, t in final.items()}, strict=False)
        checks = [calls[0], calls[5], calls[12], ([[5] * 900, [7, 8, 9]], [100, 100])]
        for prompts, max_new in checks:
            out = _generate(server.url, prompts, max_new)
            for p, o in zip(prompts, out, strict=True):
                assert o["meta_info"]["weight_version"] == last
                assert "weight_versions" not in o["meta_info"]
                ids = torch.tensor([p + o["output_ids"]], device="cuda")
                with torch.no_grad():
                    lp = torch.log_softmax(hf(ids).logits[0, len(p) - 1 : -1].float(), -1)
                top2 = lp.topk(2, -1).values
                clear = (top2[:, 0] - top2[:, 1]) > 1e-2  # skip near ties (kernel order differs)
                got = torch.tensor(o["output_ids"], device="cuda")
                assert torch.equal(lp.argmax(-1)[clear], got[clear]), f"prompt of {len(p)} tokens"
        assert server.fatal is None
        assert http_calls.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        trainer.close()
        server.stop()


# ---- CPU: the locking discipline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    _save_model(path, hidden=64, layers=2, context=256, seed=1)
    return path


def test_every_pause_mode_returns_only_after_the_step_in_flight(small_model):
    """A caller that paused (to update weights, say) must have the device to itself: pause(in_place)
    returned while a step (on CUDA: possibly a graph capture) was still running."""
    runner = Runner(str(small_model), device="cpu", context_length=256, max_batch_size=4)
    entered, release = threading.Event(), threading.Event()
    decode = runner.fwd.decode

    def held_decode(x, *lora):  # the step in flight stays in flight until the test lets it go
        entered.set()
        assert release.wait(120)
        return decode(x, *lora)

    runner.fwd.decode = held_decode
    runner.start()
    try:
        for mode in ("in_place", "retract"):
            entered.clear()
            release.clear()
            fut = runner.submit(
                Request(mode, [3, 4, 5], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
            )
            assert entered.wait(120)
            returned = threading.Event()
            pauser = threading.Thread(target=lambda m=mode, done=returned: (runner.pause(m), done.set()))
            pauser.start()
            # The pause must be waiting on the step: it cannot return before the step is let go.
            assert not returned.wait(1.0), f"pause({mode}) returned while a step was in flight"
            release.set()
            pauser.join(120)
            assert returned.is_set()
            assert not runner._in_step
            runner.resume()
            assert len(fut.result(120).output_ids) == 3
    finally:
        release.set()
        runner.stop()


def test_a_weight_receive_holds_the_device_lock_that_captures_take(small_model):
    """While the engine's weight thread waits in the broadcast, the device lock (the one a CUDA graph
    capture takes, without waiting) is held; the load into the parameters happens after it is released,
    at a step boundary; and the lock is free again once the update answered."""
    server = EngineServer(str(small_model), context_length=256).start()
    trainer = _Trainer(server.url)
    lock = server.runner.gpu_lock
    try:
        weights = {n: p.detach().clone() + 1.0 for n, p in server.runner.model.named_parameters()}
        names = list(weights)
        tensors = [weights[n] for n in names]
        body = {
            "names": names,
            "dtypes": ["float32"] * len(names),
            "shapes": [list(t.shape) for t in tensors],
            "group_name": GROUP,
            "load_format": "flattened_bucket",
            "weight_version": "7",
        }
        held_at_load: list[bool] = []
        load = server.runner.load_weights

        def load_weights(named, version=None):
            held_at_load.append(lock.locked())
            return load(named, version)

        server.runner.load_weights = load_weights
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                trainer.http.post, f"{server.url}/update_weights_from_distributed", json=body
            )
            while not lock.locked():  # the engine entered its receive: it waits for our broadcast
                assert not answer.done(), answer.result().text
                threading.Event().wait(0.01)
            assert not lock.acquire(blocking=False)  # what a capture tries: it would decode eagerly
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
            broadcast(trainer.group, flat)
            assert answer.result().json()["success"]
        assert held_at_load == [False]
        assert not lock.locked()
        assert server.runner.weight_version == "7"
        for n, t in server.runner.model.state_dict().items():
            if n in weights:
                assert torch.equal(t, weights[n]), n
    finally:
        trainer.close()
        server.stop()
