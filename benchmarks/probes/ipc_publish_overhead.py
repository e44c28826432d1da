"""Probe (colocated publish): what a steady-state direct IPC publish costs outside the copy itself.
A narrow Qwen2-shaped model with the Qwen2.5-1.5B shape's tensor count (28 layers: 338 tensors, 3.6 MB),
bf16, handed to a built-in engine process 300 times after 20 untimed (CPU: over shared memory; `--device
cuda`: by CUDA IPC, on GPU 0); prints the median publish, the trainer's match of its kept payload
(`gather`), the engine's phases and, as the floor of any call, the median round trip of a GET
/get_weight_version on one kept-alive connection. The copy is negligible at this size, so what it times
is the per-tensor and per-call work of both sides; `--shape qwen2.5-1.5b-shape` times the copy with it.
Seen on nvidia-h200, 2026-11-25 (`--device cuda`): narrow, publish 0.94 ms, GET round trip 0.20 ms;
`--shape qwen2.5-1.5b-shape`, publish 2.21 ms.
Compare two checkouts side by side: `ROOT=<checkout> PYTHONPATH=<checkout> python <this file>` for each.
Seen on a 2-core CPU box, 2026-11-24, three alternating runs of each checkout: before payload references
and the identity match, publish 3.92-4.98 ms (median per run), the trainer's match (gather) 0.66-0.81 ms;
after, publish 2.66-2.87 ms, gather 0.14-0.15 ms.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

sys.path.insert(0, os.environ.get("ROOT") or str(Path(__file__).resolve().parents[2]))
from benchmarks import shapes  # noqa: E402

# the tiny shape's narrow layers, as many as the 1.5B shape's, and a small vocabulary
shapes.SHAPES["narrow-28-layers"] = {**shapes.SHAPES["tiny"], "num_hidden_layers": 28, "vocab_size": 1024}
from benchmarks import weight_bus as wb  # noqa: E402
from weight_bus import WeightBus  # noqa: E402


def round_trip_ms(url: str, n: int = 300) -> float:
    """Median of `n` GET /get_weight_version round trips on one kept-alive connection."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    headers = {"Authorization": f"Bearer {wb.API_KEY}"}
    times = []
    for _ in range(n + 20):
        t0 = time.perf_counter()
        conn.request("GET", "/get_weight_version", headers=headers)
        conn.getresponse().read()
        times.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(times[20:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--shape", default="narrow-28-layers", help="a benchmarks/shapes.py shape (default: narrow)"
    )
    args = p.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    params = wb.trainer_weights(args.shape, device, 0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = wb.model_dir(tmp / "m", args.shape)
        engine = wb.EngineProcess(
            argparse.Namespace(device=device.type), model, tmp / "engine.log", device.index
        )
        engine.wait_ready()
        bus = WeightBus([engine.url], api_key=wb.API_KEY, backend="ipc", bucket_bytes=1 << 30, device=device)
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
                f"gather median {statistics.median(gathers):.3f} ms; engine {wb.engine_phases(engine.url)}; "
                f"GET round trip median {round_trip_ms(engine.url):.3f} ms",
                flush=True,
            )
        finally:
            bus.close()
            engine.stop()


if __name__ == "__main__":
    main()
