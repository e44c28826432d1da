"""Which frozen base model a LoRA adapter belongs to: a fingerprint stored in the adapter's checkpoints and
checked when a job resumes from one (the checkpoint holds the adapter only; the base comes from model.path).
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

FINGERPRINT_SAMPLES = 4096
"""Values of each base tensor hashed into its fingerprint (evenly spaced over the flattened tensor)."""
_VOLATILE_CONFIG = ("transformers_version", "dtype", "torch_dtype")
"""Config keys that say how a model was saved or loaded, not which model it is (so are keys starting with
`_`: its path, the attention implementation)."""


def base_config(model: nn.Module) -> dict:
    """The HF config's entries that describe the model (JSON values), less where and how it was loaded."""
    config = model.config.to_dict()
    return json.loads(
        json.dumps(
            {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG},
            default=str,
        )
    )


def config_differences(saved: dict, current: dict) -> dict[str, tuple]:
    """Entries the two configs both have and disagree on (a key only one has, as a newer transformers
    adds, is no difference)."""
    return {
        k: (saved[k], current[k]) for k in sorted(saved.keys() & current.keys()) if saved[k] != current[k]
    }


def base_fingerprint(model: nn.Module) -> dict:
    """Which frozen base a LoRA adapter was trained on, as stored in its checkpoints: `config`, the HF
    config's describing entries (base_config), and `weights`, a hash of every parameter's name, shape and
    FINGERPRINT_SAMPLES evenly spaced values (in fp32, as the trainer loads them). Takes the unsharded HF
    model, before the adapter is added; cheap next to loading it."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            flat = p.detach().reshape(-1)
            n = min(flat.numel(), FINGERPRINT_SAMPLES)
            # integer spacing: a float linspace rounds past the last index on tensors of 2**24+ elements
            idx = torch.arange(n, dtype=torch.int64, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return {"config": base_config(model), "weights": h.hexdigest()[:16]}
