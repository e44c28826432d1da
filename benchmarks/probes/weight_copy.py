"""Probe (colocated publish): how fast can an engine copy a whole weight update out of the trainer's
tensors? Times, on one GPU with CUDA events, the three ways for the Qwen2.5-1.5B shape's 338 bf16 tensors
(3.09 GB): one `copy_` of a flat buffer of the same bytes (the colocated benchmark's yardstick),
`torch._foreach_copy_` over the tensors (what the engine did), and the engine's one-kernel copy
(generator_fleet/engine/multi_copy.py). Prints the median of 20 of each.
Run: python benchmarks/probes/weight_copy.py [shape]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.weight_bus import trainer_weights  # noqa: E402
from generator_fleet.engine.multi_copy import MultiCopy  # noqa: E402


def timed(fn, repeats: int = 20) -> float:
    out = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out[2:])


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b-shape"
    named = trainer_weights(shape, torch.device("cuda"), 0)
    src = [t for _, t in named]
    names = [n for n, _ in named]
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    mc = MultiCopy(enabled=True)
    results = {
        "flat copy_": timed(lambda: flat_dst.copy_(flat_src)),
        "_foreach_copy_": timed(lambda: torch._foreach_copy_(dst, src)),
        "multi_copy kernel": timed(lambda: mc.copy(names, dst, src)),
    }
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    print(
        f"{shape}: {len(src)} tensors, {nbytes / 1e9:.2f} GB; plan: {mc.plan.chunks} chunks, {len(mc.plan.rest)} by foreach"
    )
    for k, ms in results.items():
        print(f"{k:>18}: {ms:.3f} ms = {2 * nbytes / ms / 1e6:.0f} GB/s (read + write)", flush=True)


if __name__ == "__main__":
    main()
