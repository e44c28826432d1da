"""Probe: what slows a streamed weight update's wire below one raw NCCL broadcast. Two processes (rank 0
on GPU 0, rank 1 on GPU 1), one NCCL group (weight_bus.group), `--gib` of bytes in `--bucket-mb` buckets,
each variant timed on rank 0 from a barrier to its last broadcast done, median of `--repeats`:

  raw       one broadcast of the whole buffer
  chunked   back-to-back broadcasts of bucket-sized slices (receiver posts all at once)
  packed    each bucket copied from a source buffer into one of 4 reused slots (one copy_), then
            broadcast; the next bucket is packed while earlier ones are on the wire (at most 3 unfinished)
  foreach   as packed, each bucket's copy split into 12 tensors through torch._foreach_copy_
  side      as foreach, the copies on a side stream the broadcast waits on by event

  python benchmarks/probes/stream_wire.py --gib 14 --bucket-mb 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

VARIANTS = ("raw", "chunked", "packed", "foreach", "side")


def run(rank: int, args: argparse.Namespace, port: int, out) -> None:
    from weight_bus.group import broadcast_async, new_group

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    group = new_group("127.0.0.1", port, rank, 2, "nccl", "probe", timeout_s=300)
    n = int(args.gib * 2**30)
    step = args.bucket_mb * 2**20
    buf = torch.empty(n, dtype=torch.uint8, device=dev)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev) if rank == 0 else None
    slots = [torch.empty(step, dtype=torch.uint8, device=dev) for _ in range(4)] if rank == 0 else []
    side = torch.cuda.Stream(dev)
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats + 1):
        for v in VARIANTS:
            t = torch.zeros(1, device=dev)
            group.allreduce([t]).wait()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 1 or v in ("raw", "chunked"):
                size = n if v == "raw" else step
                works = [broadcast_async(group, buf[i : i + size]) for i in range(0, n, size)]
                for w in works:
                    w.wait()
            else:
                works = []
                for k, i in enumerate(range(0, n, step)):
                    while len(works) >= 3:
                        w = works.pop(0)
                        while not w.is_completed():  # on the host, as the bus's sender waits
                            time.sleep(1e-4)
                    slot = slots[k % 4][: min(step, n - i)]
                    part = src[i : i + slot.numel()]
                    if v == "packed":
                        slot.copy_(part)
                    else:
                        pieces = 12
                        cut = slot.numel() // pieces
                        dst = [
                            slot[j * cut : (j + 1) * cut if j < pieces - 1 else None] for j in range(pieces)
                        ]
                        srcs = [
                            part[j * cut : (j + 1) * cut if j < pieces - 1 else None] for j in range(pieces)
                        ]
                        if v == "side":
                            side.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(side):
                                torch._foreach_copy_(dst, srcs)
                            torch.cuda.current_stream().wait_stream(side)
                        else:
                            torch._foreach_copy_(dst, srcs)
                    works.append(broadcast_async(group, slot))
                    while works and works[0].is_completed():
                        works.pop(0)
                for w in works:
                    w.wait()
            torch.cuda.synchronize()
            if r > 0:
                results[v].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({v: statistics.median(x) * 1e3 for v, x in results.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=14.0)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=run, args=(r, args, port, out)) for r in range(2)]
    for pr in procs:
        pr.start()
    res = out.get(timeout=600)
    for pr in procs:
        pr.join(60)
    raw = res["raw"]
    print(
        f"stream wire probe: {args.gib} GiB in {args.bucket_mb} MiB buckets, GPU 0 -> GPU 1, median of {args.repeats}"
    )
    for v, ms in res.items():
        print(f"  {v:8s} {ms:8.2f} ms  {args.gib * 2**30 / ms / 1e6:7.1f} GB/s  {raw / ms:.3f} of raw")


if __name__ == "__main__":
    main()
