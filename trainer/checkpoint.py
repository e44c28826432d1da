"""Checkpoints of the trainer pool, and the HF export.

A checkpoint is a directory written with torch.distributed.checkpoint: every rank writes its own shards of
the policy (and critic) weights and AdamW state, keyed by parameter name, plus `trainer_state.json` (step,
weight version, buffer counters, world size, the LR schedule's step `lr_step`) from rank 0. DCP stores each tensor's global shape and the
slices each file holds, so a checkpoint written by N ranks loads into M ranks: each rank reads the slices
its own shards need (resharding). A checkpoint is written under a temporary name (`.step-N.partial`, which
neither `latest`, pruning nor a resume ever looks at) and renamed into place only when complete; a save
that fails (a full disk) removes its partial directory and re-raises, one killed outright leaves it for the
next save to remove. `<checkpoint_dir>/latest` names the newest complete one and is replaced atomically,
last, so a crash mid-save leaves the previous one as latest and the newest complete checkpoint never goes
backwards.

A LoRA job's checkpoint (model.lora) holds the adapter's tensors and their AdamW state only, not the
frozen base: that comes from model.path when the job resumes. Its trainer_state carries `lora` (the adapter's
rank, alpha, targets) and `base` (trainer/fingerprint.py: the base's config and a hash of its weights); a resume
with another base, another adapter shape, or a full-weight checkpoint for a LoRA job (or the reverse) is
refused with the spec key to fix. Resharding works as for full weights.

The HF export gathers full parameters on rank 0 and writes a transformers directory (config,
model.safetensors, tokenizer) that `AutoModelForCausalLM.from_pretrained` and SGLang load. A LoRA job's
export is the base in that directory, the PEFT adapter in `adapter/` beside its files, and with
trainer.export_merged the adapter merged into the base (W + scaling * B @ A, PEFT's merge_and_unload) as a
second transformers directory in `merged/`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
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

from trainer import metrics
from trainer.fingerprint import config_differences
from trainer.lora import peft_name

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
LATEST = "latest"


class _ModelAndOptimizer(Stateful):
    """DCP's view of one model and its optimizer: state dicts keyed by parameter name (not by the
    optimizer's integer ids), which is what makes them loadable under a different sharding."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> None:
        """trainable_only: the frozen parameters (a LoRA policy's base) are neither saved nor loaded."""
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
        self.trainable_only = trainable_only

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        if self.trainable_only:  # a frozen tied weight (lm_head = embed_tokens) is still listed by its alias
            frozen = {
                n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad
            }
            model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        result = set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self.options,
        )
        if self.trainable_only:  # non-strict: only frozen parameters may be left out
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            missing = [k for k in result.missing_keys if k in trainable]
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    f"checkpoint does not fit the adapter: missing {missing[:5]}, "
                    f"unexpected {list(result.unexpected_keys)[:5]}"
                )


def _app_state(learner) -> dict:
    lora = learner.model_spec.lora is not None
    state = {"policy": _ModelAndOptimizer(learner.model, learner.opt, trainable_only=lora)}
    if learner.critic is not None:
        state["critic"] = _ModelAndOptimizer(learner.critic, learner.critic_opt)
    return state


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:08d}"


