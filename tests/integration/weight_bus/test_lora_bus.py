"""Adapter-only updates (a LoRA job) against real built-in engines: over the gloo group (two engines, one
bucket or many), over shared memory (ipc, engines in their own processes), and through PEFT directories
(the path engines without the group extension, SGLang, take). Every engine then serves the adapter under
its name with PEFT's greedy tokens, keeps its base weights and base outputs, carries the version; only
the adapter's bytes move. An engine killed mid-publish is dropped and the survivor still gets the adapter;
an engine joining mid-job gets the current adapter before the registry shows it to rollout workers."""

from __future__ import annotations

import copy
import json
import threading

import http_calls
import pytest
import torch
from bus_engines import AUTH, KEY, EngineProcess, engine_weights, version
from prometheus_client import REGISTRY

from generator_fleet.engine import EngineServer
from models.config import LoraSpec
from trainer.lora import peft_name, wrap_lora
from weight_bus import WeightBus

LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], name="policy")
PROMPT = [1, 5, 6, 3, 7, 14]
N = 8
HANG_LIMIT_S = 120.0


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def adapter(base, seed: int):
    """A PEFT model over `base` whose adapter is random (B too), so that it changes greedy outputs."""
    pm = wrap_lora(copy.deepcopy(base), LORA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return pm.eval()


def adapter_tensors(pm) -> list[tuple[str, torch.Tensor]]:
    """What Learner.adapter_tensors yields: PEFT's saved names, the trainable tensors."""
    return [(peft_name(n), p.detach()) for n, p in pm.named_parameters() if p.requires_grad]


def greedy_reference(model) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(N):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(PROMPT) :].tolist()


def greedy(url: str, lora_path: str | None = None) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True},
        **({"lora_path": lora_path} if lora_path else {}),
    }
    r = http_calls.post(url + "/generate", json=body, headers=AUTH, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def refs(model_dir):
    base = _base(model_dir)
    a1, a2 = adapter(base, 11), adapter(base, 12)
    out = {
        "base": greedy_reference(base),
        "a1": adapter_tensors(a1),
        "a2": adapter_tensors(a2),
        "ref1": greedy_reference(a1),
        "ref2": greedy_reference(a2),
        "model_bytes": sum(p.numel() * 4 for p in base.parameters()),
    }
    assert out["ref1"] != out["base"] and out["ref2"] != out["ref1"]  # the adapters matter
    return out


def adapter_bytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


@pytest.fixture(scope="module")
def engines(model_dir):
    servers = [
        EngineServer(str(model_dir), api_key=KEY, torch_threads=1, lora=LORA).start() for _ in range(2)
    ]
    yield servers
    for s in servers:
        s.stop()


def _metric(name: str, labels: dict) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 4096])  # one bucket; many buckets
def test_group_update_sends_only_the_adapter_to_every_engine(engines, refs, bucket_bytes):
    urls = [s.url for s in engines]
    base_weights = [engine_weights(s) for s in engines]
    updates0 = _metric("slipstream_bus_adapter_updates_total", {"backend": "gloo", "path": "group"})
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=bucket_bytes, lora=LORA)
    bus.connect()
    try:
        stats = bus.publish(iter(refs["a1"]), version=3)
        assert (stats.adapter, stats.path, stats.kind) == ("policy", "group", "adapter")
        assert stats.bytes == adapter_bytes(refs["a1"]) < refs["model_bytes"] / 10
        assert stats.buckets > 1 if bucket_bytes == 4096 else stats.buckets == 1
        assert sorted(stats.engines) == sorted(urls)
        for s, before in zip(engines, base_weights, strict=True):
            assert version(s.url) == "3"
            assert greedy(s.url, "policy") == refs["ref1"]
            assert greedy(s.url) == refs["base"]  # the base model is untouched
            after = engine_weights(s)
            assert all(torch.equal(after[k], v) for k, v in before.items())
        assert _metric("slipstream_bus_last_update_bytes", {"kind": "adapter"}) == stats.bytes
        assert (
            _metric("slipstream_bus_adapter_updates_total", {"backend": "gloo", "path": "group"})
            == updates0 + 1
        )
        # the next version replaces the adapter in place, streamed as named buckets in one call per engine
        stats = bus.publish(iter(refs["a2"]), version=4)
        assert stats.stream == "named" and stats.adapter == "policy" and not stats.paused
        for u in urls:
            assert version(u) == "4" and greedy(u, "policy") == refs["ref2"]
        stats = bus.publish(iter(refs["a1"]), version=5)  # and back: a streamed update replaces it too
        assert stats.stream == "named"
        for u in urls:
            assert version(u) == "5" and greedy(u, "policy") == refs["ref1"]
            assert greedy(u) == refs["base"]
    finally:
        bus.close()


