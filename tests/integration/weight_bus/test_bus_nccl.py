"""The weight bus over NCCL between GPUs: the trainer (this process) on GPU 0, built-in engine processes on
the other GPUs, one broadcast group. Bit for bit (fp32 trainer weights into bf16 engines, tied embedding
and LM head, fused q/k/v and gate/up) through the per-bucket first update, streamed arena updates in place
and staged, to two engines at once; an engine that joins mid-job gets the current weights before
traffic; an engine killed mid-stream is dropped and the survivor is made whole by the next update.
Skipped below two GPUs (the GPU machine runs it: `pytest -m gpu tests/integration/weight_bus/test_bus_nccl.py`)."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bus_engines import EngineProcess, noisy_model, publish_bounded, remote_weights, version

from weight_bus import WeightBus
from weight_bus.registry import EngineRegistration, EngineRegistry

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices (NCCL: one rank each)"),
]
KEY = "bus-key"
TIMEOUT_S = 20.0
HANG_LIMIT_S = 240.0
BUCKET_BYTES = 96 * 1024
"""The tiny model (~1 MB in bf16) travels in about a dozen buckets: a kill lands mid-stream."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nccl")
    noisy_model(root / "a", 1)
    return root, [noisy_model(root / f"m{i}", 20 + i) for i in range(6)]


def start(root, tmp_path, gpus: list[int]) -> list[EngineProcess]:
    extra = ["--device", "cuda", "--dtype", "bfloat16"]
    with ThreadPoolExecutor(len(gpus)) as pool:
        return list(
            pool.map(lambda g: EngineProcess(root / "a", tmp_path / f"engine-{g}.log", extra, gpu=g), gpus)
        )


def cuda_weights(model):
    return [(n, p.detach().to("cuda:0")) for n, p in model.named_parameters()]


def assert_holds(url: str, model) -> None:
    want = model.state_dict()  # lm_head.weight is the embedding's tensor (tied)
    got = remote_weights(url, list(want))
    for name, p in want.items():
        assert torch.equal(got[name], p.to(torch.bfloat16).float()), name


def test_two_engines_per_bucket_then_streamed_in_place_and_staged(models, tmp_path):
    torch.cuda.set_device(0)
    root, ms = models
    engines = start(root, tmp_path, list(range(1, min(GPUS, 3))))
    urls = [e.url for e in engines]
    bus = WeightBus(urls, api_key=KEY, backend="nccl", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S)
    try:
        bus.connect()
        for v, m in enumerate(ms[:4], start=1):
            bus.transfer.stage = v == 4
            stats = publish_bounded(bus, cuda_weights(m), v, HANG_LIMIT_S)
            assert stats.stream == ("" if v == 1 else "arena") and stats.staged == (v == 4)
            assert sorted(stats.engines) == sorted(urls) and stats.dropped == []
            for u in urls:
                assert_holds(u, m)
                assert version(u) == str(v)
    finally:
        bus.close()
        for e in engines:
            e.kill()


def test_engine_joining_mid_job_and_engine_killed_mid_stream(models, tmp_path, redis_client, job_id):
    if GPUS < 3:
        pytest.skip("needs three CUDA devices (a trainer and two engines)")
    torch.cuda.set_device(0)
    root, ms = models
    first, late = start(root, tmp_path, [1, 2])
    registrations = [EngineRegistration(redis_client, job_id, first.url)]
    bus = WeightBus(
        [first.url],
        api_key=KEY,
        backend="nccl",
        bucket_bytes=BUCKET_BYTES,
        timeout_s=TIMEOUT_S,
        registry=EngineRegistry(redis_client, job_id),
    )
    try:
        bus.connect()
        publish_bounded(bus, cuda_weights(ms[0]), 1, HANG_LIMIT_S)
        publish_bounded(bus, cuda_weights(ms[1]), 2, HANG_LIMIT_S)
        registrations.append(EngineRegistration(redis_client, job_id, late.url, joining=True))
        stats = publish_bounded(bus, cuda_weights(ms[2]), 3, HANG_LIMIT_S)
        assert stats.joined == [late.url] and stats.stream == "arena"
        for u in (first.url, late.url):
            assert_holds(u, ms[2])
            assert version(u) == "3"

        weights = cuda_weights(ms[3])

        def killing():
            for i, (name, p) in enumerate(weights):
                if i == len(weights) // 2:
                    late.kill(signal.SIGKILL)
                yield name, p

        stats = publish_bounded(bus, killing(), 4, HANG_LIMIT_S)
        assert late.url in stats.dropped and stats.stream == "arena"
        stats = publish_bounded(bus, cuda_weights(ms[4]), 5, HANG_LIMIT_S)
        assert stats.engines == [first.url]
        assert_holds(first.url, ms[4])
        assert version(first.url) == "5"
    finally:
        bus.close()
        for r in registrations:
            r.close()
        first.kill()
        late.kill()
