"""The trainer's testing hook for the failures a restart does not cure: an out-of-memory step and a full disk
under a checkpoint, injected into a real trainer rank of a real job so that the job's supervision
(slipstream/job/supervise.py) can be seen ending the job instead of looping."""

from __future__ import annotations

import os

import torch

FAULT_ENV = "SLIPSTREAM_TRAINER_INJECT_FAULT"
"""Testing hook, comma-separated `KIND@VERSION` items; unset (production), nothing is injected:

- `oom@V`: rank 0's step that trains version V raises torch.OutOfMemoryError with CUDA's message, every
  time it runs, as a batch too large for the GPU does on each retry (the restarted pool is handed the
  same uncommitted groups);
- `enospc@V`: rank 0's checkpoint at version V fails with a real ENOSPC (a write to /dev/full) after its
  shards are written and before it is complete.

Set it before Ray starts: the job's processes inherit it."""

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.06 GiB is free. (injected: " + FAULT_ENV + ")"
)
"""CUDA's own wording, so that whatever reads it reads what a real one says."""


class Faults:
    """The faults FAULT_ENV asks for (none when it is unset)."""

    def __init__(self, value: str | None) -> None:
        self.items: set[tuple[str, int]] = set()
        for item in (value or "").split(","):
            if not item.strip():
                continue
            kind, _, version = item.strip().partition("@")
            if kind not in ("oom", "enospc") or not version.isdigit():
                raise ValueError(f"{FAULT_ENV}: {item!r} is not oom@VERSION or enospc@VERSION")
            self.items.add((kind, int(version)))

    @classmethod
    def from_env(cls) -> Faults:
        return cls(os.environ.get(FAULT_ENV))

    def step(self, version: int) -> None:
        """Before the step that trains `version`."""
        if ("oom", version) in self.items:
            raise torch.OutOfMemoryError(OOM_MESSAGE)

    def checkpoint(self, version: int) -> None:
        """Inside the checkpoint at `version`, its shards written."""
        if ("enospc", version) in self.items:
            with open("/dev/full", "wb", buffering=0) as f:  # the kernel's own ENOSPC
                f.write(b"\0")
