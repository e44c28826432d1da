"""The base of every config section: msgspec Structs that refuse unknown keys, the bounded number types
they share, and the caps on counts, durations and spec size.

Each component's config (trainer/config.py, replay_buffer/config.py, weight_bus/config.py,
generator_fleet/config.py, models/config.py) builds on this; jobspec/ composes the sections into one
job spec and reports a failed check at its key path.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_POOL = 4096
"""Most engines, rollout workers or trainer ranks a job may ask for, at submit and in a scale request:
more than a cluster's GPUs, so a bigger number is a typo (or a fuzzer), not a plan."""
MAX_COUNT = 1_000_000_000
"""Upper bound of every other count (steps, groups, tokens, problems, milliseconds)."""
MAX_TIMEOUT_S = 86_400.0
"""Upper bound of every duration in seconds (a day): longer is a typo, and some (torch.distributed's
timedelta) overflow."""
MAX_SPEC_BYTES = 1 << 20
"""Largest spec text (UTF-8 bytes) parsed; a job spec is a few kB."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a spec (and in an override's value)."""
MAX_GROUPS_PER_STEP = 65_536
"""Most prompt groups one trainer step may ask for: a step's samples are held at once by the trainer and
the buffer, and the largest published recipes use a few thousand; more is a typo."""
MAX_NEW_TOKENS = 131_072
"""Most tokens one response (or one eval answer) may ask for: the longest context of the models the
project serves (128k); the engine still stops at the model's own context, this catches typos at submit."""

Pos = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
NewTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Pool = Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)]
Prob = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base: unknown keys are errors."""


def bad(key: str, msg: str) -> ValueError:
    """A section's own check (`__post_init__`) failed on `key`; the job spec's loader reports it at the
    key's path (`$.generators.urls[0]`)."""
    return ValueError(f"{msg} - at `.{key}`")
