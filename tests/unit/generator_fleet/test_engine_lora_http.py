"""LoRA through the built-in engine's HTTP routes: an adapter loaded from a PEFT directory or from shared
memory serves /generate requests that name it (`lora_path`), batched with base-model requests, with
greedy tokens equal to PEFT's merged model and logprobs equal to PEFT's; replace, unload, and the
errors SGLang gives (unknown adapter: 400)."""

from __future__ import annotations

import concurrent.futures
import copy
import json

import http_calls
import pytest
import torch
from metrics_text import sample
from tiny_engine_model import build_noisy_model, greedy_reference

from common.net import free_port
from generator_fleet.engine import EngineServer
from models.config import LoraSpec
from weight_bus import ipc
from weight_bus.engine_client import EngineClient
from weight_bus.errors import Refused
from weight_bus.group import broadcast, new_group, shutdown_group
from weight_bus.schema import LoadLoraAdapterFromTensors

peft = pytest.importorskip("peft")

SPEC = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
PROMPTS = [[1, 5, 7, 9, 3], [2, 4, 6], [8, 8, 1, 2, 3, 4]]
N = 12
LOGPROB_TOL = 1e-4
"""fp32 engine vs PEFT's unmerged forward on the same weights."""


def adapter(model, seed: int):
    cfg = {k: v for k, v in SPEC.peft_config().items() if k != "peft_type"}
    pm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return pm.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_http")
    model, _ = build_noisy_model(root / "model", seed=4)
    model = model.float()
    a1, a2 = adapter(model, 11), adapter(model, 12)
    a1.save_pretrained(root / "a1")
    merged1 = copy.deepcopy(a1).merge_and_unload()
    merged2 = copy.deepcopy(a2).merge_and_unload()
    server = EngineServer(
        str(root / "model"), api_key="k", context_length=128, lora=SPEC, max_loras=2
    ).start()
    client = EngineClient("k", 60.0)
    yield {
        "url": server.url,
        "client": client,
        "model": model,
        "root": root,
        "a1": a1,
        "a2": a2,
        "merged1": merged1,
        "merged2": merged2,
    }
    client.close()
    server.stop()