def partial_dir(path: str | Path) -> Path:
    """Where the checkpoint `path` is written until it is complete."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def _disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, raised by this rank or reported by DCP from another (CheckpointException)."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        m in str(e) for m in ("No space left on device", "Disk quota exceeded")
    )


def _free(path: Path) -> str:
    """`<free> free of <total> at <dir>`: the filesystem of the nearest existing directory of `path`."""
    for p in (path, *path.parents):
        if p.exists():
            usage = shutil.disk_usage(p)
            return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB at {p}"
    return "free space unknown"


def save(
    learner,
    path: str | Path,
    trainer_state: dict,
    keep: int | None = None,
    before_complete: Callable[[], None] | None = None,
) -> Path:
    """Write a checkpoint (a collective: every rank calls it). `trainer_state` (JSON-able) is rank 0's.
    It is written to `partial_dir(path)` and renamed to `path` once complete; on failure the partial
    directory is removed and the error re-raised (a full disk as OSError ENOSPC naming the path and the
    free space there). Rank 0 renames and prunes: every rank sees one filesystem here, as the state file
    and `latest`, which only rank 0 writes, always assumed. `before_complete` runs on rank 0 between the
    shards and the state file (the fault tests inject a full disk there)."""
    path = Path(path)
    tmp = partial_dir(path)
    ranks = learner.ranks
    t0 = time.monotonic()
    try:
        if ranks.is_main and tmp.exists():
            shutil.rmtree(tmp)  # a save of this step that was killed before it could clean up
        ranks.barrier()
        dcp.save(_app_state(learner), checkpoint_id=str(tmp))
        ranks.barrier()
        if ranks.is_main:
            if before_complete is not None:
                before_complete()
            state = {**trainer_state, "world_size": ranks.world_size, "lr_step": learner.lr_step}
            lora = learner.model_spec.lora
            if lora is not None:
                state["lora"] = lora_meta(lora)
                state["base"] = {**learner.base_fingerprint, "path": learner.model_spec.path}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            replaced = path.with_name(f".{path.name}.replaced.partial")
            if path.exists():  # an earlier checkpoint of the same step: out of the way in one rename
                path.rename(replaced)
            tmp.rename(path)
            _write_latest(path)
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException as e:  # CheckpointException is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(e):
            raise OSError(
                errno.ENOSPC,
                f"No space left on device writing checkpoint {path} ({_free(path.parent)}); its partial "
                "directory was removed",
            ) from e
        raise
    if ranks.is_main:
        for old in path.parent.glob(".step-*.partial"):  # saves killed outright (kill -9, a lost node)
            shutil.rmtree(old, ignore_errors=True)
        if keep:
            for old in sorted(path.parent.glob("step-*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        metrics.CHECKPOINT_BYTES.set(size)
        metrics.CHECKPOINT_SECONDS.observe(time.monotonic() - t0)
        log.info(
            "checkpoint %s written by %d ranks (%d bytes, %.1f s)",
            path,
            ranks.world_size,
            size,
            time.monotonic() - t0,
        )
        if lora is not None:
            log.info(
                "checkpoint %s holds LoRA adapter %r only (%d bytes of adapter weights + their AdamW state); "
                "the frozen base is model.path %s (weights fingerprint %s)",
                path,
                lora.name,
                learner.adapter_bytes,
                learner.model_spec.path,
                learner.base_fingerprint["weights"],
            )
    ranks.barrier()
    return path


def _write_latest(path: Path) -> None:
    """`latest` -> path.name, replaced atomically: a full disk leaves the old pointer whole, never empty."""
    tmp = path.parent / f".{LATEST}.tmp"
    tmp.write_text(path.name)
    os.replace(tmp, path.parent / LATEST)


LORA_SHAPE = ("rank", "alpha", "target_modules")
"""What an adapter checkpoint must agree with `model.lora` on to resume (dropout and the serving name may
change)."""


def lora_meta(lora) -> dict:
    """A LoRA checkpoint's `lora` entry: the adapter's shape and name."""
    return {
        "name": lora.name,
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
    }


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the job resuming from it; the message names the spec key."""


