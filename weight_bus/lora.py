"""Adapter-only updates (a job with `model.lora`): what the bus sends instead of the full weights, and the
PEFT directories it writes for engines that load adapters from disk.

Every transport carries the adapter's tensors under PEFT's saved names (`base_model.model.model.layers.
{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]) with its PEFT adapter_config;
the base weights never move after an engine starts. Per transport (weight_bus/bus.py):

- group (gloo/NCCL), built-in engines: the usual buckets, announced with `lora_name` + `lora_config`
  (the engine keeps the buckets and replaces the adapter at the last one, which carries the version);
- ipc (colocated): the whole adapter in one bucket, POSTed to /load_lora_adapter_from_tensors, then
  /update_weight_version;
- group transport to engines without the group extension (SGLang): a PEFT directory
  `<lora_dir>/v<version>` written by the trainer's rank 0 (the engines read it: same host or a shared
  filesystem), then /unload_lora_adapter + /load_lora_adapter under the adapter's name and
  /update_weight_version. Older version directories are pruned.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from weight_bus.group import dtype_from_name
from weight_bus.packing import Bucket

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2
"""Adapter directories kept under lora_dir: the one just published and the one before it (an engine that
joins while a publish is written still finds a whole directory)."""
_VERSION_DIR = re.compile(r"^v(\d+)$")


def unpack(b: Bucket) -> dict[str, torch.Tensor]:
    """The tensors of a packed bucket, as views of its flat bytes (by the offsets it was packed at)."""
    out = {}
    for name, shape, d, off in zip(b.names, b.shapes, b.dtypes, b.offsets, strict=True):
        dtype = dtype_from_name(d)
        n = 1
        for s in shape:
            n *= s
        out[name] = b.flat[off : off + n * dtype.itemsize].view(dtype).view(shape)
    return out


def write_adapter_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) at `path`, written to a
    temporary sibling first and renamed, so a reader never sees half of it."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors")
    )
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def version_dir(lora_dir: Path, version: int) -> Path:
    return Path(lora_dir) / f"v{version}"


def prune(lora_dir: Path, keep: int = KEEP_VERSIONS) -> list[Path]:
    """Delete all but the `keep` newest version directories under lora_dir; returns those deleted."""
    lora_dir = Path(lora_dir)
    if not lora_dir.is_dir():
        return []
    found = sorted(
        (int(m.group(1)), p) for p in lora_dir.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name))
    )
    gone = [p for _, p in found[:-keep]] if keep > 0 else [p for _, p in found]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
