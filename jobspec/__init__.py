"""Job spec: one YAML file -> msgspec Structs with defaults that run; bad keys fail with their path.

Every field documents its unit. The sections live beside their components (`models.config`,
`generator_fleet.config`, `trainer.config`, `replay_buffer.config`, `weight_bus.config`); `jobspec.spec`
composes them into `JobSpec`, `jobspec.loader` parses, overrides and validates.

May import: common, models, replay_buffer, weight_bus, generator_fleet, trainer (their spec sections).
"""

from common.config import (
    MAX_COUNT,
    MAX_DEPTH,
    MAX_GROUPS_PER_STEP,
    MAX_NEW_TOKENS,
    MAX_POOL,
    MAX_SPEC_BYTES,
    MAX_TIMEOUT_S,
    Spec,
)
from generator_fleet.config import (
    AgentSpec,
    DatasetSpec,
    EvalSpec,
    GeneratorsSpec,
    RewardSpec,
    RolloutSpec,
    SamplingSpec,
    SGLangSpec,
)
from generator_fleet.tools.spec import ToolSpec
from jobspec.loader import apply_overrides, from_dict, load, loads, parse_yaml
from jobspec.spec import EXAMPLES_DIR, JobSpec, JobSpecError, check_context, resolve_paths, to_json
from jobspec.supervision import SupervisionSpec
from jobspec.tracking import TrackingSpec, WandbSpec
from models.config import ModelSpec
from replay_buffer.config import BufferSpec, RedisSpec
from trainer.config import AlgorithmSpec, TrainerSpec
from weight_bus.config import BusSpec

__all__ = [
    "EXAMPLES_DIR",
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_GROUPS_PER_STEP",
    "MAX_NEW_TOKENS",
    "MAX_POOL",
    "MAX_SPEC_BYTES",
    "MAX_TIMEOUT_S",
    "AgentSpec",
    "AlgorithmSpec",
    "BufferSpec",
    "BusSpec",
    "DatasetSpec",
    "EvalSpec",
    "GeneratorsSpec",
    "JobSpec",
    "JobSpecError",
    "ModelSpec",
    "RedisSpec",
    "RewardSpec",
    "RolloutSpec",
    "SGLangSpec",
    "SamplingSpec",
    "Spec",
    "SupervisionSpec",
    "ToolSpec",
    "TrackingSpec",
    "TrainerSpec",
    "WandbSpec",
    "apply_overrides",
    "check_context",
    "from_dict",
    "load",
    "loads",
    "parse_yaml",
    "resolve_paths",
    "to_json",
]


def engine_options(spec: JobSpec):
    """The options each of the job's built-in engines runs with (generator_fleet.config.engine_options)."""
    from generator_fleet.config import engine_options as from_sections

    return from_sections(spec.model, spec.generators)
