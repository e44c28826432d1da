"""The job spec: every component's config section composed into one `JobSpec`, the checks that span
sections, the one rule for relative paths (`resolve_paths`) and the saved JSON form (`to_json`).

Each section lives beside the component that uses it (models/, generator_fleet/, trainer/,
replay_buffer/, weight_bus/ `config.py`); a process is handed only the sections it uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import msgspec

from common.config import MAX_GROUPS_PER_STEP, Spec, bad
from common.net import is_local
from generator_fleet.config import (
    AgentSpec,
    DatasetSpec,
    EvalConfig,
    EvalSpec,
    GeneratorsSpec,
    RewardSpec,
    RolloutConfig,
    RolloutSpec,
)
from generator_fleet.tools.spec import ToolSpec
from jobspec.supervision import SupervisionSpec
from jobspec.tracking import TrackingSpec
from models.config import ModelSpec, max_position_embeddings
from replay_buffer.config import BufferSpec, RedisSpec
from trainer.config import AlgorithmSpec, TrainerConfig, TrainerSpec
from weight_bus.config import PLACEMENTS, BusSpec, ColocationSpec, colocated_schedule


class JobSpecError(ValueError):
    """Invalid job spec; the message carries the path of the bad key (`$.algorithm.lr`)."""


NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
"""A job name, matched whole (fullmatch: `$` would also accept a trailing newline)."""
RESERVED_NAMES = {"control"}


def check_name(name: str) -> str | None:
    """Why `name` cannot name a job (it becomes Redis keys and a directory), or None. The one rule:
    `validate`, `run` and `submit` check it in the spec, the control API and job driver on a name given."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        return "lower-case letters, digits, '-' and '_', starting with a letter or digit, at most 63"
    if name in RESERVED_NAMES:
        return f"{name!r} is reserved"
    return None


