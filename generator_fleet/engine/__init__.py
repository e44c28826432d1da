"""Slipstream's built-in inference engine: an SGLang-compatible HTTP server over a transformers causal LM,
for CPU runs, tests, and wherever SGLang is not installed."""

from generator_fleet.engine.runner import Completion, Runner, SamplingParams
from generator_fleet.engine.server import EngineServer, build_app

__all__ = ["Completion", "EngineServer", "Runner", "SamplingParams", "build_app"]
