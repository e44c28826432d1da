"""Model shapes the GPU benchmarks build with random weights (transformers Qwen2Config keyword arguments):
the real Qwen2.5 sizes, and a `tiny` one with the real vocabulary and GQA layout for CPU smoke runs."""

from __future__ import annotations

from typing import Any

VOCAB = 151_936
"""Qwen2.5's vocabulary (0.5B–3B); the LM head over it is a large part of a small model's work."""
COMMON: dict[str, Any] = dict(
    rope_theta=1_000_000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu"
)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": dict(
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b-shape": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b-shape": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152_064,
        tie_word_embeddings=False,
    ),
    # CPU smoke: the real vocabulary (the largest tensor) and GQA layout, two narrow layers.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
}


def config_kwargs(shape: str) -> dict[str, Any]:
    """Qwen2Config keyword arguments of `shape`."""
    return {**COMMON, **SHAPES[shape]}