class JobSpec(Spec):
    name: str = "demo"
    """Job id; namespaces every Redis key (`slipstream:{name}:...`) and names the job's directory:
    lower-case letters, digits, '-' and '_', starting with a letter or digit, at most 63 (`check_name`)."""
    output_dir: str = "runs/demo"
    """Where the final model, metrics and plots are written. A submitted job's is always its own
    directory, $SLIPSTREAM_HOME/jobs/<name>: a relative value is replaced by it (the submit answer says
    so), an absolute one must lie inside it (else the submit is refused); `slipstream run` writes where
    it says."""
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
    eval: EvalSpec | None = None
    """Evaluation on a held-out set during training; null = none."""

    placement: Literal[PLACEMENTS] = "disaggregated"
    """`disaggregated`: engines and trainer ranks on devices of their own, weights sent over the bus's
    gloo/NCCL group. `colocated`: each engine shares a trainer rank's device (its GPU, through a Ray
    placement group; on CPU, the trainer's host), weights handed over in place (`bus.backend: ipc`, the
    default here: CUDA IPC handles, shared memory on CPU); `colocation` says how the two share it."""
    colocation: ColocationSpec = msgspec.field(default_factory=ColocationSpec)
    """The colocated schedule and the engines' memory share (only with `placement: colocated`)."""

    @property
    def schedule(self) -> str | None:
        """A colocated job's schedule (`sync` or `async`: weight_bus.config.colocated_schedule); None
        when disaggregated."""
        if self.placement != "colocated":
            return None
        return colocated_schedule(self.colocation, self.buffer.max_staleness)

    tracking: TrackingSpec = msgspec.field(default_factory=TrackingSpec)
    """Experiment tracking: TensorBoard (on) and W&B (off) in the job's output_dir."""
    supervision: SupervisionSpec = msgspec.field(default_factory=SupervisionSpec)
    """How often a failed process is replaced before the job fails (repeated out-of-memory, disk full)."""

    @property
    def response_budget(self) -> int:
        """Response tokens one sample may have."""
        return self.agent.max_total_tokens if self.agent is not None else self.rollout.sampling.max_new_tokens

    @property
    def trainer_fp32_lm_head(self) -> bool:
        """trainer.fp32_lm_head, its null resolved: the engines' fp32 head (builtin
        `generators.fp32_lm_head`, sglang `generators.sglang.enable_fp32_lm_head`; external: off), off
        with `trainer.mixed_precision: fp32` (the head is fp32 there already)."""
        if self.trainer.fp32_lm_head is not None:
            return self.trainer.fp32_lm_head
        g = self.generators
        if self.trainer.mixed_precision == "fp32":
            return False
        if g.engine == "builtin":
            return g.fp32_lm_head
        return g.engine == "sglang" and g.sglang.enable_fp32_lm_head

    def trainer_config(self) -> TrainerConfig:
        """The sections a trainer rank uses."""
        budget = self.response_budget
        return TrainerConfig(
            name=self.name,
            output_dir=self.output_dir,
            model=self.model,
            algorithm=self.algorithm,
            trainer=msgspec.structs.replace(self.trainer, fp32_lm_head=self.trainer_fp32_lm_head),
            buffer=self.buffer,
            bus=self.bus,
            response_budget=budget,
            schedule=self.schedule,
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
            eval=self.eval,
        )

    def eval_config(self) -> EvalConfig | None:
        """What the evaluator uses; None when the job has no `eval` section."""
        if self.eval is None:
            return None
        return EvalConfig(
            name=self.name,
            output_dir=self.output_dir,
            model=self.model,
            dataset=self.dataset,
            reward=self.reward,
            eval=self.eval,
            max_new_tokens=self.eval.max_new_tokens or self.rollout.sampling.max_new_tokens,
            total_steps=self.algorithm.total_steps,
            agent=self.agent,
            tools=self.tools,
        )

    def __post_init__(self) -> None:
        if why := check_name(self.name):
            raise bad("name", f"job name {self.name!r}: {why}")
        if self.algorithm.groups_per_step > MAX_GROUPS_PER_STEP:
            raise bad(
                "algorithm.groups_per_step",
                f"{self.algorithm.groups_per_step} groups per step is over the maximum {MAX_GROUPS_PER_STEP}",
            )
        samples = self.algorithm.groups_per_step * self.rollout.group_size
        per_rank = samples // self.trainer.num_trainers
        if self.algorithm.ppo_minibatches > max(per_rank, 1):
            raise bad(
                "algorithm.ppo_minibatches",
                f"{self.algorithm.ppo_minibatches} mini-batches exceed the {per_rank} samples per trainer rank "
                f"(groups_per_step {self.algorithm.groups_per_step} x rollout.group_size "
                f"{self.rollout.group_size} / trainer.num_trainers {self.trainer.num_trainers})",
            )
        if self.reward.overlong_buffer_len > self.response_budget:
            raise bad(
                "reward.overlong_buffer_len",
                f"{self.reward.overlong_buffer_len} exceeds the response budget {self.response_budget}",
            )
        if self.rollout.sampling.ignore_eos and self.agent is not None:
            raise bad(
                "rollout.sampling.ignore_eos",
                "single-turn rollouts only: an agent's turns end at EOS (unset it or remove `agent:`)",
            )
        if self.model.lora is not None:
            self._check_lora()
        if self.trainer.export_merged and self.model.lora is None:
            raise bad(
                "trainer.export_merged",
                "only with model.lora: a full fine-tuning's HF export already is the whole model",
            )
        if self.tools and self.agent is None:
            raise bad("tools", "tools are only offered to a model in agent episodes: set `agent:` too")
        if self.agent is not None and self.agent.constrain_tool_calls:
            self._check_call_grammar()
        if self.bus.backend == "ipc":
            check_ipc_engines(self.generators)
        if self.eval is not None:
            self._check_eval(self.eval)
        if self.bus.update_every - 1 > self.buffer.max_staleness:
            # engines lag the trainer by up to update_every - 1 versions; data they make would be too stale
            raise bad(
                "bus.update_every",
                f"{self.bus.update_every} needs buffer.max_staleness >= {self.bus.update_every - 1} "
                f"(it is {self.buffer.max_staleness}): engines lag up to update_every - 1 versions",
            )
        self._check_placement()

    def _check_lora(self) -> None:
        """A LoRA job: its engines are started by the job with the adapter's config and serve the untrained
        adapter from version 0; SGLang replaces an adapter by unload + load, and its unload waits for the
        requests running on the adapter, which a pause in place (or retract) keeps from finishing."""
        g = self.generators
        if g.engine == "external":
            raise bad(
                "generators.engine",
                "a LoRA job (model.lora) launches its engines (`builtin` or `sglang`) so that they start "
                "with the adapter's shape and serve its version 0; external engines are not supported",
            )
        if g.engine == "sglang" and self.bus.pause_mode != "abort":
            raise bad(
                "bus.pause_mode",
                f"a LoRA job on SGLang engines replaces the adapter by unload + load, and SGLang's unload "
                f"waits for the requests running on it: set bus.pause_mode to abort (not "
                f"{self.bus.pause_mode}; rollouts resume aborted requests from their prefix)",
            )
        if self.placement == "colocated" and self.trainer.num_trainers > 1:
            raise bad(
                "trainer.num_trainers",
                "a colocated LoRA job runs on one trainer rank: the per-rank handoff (several GPUs) sends "
                "full weights only",
            )

    def _check_call_grammar(self) -> None:
        """agent.constrain_tool_calls: tools to call, and a call grammar from the builtin tools' schemas
        (a custom tool's schema() is its own code, run only by the workers, which check it at start)."""
        from generator_fleet.agent.constrain import call_grammar
        from generator_fleet.tools import BUILTIN_TOOLS

        if not self.tools:
            raise bad("agent.constrain_tool_calls", "constrains tool calls, but the job lists no `tools:`")
        builtins = []
        for i, t in enumerate(self.tools):
            if t.impl is None and t.name in BUILTIN_TOOLS:
                try:
                    builtins.append(BUILTIN_TOOLS[t.name](**t.args).schema())
                except Exception as e:
                    raise bad(f"tools[{i}].args", f"tool {t.name!r} cannot be built: {e}") from None
        if builtins:
            try:
                call_grammar(builtins, "</tool_call>")
            except ValueError as e:
                raise bad("agent.constrain_tool_calls", str(e)) from None

    def _check_placement(self) -> None:
        """Colocated: launched engines, one per trainer device, the ipc bus, a schedule that fits."""
        g, tr, co = self.generators, self.trainer, self.colocation
        if self.placement != "colocated":
            if co != ColocationSpec():
                raise bad("colocation", "only with `placement: colocated`")
            return
        for key, res in (("generators.resources", g.resources), ("trainer.resources", tr.resources)):
            if res:
                raise bad(key, "placement colocated puts engines beside their trainer ranks: no resources")
        if g.engine == "external":
            raise bad(
                "generators.engine",
                "placement colocated: the job launches its engines beside its trainer ranks "
                "(`builtin` or `sglang`), not `external` ones",
            )
        if self.bus.backend != "ipc":
            raise bad(
                "bus.backend",
                f"placement colocated hands weights over through `ipc` (CUDA IPC, shared memory on CPU), "
                f"not {self.bus.backend}: leave bus.backend out or set it to ipc",
            )
        gpus = g.sglang.gpus_per_engine if g.engine == "sglang" else g.gpus_per_engine
        if g.engine == "sglang" and gpus is None:
            gpus = g.sglang.tp_size
        key = "generators.sglang.gpus_per_engine" if g.engine == "sglang" else "generators.gpus_per_engine"
        if tr.device == "cuda":
            if g.engine == "sglang" and g.sglang.tp_size != 1:
                raise bad(
                    "generators.sglang.tp_size",
                    "placement colocated: an engine shares one trainer rank's GPU (tp_size 1)",
                )
            if gpus != 1:
                raise bad(
                    key, f"placement colocated on cuda: each engine shares one trainer GPU (1, not {gpus})"
                )
            if g.num_engines != tr.num_trainers:
                raise bad(
                    "generators.num_engines",
                    f"placement colocated on cuda: one engine per trainer rank's GPU "
                    f"({tr.num_trainers} trainer ranks, {g.num_engines} engines)",
                )
        elif gpus:
            raise bad(key, "placement colocated with trainer.device cpu: engines run on the CPU too (0)")
        if co.schedule == "sync" and self.buffer.max_staleness != 0:
            raise bad(
                "colocation.schedule",
                f"sync releases the engines' memory while the trainer trains, so nothing is generated "
                f"ahead: it needs buffer.max_staleness 0 (it is {self.buffer.max_staleness}); "
                "use async for staleness > 0",
            )

    def _check_eval(self, ev: EvalSpec) -> None:
        size = known_size(self.dataset)
        if ev.dataset is None and size is not None and ev.heldout >= size:
            raise bad(
                "eval.heldout",
                f"{ev.heldout} held-out problems leave none of the dataset's {size} to train on",
            )


