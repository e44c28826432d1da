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
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation")
"""Config keys that name where or how a model was loaded, not which model it is."""


def base_fingerprint(model: nn.Module) -> dict[str, str]:
    """Which frozen base a LoRA adapter was trained on, as stored in its checkpoints: `config`, a hash of
    the HF config (less where and how it was loaded), and `weights`, a hash of every parameter's name,
    shape and FINGERPRINT_SAMPLES evenly spaced values (in fp32, as the trainer loads them). Takes the
    unsharded HF model, before the adapter is added; cheap next to loading it."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG}
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, min(flat.numel(), FINGERPRINT_SAMPLES)).long()
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return {"config": config_hash[:16], "weights": h.hexdigest()[:16]}
