"""How generator_fleet/launch.py starts a real SGLang server: `SGLangOptions`, one field per
`python -m sglang.launch_server` flag it sets. Only msgspec: the job spec builds on it without loading
the launcher."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_TOKENS = 1_000_000_000
"""Upper bound of a token count."""
MAX_TIMEOUT_S = 86_400.0
"""Upper bound of a duration in seconds (a day): longer is a typo."""


class SGLangOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One SGLang server's launch options. Each is the `python -m sglang.launch_server` flag of the same
    name (SGLang's python/sglang/srt/server_args.py); the launcher itself sets --model-path, --host,
    --port, --api-key and --weight-version."""

    python: str | None = None
    """Interpreter that has `sglang` installed (SGLang often lives in its own venv or image); null = the
    one running Slipstream."""
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    """--dtype. `auto` is SGLang's rule: FP16 for FP32/FP16 checkpoints, BF16 for BF16 ones."""
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    """--tp-size: tensor-parallel GPUs per engine; each one is a rank of the weight-update group."""
    mem_fraction_static: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] | None = None
    """--mem-fraction-static: share of GPU memory for weights + KV cache; null = SGLang picks."""
    enable_memory_saver: bool = False
    """--enable-memory-saver: lets /release_memory_occupation free the KV cache, weights and CUDA graphs
    (needs the torch_memory_saver package where SGLang runs); a colocated engine needs it."""
    enable_weights_cpu_backup: bool = False
    """--enable-weights-cpu-backup: a release copies the weights to host memory and the resume restores
    them; without it the resumed weights are undefined until the next weight update."""
    enable_fp32_lm_head: bool = False
    """--enable-fp32-lm-head: logits and their log-softmax in fp32 (engine logprobs closer to the trainer's)."""
    context_length: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] | None = None
    """--context-length (tokens); null = the model config's."""
    served_model_name: str | None = None
    """--served-model-name (the `model_name` label of its metrics); null = the model path."""
    skip_server_warmup: bool = False
    """--skip-server-warmup: report healthy without the warm-up request."""
    enable_metrics: bool = True
    """--enable-metrics: serve the sglang:* Prometheus metrics on GET /metrics (SGLang's default is off)."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    """Further launch_server arguments, passed as given (e.g. ["--attention-backend", "triton"])."""
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)] = 900.0
    """Seconds an engine may take to answer GET /health after launch (weight loading, CUDA graphs); at most
    MAX_TIMEOUT_S, a day."""
