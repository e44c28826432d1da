"""Probe (weight bus bandwidth): is packing buckets on the trainer GPU what holds the weight bus back?

Packs Qwen2.5-7B-shaped weights (bf16 already, and fp32 cast to bf16 as an FSDP trainer's gathered
master weights would be) into 512 MiB buckets with weight_bus.packing.pack, timed with CUDA events, no
broadcast. A pack slower than the wire (~1.4 ms per 512 MiB over NVLink on H200) would hold the bus back.
Seen on nvidia-h200-x2, 2026-11-23: bf16 0.26 ms per bucket (1983 GB/s), fp32->bf16 0.38 ms (1331 GB/s),
so no: the bus's ~3.5 ms per bucket is spent elsewhere (see the README's weight-bus notes). Copying
tensors of >= 8 MiB one by one instead of one torch.cat per run made no difference (1951 GB/s).
Run: python benchmarks/probes/bus_pack.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.weight_bus import trainer_weights  # noqa: E402
from weight_bus import packing  # noqa: E402


def time_pack(named, dtype) -> tuple[float, int]:
    for _ in range(2):  # the first round warms the caching allocator
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        n = sum(1 for _ in packing.pack(iter(named), 512 << 20, dtype, torch.device("cuda")))
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end), n


def main() -> None:
    named = trainer_weights("qwen2.5-7b-shape", torch.device("cuda"), 0)
    gib = sum(t.numel() * 2 for _, t in named) / 2**30
    for label, weights in (("bf16", named), ("fp32->bf16", [(n, t.float()) for n, t in named])):
        ms, n = time_pack(weights, torch.bfloat16)
        print(
            f"{label:>11}: {n} buckets, {gib:.2f} GiB in {ms:.1f} ms = {gib * 2**30 / ms / 1e6:.0f} GB/s "
            f"({ms / n:.2f} ms per bucket)",
            flush=True,
        )


if __name__ == "__main__":
    main()
