"""Probe (colocated publish): how fast can an engine copy a whole weight update out of the trainer's
tensors? Times, on one GPU with CUDA events, the three ways for the Qwen2.5-1.5B shape's 338 bf16 tensors
(3.09 GB): one `copy_` of a flat buffer of the same bytes (the colocated benchmark's yardstick),
`torch._foreach_copy_` over the tensors (the engine's copy where the kernel cannot go), and the
engine's one-kernel copy (generator_fleet/engine/multi_copy.py) at its default launch shape and a few
others (words per chunk x warps). Prints the median of 20 of each.
Seen on nvidia-h200, 2026-11-25: flat copy_ 1.449 ms, _foreach_copy_ 2.215 ms, the kernel 1.508-1.554 ms
over these launch shapes (1.516 ms at the default 8192 x 8; 32768 x 16 took 8.5 ms).
Run: python benchmarks/probes/weight_copy.py [shape]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.weight_bus import trainer_weights  # noqa: E402
from generator_fleet.engine.multi_copy import BLOCK, NUM_WARPS, MultiCopy  # noqa: E402
from weight_bus.ipc import NamedTensors  # noqa: E402

SHAPES = [(BLOCK, NUM_WARPS), (4096, 4), (8192, 4), (16384, 8), (16384, 16)]


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
    results = {
        "flat copy_": timed(lambda: flat_dst.copy_(flat_src)),
        "_foreach_copy_": timed(lambda: torch._foreach_copy_(dst, src)),
    }
    pairs = NamedTensors(zip(names, src, strict=True))  # as a kept payload: the plan matched at once
    for block, warps in SHAPES:
        mc = MultiCopy(enabled=True, block=block, num_warps=warps)
        for d in dst:
            d.zero_()
        results[f"kernel {block}x{warps}"] = timed(lambda mc=mc: mc.copy(pairs, lambda _: dst))
        assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
        print(f"kernel {block}x{warps}: {mc.plan.chunks} chunks, {len(mc.plan.rest)} tensors by foreach")
    print(f"{shape}: {len(src)} tensors, {nbytes / 1e9:.2f} GB")
    for k, ms in results.items():
        print(f"{k:>18}: {ms:.3f} ms = {2 * nbytes / ms / 1e6:.0f} GB/s (read + write)", flush=True)


if __name__ == "__main__":
    main()
