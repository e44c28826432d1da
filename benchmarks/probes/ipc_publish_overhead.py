"""Probe (colocated publish, CPU): what a steady-state direct IPC publish costs outside the copy itself.
A narrow Qwen2-shaped model with the Qwen2.5-1.5B shape's tensor count (28 layers: 338 tensors, 3.6 MB),
bf16 on CPU, handed to a built-in engine process over shared memory 300 times after 20 untimed; prints the
median publish, the trainer's match of its kept payload (`gather`) and the engine's phases. The copy is
negligible at this size, so what it times is the per-tensor and per-call work of both sides.
Compare two checkouts side by side: `ROOT=<checkout> PYTHONPATH=<checkout> python <this file>` for each.
Seen on a 2-core CPU box, 2026-11-24, three alternating runs of each checkout: before payload references
and the identity match, publish 3.92-4.98 ms (median per run), the trainer's match (gather) 0.66-0.81 ms;
after, publish 2.66-2.87 ms, gather 0.14-0.15 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("ROOT") or str(Path(__file__).resolve().parents[2]))
from benchmarks import shapes  # noqa: E402

# the tiny shape's narrow layers, as many as the 1.5B shape's, and a small vocabulary
shapes.SHAPES["narrow-28-layers"] = {**shapes.SHAPES["tiny"], "num_hidden_layers": 28, "vocab_size": 1024}
from benchmarks import weight_bus as wb  # noqa: E402
from weight_bus import WeightBus  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    params = wb.trainer_weights("narrow-28-layers", torch.device("cpu"), 0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = wb.model_dir(tmp / "m", "narrow-28-layers")
        engine = wb.EngineProcess(argparse.Namespace(device="cpu"), model, tmp / "engine.log", None)
        engine.wait_ready()
        bus = WeightBus(
            [engine.url], api_key=wb.API_KEY, backend="ipc", bucket_bytes=1 << 30, device=torch.device("cpu")
        )
        try:
            bus.connect()
            for v in range(1, 21):
                bus.publish(iter(params), version=v, persistent=True)
            times, gathers = [], []
            for v in range(21, 321):
                t0 = time.perf_counter()
                s = bus.publish(iter(params), version=v, persistent=True)
                times.append(time.perf_counter() - t0)
                gathers.append(s.gather_ms)
            print(
                f"{len(params)} tensors, {s.handoff}: publish median {statistics.median(times) * 1e3:.3f} ms, "
                f"gather median {statistics.median(gathers):.3f} ms; engine {wb.engine_phases(engine.url)}"
            )
        finally:
            bus.close()
            engine.stop()


if __name__ == "__main__":
    main()
