"""The trainer's one-rank-then-two-ranks harness: a test module's `worker(rank, world, port, model_dir,
out, resume)` runs on one rank (it writes `ckpt-1` under `out`), then on two ranks resuming from that
checkpoint, each run in fresh processes (a gloo group on a free port); the workers leave
`record-<tag...>.json` files that the tests compare.

The rank processes are forked from one fork server per test process (multiprocessing's `forkserver`) that
imported torch, transformers and the trainer once: each rank then starts in a fraction of a second instead
of importing them again (several CPU-seconds each). Like `spawn`, a fork server's child shares no state
with the test process; unlike it, a child gets the environment the fork server started with, so a worker
sets what it needs itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch.multiprocessing as mp

from common.net import free_port

PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers.models.qwen2.modeling_qwen2",  # the tiny test models are Qwen2s
    "trainer.learner",
    "trainer.checkpoint",
    "generator_fleet.engine.__main__",  # bus_engines.ForkedEngine: engines that can really die
    "generator_fleet.engine.serve",
)
"""What the fork server imports once for every process it forks (rank processes, engine processes)."""


def rank_context():
    """The multiprocessing context rank and engine processes start in: the fork server, preloaded (one
    per test process, started by the first process forked; its preload is fixed from then on)."""
    mp.set_forkserver_preload(list(PRELOAD))
    return mp.get_context("forkserver")


def start_ranks(worker, args: tuple, nprocs: int) -> None:
    """`worker(rank, *args)` in `nprocs` fresh processes forked by the preloaded fork server; waits for all
    (a rank's exception is raised here)."""
    rank_context()
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def spawn_ranks(worker, world: int, model_dir, out, resume: str | None = None) -> None:
    start_ranks(worker, (world, free_port(), str(model_dir), str(out), resume), world)


def one_then_two_ranks(worker, model_dir, out: Path) -> Path:
    """`worker` on one rank, then on two ranks resuming from the one-rank run's `ckpt-1`; returns `out`."""
    spawn_ranks(worker, 1, model_dir, out)
    spawn_ranks(worker, 2, model_dir, out, resume=str(out / "ckpt-1"))
    return out


def read_record(out: Path, *tag) -> dict:
    """The record a worker wrote as record-<tag parts joined by '-'>.json."""
    return json.loads((out / f"record-{'-'.join(map(str, tag))}.json").read_text())
