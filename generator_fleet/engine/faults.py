"""Fatal CUDA errors: which failures leave the engine's process unusable (it then reports unhealthy and
stops), the testing hook that injects one, and the one that slows every generation step down."""

from __future__ import annotations

import os

import torch

FAULT_ENV = "SLIPSTREAM_ENGINE_INJECT_FAULT"
"""Testing hook: when set, the runner's first generation step raises RuntimeError(its value), as a real
CUDA fault would (e.g. "CUDA error: an illegal memory access was encountered"). A value "@PATH" names a
file instead: the first step of any engine after the file appears takes it (one engine of a job wins)
and raises its text; unset (production), the runner never looks."""

STEP_DELAY_ENV = "SLIPSTREAM_ENGINE_STEP_DELAY_S"
"""Testing hook: seconds the generation thread waits after each step, as on a slower device; unset
(production) or 0, none. The test suite's jobs that train until the test stops them (`total_steps`
far away) run with it: unpaced, a tiny job takes as many steps as the cores allow (30 a second on an
idle 2-core box), and the cores it takes are the other tests' (the suite runs three at a time)."""


def step_delay_s() -> float:
    """STEP_DELAY_ENV's seconds (0.0 when unset); a value that is not a number of seconds from 0 to 10
    fails the engine's start with the variable's name."""
    raw = os.environ.get(STEP_DELAY_ENV, "").strip()
    try:
        delay = float(raw or 0)
    except ValueError:
        delay = -1.0
    if not 0 <= delay <= 10:
        raise ValueError(f"{STEP_DELAY_ENV}={raw!r}: seconds from 0 to 10")
    return delay


_FATAL_MARKERS = (
    "CUDA error",
    "CUDA driver error",
    "cudaError",
    "device-side assert",
    "during capture",
    "graph capture",
    "stream is capturing",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "illegal memory access",
    "unspecified launch failure",
)
"""Messages of CUDA failures that leave the process's CUDA context (or torch's capture state) unusable:
sticky errors, device-side asserts, a broken graph capture. Out-of-memory is not one of them."""


class EngineUnhealthy(RuntimeError):
    """The engine hit a fatal CUDA error (the cause is the message) and is going down; a request
    in flight or sent meanwhile fails with this."""


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a CUDA failure after which this process's
    GPU state cannot be trusted: every later kernel, copy or capture may fail or compute garbage."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError):
            return False
        text = str(e)
        if "out of memory" not in text and (
            isinstance(e, getattr(torch, "AcceleratorError", ())) or any(m in text for m in _FATAL_MARKERS)
        ):
            return True
        e = e.__cause__ or e.__context__
    return False
