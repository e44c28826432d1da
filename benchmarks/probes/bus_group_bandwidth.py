"""Probe (weight bus bandwidth): is the weight bus's own NCCL group slower than torch.distributed's default group?

Two processes (GPU 0 sends, GPU 1 receives). Each times 30 sequential broadcasts of 512 MiB buckets
(the bus's default bucket size, the 7B-shape volume), once over the default group from
init_process_group and once over weight_bus.group.new_group (stateless TCPStore + ProcessGroupNCCL),
with and without a fresh receive buffer per bucket and a copy out of it (what the engine does).
Run on a 2-GPU host: python benchmarks/probes/bus_group_bandwidth.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.net import free_port
from weight_bus.group import broadcast_async, new_group  # noqa: E402

BUCKET = 512 << 20
N = 30


def run(rank: int, port_a: int, port_b: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port_a}", rank=rank, world_size=2)
    own = new_group("127.0.0.1", port_b, rank, 2, "nccl", "probe")
    bufs = [torch.empty(BUCKET, dtype=torch.uint8, device="cuda") for _ in range(2)]
    sink = torch.empty(BUCKET, dtype=torch.uint8, device="cuda")

    def default_group(i):
        dist.broadcast(bufs[i % 2], 0)

    def own_group(i):
        broadcast_async(own, bufs[i % 2]).wait()

    def own_fresh_copy(i):  # engine-like: fresh buffer per bucket, copy out after the receive
        b = bufs[i % 2] if rank == 0 else torch.empty(BUCKET, dtype=torch.uint8, device="cuda")
        broadcast_async(own, b).wait()
        if rank == 1:
            sink.copy_(b)

    for name, fn in (
        ("default group", default_group),
        ("bus group", own_group),
        ("bus group + fresh buf + copy", own_fresh_copy),
    ):
        for _ in range(3):
            fn(0)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(N):
            fn(i)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            print(
                f"{name:32s} {N} x 512 MiB: {dt * 1e3:7.1f} ms  {N * BUCKET / dt / 1e9:6.1f} GB/s", flush=True
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(run, args=(free_port(), free_port()), nprocs=2)