def generate(url: str, prompts, lora_path, **extra) -> list[dict]:
    body = {
        "input_ids": prompts,
        "lora_path": lora_path,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True},
        **extra,
    }
    r = http_calls.post(url + "/generate", json=body, headers={"Authorization": "Bearer k"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_adapter_from_dir_and_tensors_mixed_with_base_in_one_batch(setup):
    s = setup
    url, client = s["url"], s["client"]
    ans = client.load_lora_adapter(url, "one", str(s["root"] / "a1"))
    assert ans["success"] and ans["loaded_adapters"] == {"one": str(s["root"] / "a1")}
    named = [(k, v.detach().clone()) for k, v in peft.get_peft_model_state_dict(s["a2"]).items()]
    ans = client.load_lora_adapter_from_tensors(
        url,
        LoadLoraAdapterFromTensors(
            lora_name="two", config_dict=SPEC.peft_config(), serialized_named_tensors=[ipc.serialize(named)]
        ),
    )
    assert set(ans["loaded_adapters"]) == {"one", "two"}
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    names = ["one", None, "two", None]
    out = generate(url, batch, names, return_logprob=True, logprob_start_len=0)
    refs = {"one": s["merged1"], None: s["model"], "two": s["merged2"]}
    for o, p, n in zip(out, batch, names, strict=True):
        assert o["output_ids"] == greedy_reference(refs[n], p, N), n
    # adapters change the tokens (else the equality proves nothing)
    assert out[0]["output_ids"] != out[3]["output_ids"]
    # logprobs of the adapter's tokens equal PEFT's (unmerged) forward
    ids = batch[0] + out[0]["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(s["a1"](torch.tensor([ids])).logits[0].float(), -1)
    want = lp[len(batch[0]) - 1 : -1].gather(1, torch.tensor(out[0]["output_ids"])[:, None]).squeeze(1)
    got = torch.tensor([t[0] for t in out[0]["meta_info"]["output_token_logprobs"]])
    assert (got - want).abs().max() < LOGPROB_TOL
    got_in = torch.tensor([t[0] for t in out[0]["meta_info"]["input_token_logprobs"][1:]])
    want_in = lp[: len(batch[0]) - 1].gather(1, torch.tensor(batch[0][1:])[:, None]).squeeze(1)
    assert (got_in - want_in).abs().max() < LOGPROB_TOL
    # a single-prompt request with a str lora_path
    one = generate(url, PROMPTS[1], "two")
    assert one["output_ids"] == greedy_reference(s["merged2"], PROMPTS[1], N)
    text = http_calls.get(url + "/metrics").text
    assert sample(text, "slipstream_engine_lora_adapters") == 2
    assert sample(text, "slipstream_engine_lora_ops_total", op="load_from_tensors", outcome="ok") == 1


def test_replace_in_place_unload_and_errors(setup):
    s = setup
    url, client = s["url"], s["client"]
    with pytest.raises(Refused, match="slots are in use"):  # both slots hold the first test's adapters
        client.load_lora_adapter(url, "r", str(s["root"] / "a1"))
    client.unload_lora_adapter(url, "one")
    ans = client.unload_lora_adapter(url, "two")
    assert ans["loaded_adapters"] == {}
    client.load_lora_adapter(url, "r", str(s["root"] / "a1"))
    named = [(k, v.detach().clone()) for k, v in peft.get_peft_model_state_dict(s["a2"]).items()]
    client.load_lora_adapter_from_tensors(
        url,
        LoadLoraAdapterFromTensors(
            lora_name="r", config_dict=SPEC.peft_config(), serialized_named_tensors=[ipc.serialize(named)]
        ),
    )
    assert generate(url, [PROMPTS[2]], ["r"])[0]["output_ids"] == greedy_reference(
        s["merged2"], PROMPTS[2], N
    )
    client.unload_lora_adapter(url, "r")
    r = http_calls.post(
        url + "/generate",
        json={"input_ids": PROMPTS[0], "lora_path": "r", "sampling_params": {"max_new_tokens": 2}},
        headers={"Authorization": "Bearer k"},
    )
    assert r.status_code == 400 and "not loaded" in r.text
    with pytest.raises(Refused, match="not loaded"):
        client.unload_lora_adapter(url, "r")
    with pytest.raises(Refused, match="no adapter_config.json"):
        client.load_lora_adapter(url, "x", str(s["root"]))
    big = LoraSpec(rank=8, alpha=8, target_modules=["q_proj"]).peft_config()
    with pytest.raises(Refused, match="exceeds"):
        client.load_lora_adapter_from_tensors(
            url,
            LoadLoraAdapterFromTensors(
                lora_name="x",
                config_dict=big,
                serialized_named_tensors=[
                    ipc.serialize(
                        [
                            (
                                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                torch.zeros(8, 4),
                            )
                        ]
                    )
                ],
            ),
        )
    # after all that, base requests are still the base model's
    assert generate(url, [PROMPTS[1]], None)[0]["output_ids"] == greedy_reference(s["model"], PROMPTS[1], N)


def test_lora_path_on_an_engine_without_lora_is_400(tmp_path):
    build_noisy_model(tmp_path / "m", seed=5)
    with EngineServer(str(tmp_path / "m"), context_length=64) as server:
        r = http_calls.post(server.url + "/generate", json={"input_ids": [1, 2], "lora_path": "x"})
        assert r.status_code == 400 and "not enabled" in r.text
        r = http_calls.post(
            server.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
        )
        assert r.status_code == 400 and r.json()["success"] is False


def greedy_switching(models_by_token, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding where token i comes from models_by_token(i) over the whole context."""
    ids = list(prompt)
    with torch.no_grad():
        for i in range(n):
            ids.append(int(models_by_token(i)(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_adapter_over_a_gloo_group_replaces_it_under_load_with_consistent_versions(setup):
    """The bus's group path: /update_weights_from_distributed with lora_name/lora_config, the adapter in
    two flattened buckets (the second carries the version). A streaming request runs with the adapter
    while it is replaced (paused with retract, the bus's `pause_mode: retract`): its tokens before the update come from the old adapter (version 1), the rest
    from the new one (version 2), which is exactly the greedy decoding that switches adapters there."""
    s = setup
    url, client = s["url"], s["client"]
    for name in client.load_lora_adapter(url, "g0", str(s["root"] / "a1"))["loaded_adapters"]:
        client.unload_lora_adapter(url, name)
    port = free_port()
    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    join |= {"group_name": "lora_test", "backend": "gloo"}

    def send(pool, group, pm, version: str) -> None:
        named = list(peft.get_peft_model_state_dict(pm).items())
        half = len(named) // 2
        for part, last in ((named[:half], False), (named[half:], True)):
            flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in part])
            bucket = {
                "names": [n for n, _ in part],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in part],
                "shapes": [list(t.shape) for _, t in part],
                "group_name": "lora_test",
                "load_format": "flattened_bucket",
                "lora_name": "g",
                "lora_config": SPEC.peft_config(),
                "weight_version": version if last else None,
            }
            answer = pool.submit(client.post, url, "/update_weights_from_distributed", bucket)
            broadcast(group, flat)
            answer.result()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.post, url, "/init_weights_update_group", join)
        group = new_group("127.0.0.1", port, 0, 2, "gloo", "lora_test")
        joined.result()
        try:
            send(pool, group, s["a1"], "1")
            first = generate(url, [PROMPTS[0]], ["g"])[0]
            assert first["output_ids"] == greedy_reference(s["merged1"], PROMPTS[0], N)
            assert first["meta_info"]["weight_version"] == "1"
            body = {
                "input_ids": PROMPTS[2],
                "lora_path": "g",
                "stream": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True},
            }
            events = []
            with http_calls.stream(
                "POST", url + "/generate", json=body, headers={"Authorization": "Bearer k"}, timeout=60
            ) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        break
                # retract: the request's K/V is recomputed with the new adapter on resume, so its tokens
                # equal a full-context greedy decoding (an in-place pause keeps the old adapter's K/V)
                client.pause_generation(url, "retract")
                send(pool, group, s["a2"], "2")
                client.continue_generation(url)
                for line in lines:
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
        finally:
            client.post(url, "/destroy_weights_update_group", {"group_name": "lora_test"})
            shutdown_group(group)
    out = events[-1]
    spans = out["meta_info"]["weight_versions"]
    assert [sp["version"] for sp in spans] == ["1", "2"], spans
    k = spans[0]["end"]
    assert 0 < k < 40
    want = greedy_switching(lambda i: s["merged1"] if i < k else s["merged2"], PROMPTS[2], 40)
    assert out["output_ids"] == want
    text = http_calls.get(url + "/metrics").text
    assert sample(text, "slipstream_engine_lora_ops_total", op="update", outcome="ok") == 2
    assert sample(text, "slipstream_engine_weight_version") == 2


def test_generation_client_sends_its_adapter(setup):
    """generator_fleet.client.EngineClient(lora_path=...): what rollout workers and the evaluator of a
    LoRA job use; every call of it runs with the adapter."""
    import asyncio

    from generator_fleet.client import EngineClient as GenClient

    s = setup
    s["client"].load_lora_adapter(s["url"], "c", str(s["root"] / "a1"))
    sp = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}

    async def run():
        async with (
            GenClient(s["url"], api_key="k", lora_path="c") as lora,
            GenClient(s["url"], api_key="k") as base,
        ):
            batch = await lora.generate_batch(PROMPTS, [sp] * len(PROMPTS))
            one = await lora.generate(PROMPTS[0], sp)
            plain = await base.generate(PROMPTS[0], sp)
            return batch, one, plain

    batch, one, plain = asyncio.run(run())
    for res, p in zip(batch, PROMPTS, strict=True):
        assert res.output_ids == greedy_reference(s["merged1"], p, N)
    assert one.output_ids == batch[0].output_ids
    assert plain.output_ids == greedy_reference(s["model"], PROMPTS[0], N)
    s["client"].unload_lora_adapter(s["url"], "c")
