"""GPU gauges (slipstream/job/gpu_metrics.py): parsing and labelling on any host (nvidia-smi's output given by
a small fake), a CPU-only process exports nothing, and on a GPU host the real readings."""

from __future__ import annotations

import subprocess

import pytest
from metrics_text import sample
from prometheus_client import CollectorRegistry, generate_latest

from slipstream.job import gpu_metrics

SMI = "0, 37, 1024, 81920\n1, 100, 2048, 81920\n"


def _scrape(collector) -> str:
    reg = CollectorRegistry()
    reg.register(collector)
    return generate_latest(reg).decode()


def test_nvidia_smi_readings_for_this_process_gpus_only(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=SMI)

    monkeypatch.setattr(gpu_metrics.subprocess, "run", fake_run)
    c = gpu_metrics.GPUCollector([1])
    c._reader = gpu_metrics._read_smi
    text = _scrape(c)
    assert sample(text, "slipstream_gpu_utilization_ratio", gpu="1") == 1.0
    assert sample(text, "slipstream_gpu_memory_used_bytes", gpu="1") == 2048 * 2**20
    assert sample(text, "slipstream_gpu_memory_total_bytes", gpu="1") == 81920 * 2**20
    assert 'gpu="0"' not in text  # another process's GPU
    _scrape(c)
    assert len(calls) == 1  # the second scrape within CACHE_S reuses the reading


def test_failed_readers_export_no_series(monkeypatch):
    def broken(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(gpu_metrics.subprocess, "run", broken)
    monkeypatch.setattr(gpu_metrics, "_read_nvml", lambda gpus: (_ for _ in ()).throw(ImportError("pynvml")))
    text = _scrape(gpu_metrics.GPUCollector([0]))
    assert "slipstream_gpu_utilization_ratio{" not in text


def test_a_process_given_no_gpu_registers_nothing(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reg = CollectorRegistry()
    assert gpu_metrics.register(reg) == []
    assert "slipstream_gpu" not in generate_latest(reg).decode()


@pytest.mark.skipif(not gpu_metrics.visible_gpus(), reason="needs a GPU (run on the GPU machine)")
def test_real_gpu_readings():
    import torch

    reg = CollectorRegistry()
    gpus = gpu_metrics.register(reg)
    assert gpus
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB of this process's tensors
    torch.cuda.synchronize()
    text = generate_latest(reg).decode()
    lines = {
        ln.split(" ")[0]: float(ln.split(" ")[1])
        for ln in text.splitlines()
        if ln.startswith("slipstream_gpu")
    }
    g = gpus[0]
    util = lines[f'slipstream_gpu_utilization_ratio{{gpu="{g}"}}']
    assert 0.0 <= util <= 1.0
    assert lines[f'slipstream_gpu_memory_total_bytes{{gpu="{g}"}}'] > 1e9
    assert lines[f'slipstream_gpu_memory_used_bytes{{gpu="{g}"}}'] >= 256 * 2**20
    assert lines[f'slipstream_gpu_process_allocated_bytes{{gpu="{g}"}}'] >= 256 * 2**20
    print(f"gpu metrics on GPU {g}: {lines}")
    del x
