"""Slipstream's built-in inference engine: an SGLang-compatible HTTP server over a transformers causal LM,
for CPU runs, tests, and wherever SGLang is not installed.

Names load on first use, so `generator_fleet.engine.options` (the job spec, the command line's --help)
imports without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from generator_fleet.engine.app import build_app
    from generator_fleet.engine.options import EngineOptions
    from generator_fleet.engine.request import Completion, SamplingParams
    from generator_fleet.engine.runner import Runner
    from generator_fleet.engine.serve import EngineServer

_WHERE = {
    "Completion": "request",
    "Runner": "runner",
    "SamplingParams": "request",
    "EngineServer": "serve",
    "EngineOptions": "options",
    "build_app": "app",
}

__all__ = ["Completion", "EngineOptions", "EngineServer", "Runner", "SamplingParams", "build_app"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
