"""The job spec: every component's config section composed into one `JobSpec`, the checks that span
sections, the one rule for relative paths (`resolve_paths`) and the saved JSON form (`to_json`).

Each section lives beside the component that uses it (models/, generator_fleet/, trainer/,
replay_buffer/, weight_bus/ `config.py`); a process is handed only the sections it uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from common.config import Spec, bad
from generator_fleet.config import (
    AgentSpec,
    DatasetSpec,
    GeneratorsSpec,
    RewardSpec,
    RolloutConfig,
    RolloutSpec,
)
from generator_fleet.tools.spec import ToolSpec
from jobspec.tracking import TrackingSpec
from models.config import ModelSpec
from replay_buffer.config import BufferSpec, RedisSpec
from trainer.config import AlgorithmSpec, TrainerConfig, TrainerSpec
from weight_bus.config import BusSpec


class JobSpecError(ValueError):
    """Invalid job spec; the message carries the path of the bad key (`$.algorithm.lr`)."""


class JobSpec(Spec):
    name: str = "demo"
    """Job id; namespaces every Redis key (`slipstream:{name}:...`)."""
    output_dir: str = "runs/demo"
    """Where the final model, metrics and plots are written. A submitted job's is always its own
    directory, $SLIPSTREAM_HOME/jobs/<name>: a relative value is ignored, an absolute one must lie
    inside it (else the submit is refused); `slipstream run` writes where it says."""
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    dataset: DatasetSpec = msgspec.field(default_factory=DatasetSpec)
    reward: RewardSpec = msgspec.field(default_factory=RewardSpec)
    agent: AgentSpec | None = None
    """Multi-turn tool-using episodes; null = one model turn per sample."""
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    rollout: RolloutSpec = msgspec.field(default_factory=RolloutSpec)
    generators: GeneratorsSpec = msgspec.field(default_factory=GeneratorsSpec)
    algorithm: AlgorithmSpec = msgspec.field(default_factory=AlgorithmSpec)
    buffer: BufferSpec = msgspec.field(default_factory=BufferSpec)
    trainer: TrainerSpec = msgspec.field(default_factory=TrainerSpec)
    bus: BusSpec = msgspec.field(default_factory=BusSpec)
    redis: RedisSpec = msgspec.field(default_factory=RedisSpec)
    tracking: TrackingSpec = msgspec.field(default_factory=TrackingSpec)
    """Experiment tracking: TensorBoard (on) and W&B (off) in the job's output_dir."""

    @property
    def response_budget(self) -> int:
        """Response tokens one sample may have."""
        return self.agent.max_total_tokens if self.agent is not None else self.rollout.sampling.max_new_tokens

    def trainer_config(self) -> TrainerConfig:
        """The sections a trainer rank uses."""
        budget = self.response_budget
        return TrainerConfig(
            name=self.name,
            output_dir=self.output_dir,
            model=self.model,
            algorithm=self.algorithm,
            trainer=self.trainer,
            buffer=self.buffer,
            bus=self.bus,
            response_budget=budget,
        )

    def rollout_config(self) -> RolloutConfig:
        """The sections a rollout worker uses."""
        return RolloutConfig(
            name=self.name,
            output_dir=self.output_dir,
            model=self.model,
            dataset=self.dataset,
            reward=self.reward,
            agent=self.agent,
            tools=self.tools,
            rollout=self.rollout,
            buffer=self.buffer,
            groups_per_step=self.algorithm.groups_per_step,
            response_budget=self.response_budget,
        )

    def __post_init__(self) -> None:
        if self.reward.overlong_buffer_len > self.response_budget:
            raise bad(
                "reward.overlong_buffer_len",
                f"{self.reward.overlong_buffer_len} exceeds the response budget {self.response_budget}",
            )
        if self.tools and self.agent is None:
            raise bad("tools", "tools are only offered to a model in agent episodes: set `agent:` too")
        if self.bus.update_every - 1 > self.buffer.max_staleness:
            # engines lag the trainer by up to update_every - 1 versions; data they make would be too stale
            raise bad(
                "bus.update_every",
                f"{self.bus.update_every} needs buffer.max_staleness >= {self.bus.update_every - 1} "
                f"(it is {self.buffer.max_staleness}): engines lag up to update_every - 1 versions",
            )


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
"""The source tree's example specs: a model is never built in here."""


def resolve_paths(spec: JobSpec, base: str | Path) -> JobSpec:
    """The one rule for relative paths, in `run`, `validate` and `submit` alike: relative to `base`, the
    working directory of the command (not the spec file's directory). Resolves model.path,
    dataset.path, the reference and critic models, trainer.resume_from (unless `latest`) and
    output_dir; a relative trainer.checkpoint_dir is under output_dir. Refuses a model.build target
    inside the source tree's examples/."""
    base = Path(base)

    def rel(p: str | None) -> str | None:
        return None if p is None else str((base / p).resolve())

    s = spec
    out = rel(s.output_dir)
    tr = s.trainer
    tr = msgspec.structs.replace(
        tr,
        checkpoint_dir=None if tr.checkpoint_dir is None else str((Path(out) / tr.checkpoint_dir).resolve()),
        resume_from=tr.resume_from if tr.resume_from in (None, "latest") else rel(tr.resume_from),
    )
    model = msgspec.structs.replace(s.model, path=rel(s.model.path))
    if model.build is not None and Path(model.path).is_relative_to(EXAMPLES_DIR):
        raise JobSpecError(
            f"invalid job spec: model.build would write into the source tree's examples/ ({model.path}); "
            "run from the project root or give model.path under runs/ - at `$.model.path`"
        )
    alg = msgspec.structs.replace(
        s.algorithm,
        ref_model_path=rel(s.algorithm.ref_model_path),
        critic_model_path=rel(s.algorithm.critic_model_path),
    )
    return msgspec.structs.replace(
        s,
        model=model,
        dataset=msgspec.structs.replace(s.dataset, path=rel(s.dataset.path)),
        algorithm=alg,
        trainer=tr,
        output_dir=out,
    )


def to_json(spec: JobSpec) -> str:
    """Resolved spec as JSON (nulls survive a round trip); saved with every run."""
    return json.dumps(msgspec.to_builtins(spec), indent=2)
