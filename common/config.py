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
RayResources = dict[
    Annotated[str, msgspec.Meta(min_length=1, max_length=256)],
    Annotated[float, msgspec.Meta(gt=0, le=MAX_COUNT)],
]
"""Ray custom resources an actor requests (name -> amount), e.g. `{node_b: 0.01}` on a node started with
`ray start --resources '{"node_b": 1}'`, or Ray's own `{"node:10.0.0.2": 0.01}` (every node has one
`node:<its IP>`)."""
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray sizes from other options (num_cpus, num_gpus): refused in a `resources` mapping."""


class Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base: unknown keys are errors."""


def check_resources(key: str, resources: dict[str, float]) -> None:
    """A `resources` mapping names custom resources only (Ray refuses CPU and GPU there: they have
    options of their own)."""
    for name in resources:
        if name in RAY_BUILTIN_RESOURCES:
            raise bad(
                f"{key}.{name}",
                f"{name} is set by its own option (cpus_per_engine, gpus_per_engine, trainer.device), "
                "not as a custom resource",
            )


def bad(key: str, msg: str) -> ValueError:
    """A section's own check (`__post_init__`) failed on `key`; the job spec's loader reports it at the
    key's path (`$.generators.urls[0]`)."""
    return ValueError(f"{msg} - at `.{key}`")
