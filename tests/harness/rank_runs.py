"""The trainer's one-rank-then-two-ranks harness: a test module's `worker(rank, world, port, model_dir,
out, resume)` runs on one rank (it writes `ckpt-1` under `out`), then on two ranks resuming from that
checkpoint, each run in fresh processes (torch.multiprocessing, spawn; a gloo group on a free port); the
workers leave `record-<tag...>.json` files that the tests compare."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

from common.net import free_port


def spawn_ranks(worker, world: int, model_dir, out, resume: str | None = None) -> None:
    mp.start_processes(
        worker,
        args=(world, free_port(), str(model_dir), str(out), resume),
        nprocs=world,
        join=True,
        start_method="spawn",
    )


def one_then_two_ranks(worker, model_dir, out: Path) -> Path:
    """`worker` on one rank, then on two ranks resuming from the one-rank run's `ckpt-1`; returns `out`."""
    spawn_ranks(worker, 1, model_dir, out)
    spawn_ranks(worker, 2, model_dir, out, resume=str(out / "ckpt-1"))
    return out


def read_record(out: Path, *tag) -> dict:
    """The record a worker wrote as record-<tag parts joined by '-'>.json."""
    return json.loads((out / f"record-{'-'.join(map(str, tag))}.json").read_text())
