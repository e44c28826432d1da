"""Model FLOPs of a training step and the accelerator's peak, for MFU.

Counted per step (matmul FLOPs only, 2 per multiply-add; backward = 2 x forward, so fwd+bwd = 3 passes):

    6 * N_trunk * T                      decoder-layer weights (attention + MLP projections), every token
  + 6 * hidden * vocab * K               LM head, only at the K positions whose logits are computed
  + 6 * layers * d_attn * sum_i L_i^2    attention scores and values, causal (half of 12 L d L_i^2)

T = sum of sample lengths L_i, d_attn = heads * head_dim. Embedding lookups, norms, activations and the
recomputation of activation checkpointing are not counted (MFU counts model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from collections.abc import Sequence

PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}
"""Dense bf16 tensor-core peak (FLOP/s, no sparsity) by GPU name fragment, from NVIDIA's datasheets."""


def peak_flops(device_name: str) -> float | None:
    """bf16 dense peak of a GPU named like torch.cuda.get_device_name(); None if unknown (CPU)."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name.upper():
            return value
    return None


def trunk_params(config) -> int:
    """Weights of the decoder layers that multiply every token (biases and norms left out)."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    attn = h * q + 2 * h * kv + q * h
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attn + mlp)


def step_flops(config, seq_lens: Sequence[int], logit_tokens: int, passes: int = 3) -> float:
    """FLOPs of `passes` passes (3 = forward + backward, 1 = forward) over packed samples of `seq_lens`
    with logits at `logit_tokens` positions (module docstring)."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    d_attn = config.num_attention_heads * head_dim
    tokens = sum(seq_lens)
    per_pass = (
        2 * trunk_params(config) * tokens
        + 2 * h * config.vocab_size * logit_tokens
        + 2 * config.num_hidden_layers * d_attn * sum(n * n for n in seq_lens)
    )
    return float(passes * per_pass)