def eval_task(spec: JobSpec) -> str | None:
    """The task name of the spec's own eval dataset (`eval.dataset.name`), if it has one."""
    return spec.eval.dataset.name if spec.eval is not None and spec.eval.dataset is not None else None


def known_size(ds: DatasetSpec) -> int | None:
    """Problems a generated task has (`arith`, `word_problems`); None where only reading the data tells."""
    if ds.name == "arith":
        return (ds.max_operand + 1) ** 2
    if ds.name == "word_problems":
        return ds.num_problems
    return None


def check_ipc_engines(gen: GeneratorsSpec) -> None:
    """`bus.backend: ipc` hands weights over on the trainer's host: engines given by URL must be on it
    (the bus checks again, where the trainer runs)."""
    if gen.engine != "external":
        return
    if not gen.urls:
        raise bad(
            "bus.backend", "ipc needs the engines' `generators.urls` (a router's workers may be remote)"
        )
    remote = [u for u in gen.urls if not is_local(u)]
    if remote:
        raise bad(
            "bus.backend",
            f"ipc hands weights over through CUDA IPC / shared memory on one host; {remote} are not on "
            "this host (use gloo or nccl for remote engines)",
        )


MIN_PROMPT_TOKENS = 1
"""The prompt budget the context check reserves: the spec bounds no prompt's length and prompts are not
tokenized at submit, so only a prompt's least possible size (its chat template alone is more) is known."""