def check_compatible(learner, state: dict, path: Path) -> None:
    """Refuse a checkpoint whose contents do not fit the learner: a full-weight checkpoint for a LoRA job
    or the reverse, another adapter shape, or an adapter trained on another base model."""
    lora, saved = learner.model_spec.lora, state.get("lora")
    if lora is None and saved is not None:
        raise CheckpointMismatch(
            f"model.lora: checkpoint {path} holds a LoRA adapter (rank {saved['rank']}, targets "
            f"{saved['target_modules']}) and no base weights; set model.lora to that adapter to resume it"
        )
    if lora is None:
        return
    if saved is None:
        raise CheckpointMismatch(
            f"model.lora: checkpoint {path} holds full weights (a full fine-tuning run), not a LoRA adapter; "
            "resume it without model.lora, or start the adapter from scratch (no trainer.resume_from)"
        )
    mine = lora_meta(lora)
    diff = {k: (saved.get(k), mine[k]) for k in LORA_SHAPE if saved.get(k) != mine[k]}
    if diff:
        raise CheckpointMismatch(
            f"model.lora: checkpoint {path} holds another adapter: "
            + ", ".join(f"{k} {a} in the checkpoint, {b} in the spec" for k, (a, b) in diff.items())
        )
    base, fp = state.get("base", {}), learner.base_fingerprint
    config = config_differences(base.get("config", {}), fp["config"])
    if config or base.get("weights") != fp["weights"]:
        what = (
            "config: "
            + ", ".join(f"{k} {a!r} in the checkpoint's base, {b!r} now" for k, (a, b) in config.items())
            if config
            else f"weights: fingerprint {base.get('weights')} in the checkpoint, {fp['weights']} now"
        )
        raise CheckpointMismatch(
            f"model.path: checkpoint {path} holds a LoRA adapter trained on base {base.get('path')!r}; "
            f"model.path {learner.model_spec.path!r} is another model ({what}): resume with the base the "
            "adapter was trained on"
        )


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
    state = json.loads((path / STATE_FILE).read_text())
    check_compatible(learner, state, path)
    dcp.load(_app_state(learner), checkpoint_id=str(path))
    # the LR schedule continues where it stopped (older checkpoints: one optimizer step per version)
    learner.lr_step = int(state.get("lr_step", state.get("step", 0)))
    log.info(
        "resumed from %s (written by %d ranks, now %d) at LR schedule step %d",
        path,
        state["world_size"],
        learner.ranks.world_size,
        learner.lr_step,
    )
    if learner.model_spec.lora is not None:
        log.info(
            "resumed LoRA adapter %r (rank %d, %d bytes) and its AdamW state from %s; base model.path %s "
            "matches the checkpoint's (config, weights fingerprint %s)",
            learner.model_spec.lora.name,
            learner.model_spec.lora.rank,
            learner.adapter_bytes,
            path,
            learner.model_spec.path,
            learner.base_fingerprint["weights"],
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


MERGED_DIR = "merged"
"""A LoRA job's merged export (trainer.export_merged): the adapter merged into the base, a transformers
directory inside the HF model's."""


def merge_adapter(base: dict, adapter: dict, scaling: float) -> dict:
    """The base's HF-named tensors with each adapted projection's weight replaced by W + scaling * B @ A
    (PEFT's merge_and_unload; computed in float64, returned in W's dtype). `adapter`: PEFT saved names."""
    merged = dict(base)
    suffix = ".lora_A.weight"
    for name, a in adapter.items():
        if not name.endswith(suffix):
            continue
        module = name.removeprefix("base_model.model.").removesuffix(suffix)
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        w = base[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.double() + scaling * (b.double() @ a.double())).to(w.dtype)
    return merged


def _write_hf(learner, state: dict, path: Path, tokenizer, dtype: torch.dtype) -> None:
    """Rank 0: a transformers directory (config, safetensors in `dtype`, tokenizer) of the policy's
    architecture holding `state` (HF names)."""
    from transformers import AutoModelForCausalLM

    config = type(learner.config).from_dict(learner.config.to_dict())
    config._attn_implementation = "sdpa"  # our packed kernel is a training detail, not the checkpoint's
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"HF export: parameters missing from the gathered state: {missing[:5]}")
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def export_hf(
    learner, path: str | Path, tokenizer=None, dtype: torch.dtype = torch.float32, merged: bool = False
) -> Path | None:
    """Gather the full policy on rank 0 and write it as a transformers directory (safetensors) in
    `dtype`; a collective. A LoRA policy: the base there, the PEFT adapter in `adapter/`, and with
    `merged` the adapter merged into the base in `merged/`. Returns the path on rank 0, None elsewhere."""
    full = get_model_state_dict(
        learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not learner.ranks.is_main:
        learner.ranks.barrier()
        return None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lora = learner.model_spec.lora
    if merged and lora is None:
        raise ValueError("a merged export needs model.lora (a full fine-tuning's export is the whole model)")
    if lora is not None:  # the base under its HF names; the adapter goes to its own PEFT directory
        adapter = {peft_name(k): v for k, v in full.items() if ".lora_A." in k or ".lora_B." in k}
        full = {
            k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in full.items()
            if k not in adapter and ".lora_A." not in k and ".lora_B." not in k
        }
        save_adapter(adapter, lora, path / ADAPTER_DIR, dtype)
        if merged:
            _write_hf(
                learner, merge_adapter(full, adapter, lora.scaling), path / MERGED_DIR, tokenizer, dtype
            )
            log.info(
                "exported merged model (adapter %r merged into the base: W + %g * B @ A on %d projections, %s) "
                "to %s",
                lora.name,
                lora.scaling,
                sum(n.endswith(".lora_A.weight") for n in adapter),
                dtype,
                path / MERGED_DIR,
            )
    _write_hf(learner, full, path, tokenizer, dtype)
    log.info("exported HF model (%s) to %s", dtype, path)
    learner.ranks.barrier()
    return path
