"""The trainer's LoRA policy: the HF model wrapped by PEFT with the job's adapter, and PEFT's saved names."""

from __future__ import annotations

from torch import nn

ADAPTER = "default"
"""PEFT's in-model adapter name (dropped from the saved names)."""


def wrap_lora(model: nn.Module, lora) -> nn.Module:
    """The HF model wrapped by PEFT with the job's adapter (models.config.LoraSpec): the base frozen, only
    lora_A/lora_B trainable; B starts at zero so the adapted model equals the base."""
    from peft import LoraConfig, get_peft_model

    cfg = lora.peft_config()
    cfg.pop("peft_type")
    return get_peft_model(model, LoraConfig(**cfg), adapter_name=ADAPTER)


def peft_name(name: str) -> str:
    """A PeftModel parameter's name as PEFT saves it (the adapter name dropped)."""
    return name.replace(f".{ADAPTER}.", ".")
