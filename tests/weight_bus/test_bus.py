"""WeightBus (trainer side) against real built-in engines over HTTP + gloo: a publish swaps the weights of
every engine, tags the version, and leaves the engines generating."""

import httpx
import pytest
import torch

from generator_fleet.engine import EngineServer
from generator_fleet.tasks.arith import ALPHABET, ArithTask
from trainer.tiny_model import build
from weight_bus import BusError, WeightBus

KEY = "bus-key"
PROMPT = [1, 5, 6, 3, 7, 14]


def _greedy(url: str) -> list[int]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


def _noisy_model(path, seed):
    model, _ = build(path, ALPHABET, [p.prompt + str(p.answer) for p in ArithTask().problems], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # large random weights so two models' greedy outputs differ
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("bus")
    model_a = _noisy_model(root / "a", 1)
    model_a.save_pretrained(root / "a")
    servers = [EngineServer(str(root / "a"), api_key=KEY, torch_threads=1).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.mark.parametrize("bucket_bytes, seed", [(1 << 30, 2), (64 * 1024, 3)])  # one bucket; many buckets
def test_publish_swaps_weights_on_every_engine(engines, tmp_path, bucket_bytes, seed):
    servers = engines
    model_b = _noisy_model(tmp_path / "b", seed)  # differs from whatever the engines hold now
    urls = [s.url for s in servers]
    before = [_greedy(u) for u in urls]
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=bucket_bytes)
    bus.connect()
    try:
        stats = bus.publish(list(model_b.named_parameters()), version=7)
        assert stats.version == 7 and stats.bytes == sum(p.numel() * 4 for p in model_b.parameters())
        assert stats.buckets >= (2 if bucket_bytes < 1 << 20 else 1)
        assert 0 < stats.transfer_s <= stats.pause_s
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            for _ in range(8):
                ids = torch.cat([ids, model_b(ids).logits[:, -1:].argmax(-1)], dim=1)
        expected = ids[0, len(PROMPT) :].tolist()
        after = [_greedy(u) for u in urls]
        assert after == [expected, expected] and after != before
        for u in urls:
            info = httpx.get(u + "/get_model_info", headers={"Authorization": f"Bearer {KEY}"}).json()
            assert info["weight_version"] == "7"
            assert not httpx.get(u + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"}).json()[
                "internal_states"
            ][0]["paused"]
    finally:
        bus.close()
        for s in servers:
            httpx.post(
                s.url + "/destroy_weights_update_group", json={}, headers={"Authorization": f"Bearer {KEY}"}
            )


def test_unknown_parameter_fails_loudly_and_engines_keep_serving(engines):
    servers = engines
    urls = [s.url for s in servers]
    bus = WeightBus(urls, api_key=KEY, backend="gloo")
    bus.connect()
    try:
        with pytest.raises(BusError, match="unknown parameter"):
            bus.publish([("no.such.weight", torch.zeros(3))], version=99)
        assert all(len(_greedy(u)) == 8 for u in urls)  # continued after the failed swap
    finally:
        bus.close()
        for s in servers:
            httpx.post(
                s.url + "/destroy_weights_update_group", json={}, headers={"Authorization": f"Bearer {KEY}"}
            )


def test_wrong_token_is_refused(engines):
    servers = engines
    bus = WeightBus([servers[0].url], api_key="wrong", backend="gloo", timeout_s=10)
    with pytest.raises(BusError, match="401"):
        bus.connect()
    bus.close()
