"""Checkpoints of the trainer pool, and the HF export.

A checkpoint is a directory written with torch.distributed.checkpoint: every rank writes its own shards of
the policy (and critic) weights and AdamW state, keyed by parameter name, plus `trainer_state.json` (step,
weight version, buffer counters, world size, the LR schedule's step `lr_step`) from rank 0. DCP stores each tensor's global shape and the
slices each file holds, so a checkpoint written by N ranks loads into M ranks: each rank reads the slices
its own shards need (resharding). `<checkpoint_dir>/latest` names the newest complete one; it is written
last, so a crash mid-save leaves the previous one as latest.

The HF export gathers full parameters on rank 0 and writes a transformers directory (config,
model.safetensors, tokenizer) that `AutoModelForCausalLM.from_pretrained` and SGLang load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.learner import peft_name

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
LATEST = "latest"


class _ModelAndOptimizer(Stateful):
    """DCP's view of one model and its optimizer: state dicts keyed by parameter name (not by the
    optimizer's integer ids), which is what makes them loadable under a different sharding."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def _app_state(learner) -> dict:
    state = {"policy": _ModelAndOptimizer(learner.model, learner.opt)}
    if learner.critic is not None:
        state["critic"] = _ModelAndOptimizer(learner.critic, learner.critic_opt)
    return state


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:08d}"


def save(learner, path: str | Path, trainer_state: dict, keep: int | None = None) -> Path:
    """Write a checkpoint (a collective: every rank calls it). `trainer_state` (JSON-able) is rank 0's."""
    path = Path(path)
    pool = learner.pool
    if pool.is_main and path.exists():
        shutil.rmtree(path)  # a half-written earlier attempt at the same step
    pool.barrier()
    dcp.save(_app_state(learner), checkpoint_id=str(path))
    pool.barrier()
    if pool.is_main:
        state = {**trainer_state, "world_size": pool.world_size, "lr_step": learner.lr_step}
        (path / STATE_FILE).write_text(json.dumps(state, indent=2))
        (path.parent / LATEST).write_text(path.name)
        if keep:
            for old in sorted(path.parent.glob("step-*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written by %d ranks", path, pool.world_size)
    pool.barrier()
    return path


def resolve(path: str | Path, checkpoint_dir: str | Path) -> Path:
    """`latest` -> the newest complete checkpoint under checkpoint_dir; otherwise the path itself.
    A directory holding a `latest` pointer resolves through it too."""
    p = Path(checkpoint_dir) if str(path) == LATEST else Path(path)
    if (p / LATEST).exists():
        p = p / (p / LATEST).read_text().strip()
    if not (p / STATE_FILE).exists():
        raise FileNotFoundError(f"no complete checkpoint at {p} (missing {STATE_FILE})")
    return p


def load(learner, path: str | Path) -> dict:
    """Load weights and optimizer state into an already built (and sharded) learner, whatever world size
    wrote the checkpoint; returns its trainer_state."""
    path = Path(path)
    dcp.load(_app_state(learner), checkpoint_id=str(path))
    state = json.loads((path / STATE_FILE).read_text())
    # the LR schedule continues where it stopped (older checkpoints: one optimizer step per version)
    learner.lr_step = int(state.get("lr_step", state.get("step", 0)))
    log.info(
        "resumed from %s (written by %d ranks, now %d) at LR schedule step %d",
        path,
        state["world_size"],
        learner.pool.world_size,
        learner.lr_step,
    )
    return state


ADAPTER_DIR = "adapter"
"""A LoRA job's export: the PEFT adapter directory inside the HF model's."""


def save_adapter(tensors: dict, lora, path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT adapter directory: adapter_config.json + adapter_model.safetensors (PEFT's saved names),
    loadable by `peft.PeftModel.from_pretrained(base, path)` and SGLang's /load_lora_adapter."""

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors")
    )
    (path / "adapter_config.json").write_text(json.dumps(lora.peft_config(), indent=2))
    log.info("wrote LoRA adapter %r (%d tensors) to %s", lora.name, len(tensors), path)
    return path


def export_hf(learner, path: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32) -> Path | None:
    """Gather the full policy on rank 0 and write it as a transformers directory (safetensors) in
    `dtype`; a collective. Returns the path on rank 0, None elsewhere."""
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(
        learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not learner.pool.is_main:
        learner.pool.barrier()
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lora = learner.model_spec.lora
    if lora is not None:  # the base under its HF names; the adapter goes to its own PEFT directory
        adapter = {peft_name(k): v for k, v in full.items() if ".lora_A." in k or ".lora_B." in k}
        full = {
            k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in full.items()
            if k not in adapter and ".lora_A." not in k and ".lora_B." not in k
        }
        save_adapter(adapter, lora, path / ADAPTER_DIR, dtype)
    config = type(learner.config).from_dict(learner.config.to_dict())
    config._attn_implementation = "sdpa"  # our packed kernel is a training detail, not the checkpoint's
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in full.items()}, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"HF export: parameters missing from the gathered state: {missing[:5]}")
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    log.info("exported HF model (%s) to %s", dtype, path)
    learner.pool.barrier()
    return path
