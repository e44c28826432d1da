"""LoRA adapters served by the built-in engine: a fixed bank of adapter slots holding every loaded
adapter's A and scaled B per (layer, target projection), and the batched delta the forward adds to a
projection's output.

Rows (tokens) pick their adapter by slot index, -1 = the base model. The delta of one projection for a
packed batch of T rows is two GEMMs over all slots at once, masked per row:
`((x @ A_cat^T).view(T, S, r) * onehot(row_slot)) @ (scaling * B)_cat^T`, with A_cat [S*r, in] and
B_cat^T [S*r, out] the slots' matrices stacked. Cost T*S*r*(in+out), small next to the base GEMM for
S*r << hidden, with no per-row gather; an adapter of lower rank than the bank's is zero-padded.

Tensors arrive under PEFT's saved names (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]); loading copies them into the slot in place.
"""

from __future__ import annotations

import logging
import re

import torch

from models.config import LORA_TARGETS, LoraSpec

log = logging.getLogger(__name__)

_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(LORA_TARGETS)
    + r")\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoraError(ValueError):
    """An adapter that does not fit the engine's LoRA configuration (answered 400)."""


def module_dims(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target projection of a Llama-family layer."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def parse_config(config: dict) -> tuple[int, float, list[str]]:
    """(rank, scaling, target modules) of a PEFT adapter_config dict; LoraError if unsupported."""
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
        targets = config["target_modules"]
    except (KeyError, TypeError, ValueError) as e:
        raise LoraError(f"adapter config needs r, lora_alpha and target_modules: {e}") from None
    if isinstance(targets, str):
        targets = [targets]
    if config.get("use_rslora") or config.get("use_dora"):
        raise LoraError("rsLoRA and DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError("adapters with bias are not supported")
    return rank, alpha / rank, list(targets)


class LoraBank:
    """`max_loras` adapter slots sized for `spec` (max rank, target modules) on one device."""

    def __init__(self, spec: LoraSpec, config, max_loras: int, device, dtype) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.targets = tuple(spec.target_modules)
        self.slots = max_loras
        self.num_layers = config.num_hidden_layers
        self.device, self.dtype = device, dtype
        dims = module_dims(config)
        S, r = max_loras, spec.rank
        self.a = {
            m: [torch.zeros(S * r, dims[m][0], device=device, dtype=dtype) for _ in range(self.num_layers)]
            for m in self.targets
        }
        self.bt = {
            m: [torch.zeros(S * r, dims[m][1], device=device, dtype=dtype) for _ in range(self.num_layers)]
            for m in self.targets
        }
        self.names: dict[str, int] = {}
        self.mask: torch.Tensor | None = None
        """[T, S, 1] one-hot row → slot of the running forward (set by `select`)."""

    def slot_of(self, name: str | None) -> int:
        """The slot serving adapter `name` (-1 = base for None); LoraError for an unknown name."""
        if name is None:
            return -1
        if name not in self.names:
            raise LoraError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.names)})")
        return self.names[name]

    def load(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> int:
        """Load (or replace in place) adapter `name`; returns its slot. Validates everything before the
        first copy, so a rejected adapter leaves the bank untouched."""
        rank, scaling, targets = parse_config(config)
        if rank > self.rank:
            raise LoraError(f"adapter rank {rank} exceeds the engine's max LoRA rank {self.rank}")
        extra = [m for m in targets if m not in self.targets]
        if extra:
            raise LoraError(
                f"adapter targets {extra}, not among the engine's LoRA target modules {list(self.targets)}"
            )
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _NAME.search(key)
            if m is None:
                raise LoraError(f"unexpected adapter tensor {key!r}")
            layer, mod, ab = int(m.group(1)), m.group(2), m.group(3)
            if layer >= self.num_layers or mod not in targets:
                raise LoraError(f"adapter tensor {key!r} is outside the adapter's layers or targets")
            parts.setdefault((layer, mod), {})[ab] = t
        for (layer, mod), p in parts.items():
            if set(p) != {"A", "B"}:
                raise LoraError(f"layer {layer} {mod}: lora_A and lora_B are both needed")
            a_in = self.a[mod][layer].shape[1]
            b_out = self.bt[mod][layer].shape[1]
            if tuple(p["A"].shape) != (rank, a_in) or tuple(p["B"].shape) != (b_out, rank):
                raise LoraError(
                    f"layer {layer} {mod}: lora_A {tuple(p['A'].shape)} / lora_B {tuple(p['B'].shape)} "
                    f"do not match rank {rank} and the model's ({a_in} → {b_out})"
                )
        if name in self.names:
            slot = self.names[name]
        else:
            free = sorted(set(range(self.slots)) - set(self.names.values()))
            if not free:
                raise LoraError(f"all {self.slots} LoRA slots are in use (unload an adapter first)")
            slot = free[0]
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        with torch.no_grad():
            for mod in self.targets:
                for layer in range(self.num_layers):
                    a, bt = self.a[mod][layer][rows], self.bt[mod][layer][rows]
                    p = parts.get((layer, mod))
                    a.zero_()
                    bt.zero_()
                    if p is not None:
                        a[:rank].copy_(p["A"])
                        bt[:rank].copy_(p["B"].t() * scaling)
        self.names[name] = slot
        log.info("LoRA adapter %s loaded in slot %d (rank %d, %d projections)", name, slot, rank, len(parts))
        return slot

    def unload(self, name: str) -> None:
        slot = self.slot_of(name)
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        with torch.no_grad():
            for mod in self.targets:
                for layer in range(self.num_layers):
                    self.a[mod][layer][rows].zero_()
                    self.bt[mod][layer][rows].zero_()
        del self.names[name]
        log.info("LoRA adapter %s unloaded from slot %d", name, slot)

    def select(self, row_slots: torch.Tensor) -> None:
        """Set the per-row adapter slots [T] (-1 = base) of the next forward."""
        onehot = row_slots[:, None] == torch.arange(self.slots, device=row_slots.device)[None]
        self.mask = onehot.to(self.dtype)[:, :, None]

    def delta(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' contribution to projection `module` of `layer` for rows x [T, in] (None if the
        bank does not target it)."""
        if module not in self.a:
            return None
        T = x.shape[0]
        u = (x @ self.a[module][layer].t()).view(T, self.slots, self.rank) * self.mask
        return u.view(T, -1) @ self.bt[module][layer]


def read_peft_dir(path: str, device, dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's (adapter_config, tensors by saved name), tensors on `device`/`dtype`."""
    import json
    import os

    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise LoraError(f"{path} is not a PEFT adapter directory (no adapter_config.json)")
    with open(cfg_file) as f:
        config = json.load(f)
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        tensors = load_file(st)
    elif os.path.isfile(os.path.join(path, "adapter_model.bin")):
        tensors = torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise LoraError(f"{path} has no adapter_model.safetensors (or adapter_model.bin)")
    return config, {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
