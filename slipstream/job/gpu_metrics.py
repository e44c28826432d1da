"""GPU utilisation and memory of the GPUs a process was given, read at scrape time: NVML (`pynvml`, from
nvidia-ml-py) when importable, else `nvidia-smi`. Registered by every job process that sees a GPU
(slipstream/job/actors.py); a CPU-only process exports none of these series.

    slipstream_gpu_utilization_ratio{gpu}      fraction of the last sample period a kernel ran (0..1)
    slipstream_gpu_memory_used_bytes{gpu}      device memory in use (all processes)
    slipstream_gpu_memory_total_bytes{gpu}
    slipstream_gpu_process_allocated_bytes{gpu}  this process's tensors (torch's caching allocator)

`gpu` is the physical index (CUDA_VISIBLE_DEVICES maps the process's device 0, 1, ... to it).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import time

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

DEVICE_FILES = "/dev/nvidia[0-9]*"
"""The NVIDIA driver's per-GPU device files: none on a machine without NVIDIA GPUs."""
CACHE_S = 2.0
"""nvidia-smi takes ~50 ms: one reading serves every scrape within this window."""
METRICS = (
    "slipstream_gpu_utilization_ratio",
    "slipstream_gpu_memory_used_bytes",
    "slipstream_gpu_memory_total_bytes",
    "slipstream_gpu_process_allocated_bytes",
)


def visible_gpus() -> list[int]:
    """Physical indices of the GPUs this process may use ([] on a CPU-only process). A machine without
    NVIDIA device files has none: answered without importing torch (a rollout worker never needs it)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip() == "":  # Ray's setting for an actor given no GPU
        return []
    if "torch" not in sys.modules and not glob.glob(DEVICE_FILES):
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        n = torch.cuda.device_count()
    except Exception:  # no torch CUDA runtime at all
        return []
    if env is None:
        return list(range(n))
    ids = [x.strip() for x in env.split(",") if x.strip()]
    return [int(x) for x in ids[:n] if x.isdigit()] or list(range(n))


def _read_nvml(gpus: list[int]) -> dict[int, tuple[float, float, float]]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    out = {}
    for g in gpus:
        h = pynvml.nvmlDeviceGetHandleByIndex(g)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out[g] = (pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, float(mem.used), float(mem.total))
    return out


def _read_smi(gpus: list[int]) -> dict[int, tuple[float, float, float]]:
    text = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,utilization.gpu,memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    out = {}
    for line in text.strip().splitlines():
        idx, util, used, total = (x.strip() for x in line.split(","))
        if int(idx) in gpus:
            out[int(idx)] = (float(util) / 100.0, float(used) * 2**20, float(total) * 2**20)
    return out


class GPUCollector(Collector):
    def __init__(self, gpus: list[int]) -> None:
        self.gpus = gpus
        self._cache: tuple[float, dict] = (0.0, {})
        self._reader = None

    def _read(self) -> dict[int, tuple[float, float, float]]:
        at, cached = self._cache
        if time.monotonic() - at < CACHE_S:
            return cached
        readers = [self._reader] if self._reader else [_read_nvml, _read_smi]
        for reader in readers:
            try:
                values = reader(self.gpus)
            except Exception as e:  # NVML missing or refused: try nvidia-smi; both failing: no series
                log.debug("gpu metrics: %s failed: %s", reader.__name__, e)
                continue
            self._reader = reader
            self._cache = (time.monotonic(), values)
            return values
        return {}

    def collect(self):
        util = GaugeMetricFamily(
            METRICS[0], "GPU utilisation (fraction of time a kernel ran)", labels=["gpu"]
        )
        used = GaugeMetricFamily(METRICS[1], "GPU memory in use, all processes", labels=["gpu"])
        total = GaugeMetricFamily(METRICS[2], "GPU memory size", labels=["gpu"])
        mine = GaugeMetricFamily(METRICS[3], "GPU memory held by this process's tensors", labels=["gpu"])
        for g, (u, m_used, m_total) in sorted(self._read().items()):
            util.add_metric([str(g)], u)
            used.add_metric([str(g)], m_used)
            total.add_metric([str(g)], m_total)
        try:
            import torch

            for local, g in enumerate(self.gpus):
                mine.add_metric([str(g)], float(torch.cuda.memory_allocated(local)))
        except Exception as e:
            log.debug("gpu metrics: torch allocator: %s", e)
        yield from (util, used, total, mine)


def register(registry=None) -> list[int]:
    """Export the GPU gauges of this process's GPUs (nothing on a CPU-only process); returns them."""
    gpus = visible_gpus()
    if not gpus:
        return []
    if not (shutil.which("nvidia-smi") or _has_nvml()):
        log.info("gpu metrics: neither NVML nor nvidia-smi here; GPU gauges not exported")
        return []
    from prometheus_client import REGISTRY

    (registry or REGISTRY).register(GPUCollector(gpus))
    log.info("gpu metrics: exporting GPUs %s", gpus)
    return gpus


def _has_nvml() -> bool:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return False
    return True
