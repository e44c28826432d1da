"""The weight bus between CUDA tensors: trainer tensors on the GPU, built-in engines on the GPU. The bus
runs over gloo here (gloo broadcasts CUDA tensors through host memory), so one GPU suffices: NCCL refuses
two ranks on one device. What this checks is the engine's CUDA receive path (weight_bus.receiver._Ring:
buckets received into two reused buffers on a side stream while the bucket before is copied into the
weights): bit-for-bit weights over many buckets of varied size, buffers dropped after each update, and a
refused bucket that leaves the group usable. Skipped without CUDA (the GPU machine runs it)."""

import pytest
import torch
from bus_engines import KEY, noisy_model, version

from generator_fleet.engine import EngineServer
from weight_bus import BusError, WeightBus

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engines(model_dir):
    servers = [
        EngineServer(str(model_dir), api_key=KEY, device="cuda", dtype="bfloat16").start() for _ in range(2)
    ]
    yield servers
    for s in servers:
        s.stop()


def _cuda_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().to("cuda")) for n, p in model.named_parameters()]


def _assert_holds(server, model: torch.nn.Module) -> None:
    got = server.runner.model.state_dict()
    for name, p in model.state_dict().items():
        want = p.to(torch.bfloat16)
        assert got[name].device.type == "cuda"
        assert torch.equal(got[name].cpu(), want), name


@pytest.mark.parametrize("bucket_bytes", [1 << 30, 16 * 1024, 200 * 1024])
def test_many_buckets_land_bit_for_bit_and_the_buffers_go_back(engines, tmp_path, bucket_bytes):
    urls = [s.url for s in engines]
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=bucket_bytes, device=torch.device("cuda"))
    bus.connect()
    try:
        for v, seed in ((3, 5), (4, 6)):  # two updates: the second reuses nothing from the first
            model = noisy_model(tmp_path / f"m{v}", seed)
            stats = bus.publish(iter(_cuda_weights(model)), version=v)
            assert sorted(stats.engines) == sorted(urls)
            if bucket_bytes < 1 << 20:
                assert stats.buckets > 4  # slots reused, and regrown for a larger bucket
            torch.cuda.synchronize()
            for s in engines:
                _assert_holds(s, model)
                assert version(s.url) == str(v)
                assert s.app.state.engine.receiver.rings == {}  # dropped with the update's last bucket
    finally:
        bus.close()


def test_a_refused_bucket_leaves_the_group_usable(engines, tmp_path):
    urls = [s.url for s in engines]
    bus = WeightBus(urls, api_key=KEY, backend="gloo", bucket_bytes=64 * 1024, device=torch.device("cuda"))
    bus.connect()
    try:
        with pytest.raises(BusError, match="unknown parameter"):
            bus.publish(iter([("no.such.weight", torch.zeros(3, device="cuda"))]), version=98)
        assert all(
            not s.app.state.engine.receiver.broken for s in engines
        )  # the bytes arrived; only the load refused
        model = noisy_model(tmp_path / "m", 9)
        stats = bus.publish(iter(_cuda_weights(model)), version=99)
        assert sorted(stats.engines) == sorted(urls)  # (the bus may rebuild its group after a refusal)
        torch.cuda.synchronize()
        for s in engines:
            _assert_holds(s, model)
    finally:
        bus.close()