def test_files_update_writes_peft_directories_and_prunes_them(engines, refs, tmp_path):
    """Engines without the group extension (SGLang) load each version from `<lora_dir>/v<version>`; the
    built-in engines here stand in for them (their members are marked so after connect)."""
    urls = [s.url for s in engines]
    lora_dir = tmp_path / "lora"
    bus = WeightBus(urls, api_key=KEY, backend="gloo", lora=LORA, lora_dir=str(lora_dir))
    bus.connect()
    for e in bus.members.engines:
        e.builtin = False
    try:
        for v, key in ((5, "a1"), (6, "a2"), (7, "a1")):
            stats = bus.publish(iter(refs[key]), version=v)
            assert (stats.path, stats.bytes) == ("files", adapter_bytes(refs[key]))
            for u in urls:
                assert version(u) == str(v)
                assert greedy(u, "policy") == refs["ref1" if key == "a1" else "ref2"]
                assert greedy(u) == refs["base"]
        assert sorted(p.name for p in lora_dir.iterdir()) == ["v6", "v7"]  # older versions pruned
        config = json.loads((lora_dir / "v7" / "adapter_config.json").read_text())
        assert config["r"] == LORA.rank and config["target_modules"] == LORA.target_modules
    finally:
        bus.close()


@pytest.fixture(scope="module")
def lora_procs(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora-engines")
    flags = ["--lora", json.dumps({"rank": LORA.rank, "target_modules": LORA.target_modules})]
    procs = [EngineProcess(model_dir, logs / f"engine-{i}.log", flags) for i in range(3)]
    yield procs
    for p in procs:
        p.kill()


def test_ipc_update_loads_the_adapter_from_shared_memory(lora_procs, refs):
    urls = [p.url for p in lora_procs[:2]]
    bus = WeightBus(urls, api_key=KEY, backend="ipc", bucket_bytes=4096, lora=LORA)
    bus.connect()
    try:
        for v, key, ref in ((1, "a1", "ref1"), (2, "a2", "ref2")):
            stats = bus.publish(iter(refs[key]), version=v)
            # one bucket whatever bucket_bytes says: the LoRA route takes the whole adapter at once
            assert (stats.path, stats.buckets, stats.bytes) == ("ipc", 1, adapter_bytes(refs[key]))
            for u in urls:
                assert version(u) == str(v)
                assert greedy(u, "policy") == refs[ref]
                assert greedy(u) == refs["base"]
    finally:
        bus.close()


def test_engine_killed_mid_adapter_publish_is_dropped_and_the_survivor_gets_it(lora_procs, engines, refs):
    survivor, victim = engines[0], lora_procs[2]
    bus = WeightBus([survivor.url, victim.url], api_key=KEY, bucket_bytes=4096, timeout_s=2.0, lora=LORA)
    bus.connect()
    named = refs["a2"]

    def killing(index: int):
        for i, item in enumerate(named):
            if i == index:
                victim.kill()
            yield item

    out: dict = {}

    def go() -> None:
        try:
            out["stats"] = bus.publish(killing(len(named) // 2), version=9)
        except BaseException as e:
            out["error"] = e

    try:
        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(HANG_LIMIT_S)
        assert not th.is_alive(), "publish hung"
        assert "error" not in out, out.get("error")
        stats = out["stats"]
        assert stats.dropped == [victim.url] and stats.engines == [survivor.url]
        assert version(survivor.url) == "9" and greedy(survivor.url, "policy") == refs["ref2"]
    finally:
        bus.close()


def test_engine_joining_mid_job_gets_the_current_adapter_before_traffic(
    model_dir, engines, refs, redis_client, job_id
):
    """A LoRA engine started mid-job (scale up, replacement) holds no adapter; the next publish admits it
    with the whole current adapter, and only then does the registry show it to rollout workers."""
    from weight_bus.registry import EngineRegistration, EngineRegistry, engines_key

    first = EngineRegistration(redis_client, job_id, engines[0].url)
    late = EngineServer(str(model_dir), api_key=KEY, torch_threads=1, lora=LORA).start()
    registry = EngineRegistry(redis_client, job_id)
    bus = WeightBus([engines[0].url], api_key=KEY, registry=registry, lora=LORA)
    bus.connect()
    joining = None
    try:
        bus.publish(iter(refs["a1"]), version=21)
        joining = EngineRegistration(redis_client, job_id, late.url, joining=True)
        assert registry.live() == [engines[0].url] and registry.joining() == [late.url]
        assert late.runner.lora_adapters() == {}  # nothing to serve rollouts with yet
        stats = bus.publish(iter(refs["a2"]), version=22)
        assert stats.joined == [late.url] and stats.bytes == adapter_bytes(refs["a2"])
        assert sorted(registry.live()) == sorted([engines[0].url, late.url]) and registry.joining() == []
        for u in (engines[0].url, late.url):
            assert version(u) == "22" and greedy(u, "policy") == refs["ref2"]
        assert redis_client.zscore(engines_key(job_id), late.url) is not None
    finally:
        bus.close()
        first.close()
        if joining is not None:
            joining.close()
        late.stop()