def check_context(spec: JobSpec) -> None:
    """Every request's token budget, plus a prompt, must fit the context the engines serve: the model's
    max_position_embeddings (from model.path's config.json once it exists), or `generators.sglang.
    context_length` when set. An engine holds at most context - 1 tokens per sequence (SGLang refuses a
    request of prompt + max_new_tokens >= context, the built-in engine the same), so a budget over that
    fails every request of the job. Raises JobSpecError at the budget's key; silent while the model is
    not built yet (checked again when the job prepares it)."""
    context = max_position_embeddings(spec.model.path)
    if context is None:
        return
    source = f"max_position_embeddings in {Path(spec.model.path) / 'config.json'}"
    sglang = spec.generators.sglang
    if spec.generators.engine == "sglang" and sglang.context_length is not None:
        context, source = sglang.context_length, "generators.sglang.context_length"
    # What one request asks for (in an agent job, each model turn). agent.max_total_tokens is a budget over
    # an episode's turns that episodes which end early never reach: it is not refused here.
    budgets = [("rollout.sampling.max_new_tokens", spec.rollout.sampling.max_new_tokens)]
    if spec.eval is not None and spec.eval.max_new_tokens is not None:
        budgets.append(("eval.max_new_tokens", spec.eval.max_new_tokens))
    for key, tokens in budgets:
        if tokens + MIN_PROMPT_TOKENS > context - 1:
            raise JobSpecError(
                f"invalid job spec: {key} {tokens} + a prompt of at least {MIN_PROMPT_TOKENS} token is "
                f"{tokens + MIN_PROMPT_TOKENS} tokens, over the {context - 1} a sequence may have in the "
                f"model's context of {context} ({source}); at most {context - 1 - MIN_PROMPT_TOKENS} - at `$.{key}`"
            )


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
"""The source tree's example specs: a model is never built in here."""


INPUT_PATH_KEYS = (
    "model.path",
    "dataset.path",
    "eval.dataset.path",
    "algorithm.ref_model_path",
    "algorithm.critic_model_path",
    "trainer.resume_from",
)
"""The spec's keys naming a path a job reads from (or builds its model into), the one list of them:
resolve_paths makes each absolute, and a submitted job's must lie in the cluster's input roots
(slipstream/cluster/job_paths.py input_paths)."""


def input_paths(spec: JobSpec) -> dict[str, str | None]:
    """Each of INPUT_PATH_KEYS -> its path in `spec`; None where it is unset (or its section is), and for
    `trainer.resume_from: latest`, which is no path."""
    out: dict[str, str | None] = {}
    for key in INPUT_PATH_KEYS:
        value = spec
        for part in key.split("."):
            value = getattr(value, part) if value is not None else None
        out[key] = None if key == "trainer.resume_from" and value == "latest" else value
    return out


def _with_path(section, parts: list[str], value: str):
    """`section` with the path at `parts` (its key, split) replaced by `value`."""
    if len(parts) == 1:
        return msgspec.structs.replace(section, **{parts[0]: value})
    inner = getattr(section, parts[0])
    return msgspec.structs.replace(section, **{parts[0]: _with_path(inner, parts[1:], value)})


def resolve_paths(spec: JobSpec, base: str | Path) -> JobSpec:
    """The one rule for relative paths, in `run`, `validate` and `submit` alike: relative to `base`, the
    working directory of the command (not the spec file's directory). Resolves each input path
    (INPUT_PATH_KEYS: model.path, dataset.path, eval.dataset.path, the reference and critic models,
    trainer.resume_from unless `latest`) and output_dir; a relative trainer.checkpoint_dir is under
    output_dir. Refuses a model.build target inside the source tree's examples/."""
    base = Path(base)
    s = spec
    for key, p in input_paths(spec).items():
        if p is not None:
            s = _with_path(s, key.split("."), str((base / p).resolve()))
    out = str((base / s.output_dir).resolve())
    tr = s.trainer
    if tr.checkpoint_dir is not None:
        s = _with_path(s, ["trainer", "checkpoint_dir"], str((Path(out) / tr.checkpoint_dir).resolve()))
    if s.model.build is not None and Path(s.model.path).is_relative_to(EXAMPLES_DIR):
        raise JobSpecError(
            f"invalid job spec: model.build would write into the source tree's examples/ ({s.model.path}); "
            "run from the project root or give model.path under runs/ - at `$.model.path`"
        )
    return msgspec.structs.replace(s, output_dir=out)


def to_json(spec: JobSpec) -> str:
    """Resolved spec as JSON (nulls survive a round trip); saved with every run."""
    return json.dumps(msgspec.to_builtins(spec), indent=2)
