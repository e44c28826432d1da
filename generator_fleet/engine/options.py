"""The built-in engine's options, in one place: `EngineOptions` is what EngineServer runs with, what
`python -m generator_fleet.engine` parses (its flags are generated from the fields: `add_arguments`,
`from_args`), and what a job builds from its generators section. Imports nothing heavy (no torch), so the
job spec and the command line's --help load it in a moment."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from models.config import LoraSpec

MAX_BATCH = 1 << 20
"""Upper bound of a batch, pool or count option: a larger value is a typo, not a plan."""

BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]
"""Most requests an engine decodes together."""
PrefillWaitSteps = Annotated[int, msgspec.Meta(ge=0, le=1024)]
"""Decode steps a queued request may wait for a batched prefill (EngineOptions.prefill_wait_steps)."""


class EngineOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one built-in engine runs: its model, where it listens, its device and the bounds it enforces.
    The API key is not an option here: it is a secret, passed to EngineServer (and read from the
    environment by the command line) on its own."""

    model_path: str
    """HF model directory (config, weights, tokenizer)."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """TCP port; 0 picks a free one (EngineServer.port then holds it)."""
    device: str = "cpu"
    """torch device of the model and KV cache ("cpu", "cuda", "cuda:1")."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Weights and KV cache dtype; null = bf16 on CUDA, fp32 on CPU."""
    max_batch_size: BatchSize = 256
    """Most requests decoded together."""
    prefill_wait_steps: PrefillWaitSteps = 8
    """While the running batch is nearly full, decode steps a queued request may wait so that a prefill
    takes several requests: it runs once the free batch slots hold the queue or an eighth of the batch, or
    after this many steps. 0 = whenever a slot is free (every other step under a steady stream)."""
    disable_radix_cache: bool = False
    """Turn the prefix cache off (SGLang's flag): finished requests' K/V then leaves the pool with them, and
    every multi-turn turn prefills its whole context again."""
    profile_dir: str | None = None
    """Directory /start_profile writes step profiles into (torch.profiler traces and summaries; SGLang's
    $SGLANG_TORCH_PROFILER_DIR); a request's output_dir must lie inside it. null = profiling off."""
    torch_threads: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    """torch intra-op threads (process-wide); null = torch's default."""
    weight_version: str = "0"
    """Weight version the engine starts at (tokens carry it until the first update)."""
    context_length: Annotated[int, msgspec.Meta(ge=2, le=MAX_BATCH * 64)] | None = None
    """Longest prompt + output (tokens); null = the model config's max_position_embeddings."""
    served_model_name: str | None = None
    """Model name in responses and the `model_name` metrics label; null = the model path."""
    kv_cache_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """KV pool size (tokens); null = from free memory on CUDA, 2 GiB worth on CPU."""
    mem_fraction_static: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] | None = None
    """SGLang's --mem-fraction-static (CUDA): share of the GPU's total memory for the weights and the KV
    pool together; the pool gets it minus the weights, so a trainer on the same GPU keeps the rest.
    null = the pool takes half the memory free after loading; kv_cache_tokens wins over both."""
    disable_cuda_graph: bool = False
    """Decode without CUDA graphs (SGLang's flag); graphs are only ever captured on CUDA."""
    fp32_lm_head: bool = False
    """Logits (final norm output x LM head weight) and their log-softmax in fp32 on a bf16/fp16 model, as
    SGLang's --enable-fp32-lm-head: cuts the engine/trainer logprob mismatch."""
    constrained_json_disable_any_whitespace: bool = False
    """json_schema grammars allow only compact/`json.dumps` separators, not any whitespace between JSON
    tokens (SGLang's flag of this name): a weak policy cannot then loop on whitespace inside an object."""
    load_format: Literal["auto", "dummy"] = "auto"
    """`dummy`: random weights from the model's config instead of loading them (benchmarks; SGLang's)."""
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 << 20
    """Larger request bodies get 413 (bytes); a batch of long prompts as token ids is a few MiB."""
    max_requests_per_call: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)] = 1 << 14
    """A /generate asking for more requests (prompts x n) gets 400: each is queued and kept until the call
    returns, so an unbounded `n` would stall the engine for every client."""
    fatal_exit_grace_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 1.0
    """After a fatal CUDA error: how long /health answers 503 with the cause before the server stops (s)."""
    lora: LoraSpec | None = None
    """Serve LoRA adapters of this shape (JSON on the command line): adapters up to its rank on its target
    modules load through the /load_lora_adapter* routes (SGLang's --enable-lora with --max-lora-rank and
    --lora-target-modules); null = no adapters, the forward untouched."""
    max_loras: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    """Adapters loaded at once, with `lora` (SGLang's --max-loras-per-batch); rows of different adapters
    and of the base model share one batch."""


def engine_default(name: str) -> Any:
    """The default of EngineOptions field `name` (for a spec section that exposes the option)."""
    return next(f.default for f in msgspec.structs.fields(EngineOptions) if f.name == name)


CLI_FLAGS: dict[str, tuple[str, ...]] = {"model_path": ("--model", "--model-path")}
"""Flags that are not `--` + the field's name with dashes."""
CLI_DEFAULTS: dict[str, Any] = {"port": 30000}
"""Where the command line's default differs from the struct's: a standalone engine listens on SGLang's
port; one started in-process (tests, job actors) picks a free one."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), read from the class's source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _plain(tp: Any) -> tuple[Any, bool]:
    """(the type behind `tp` with Annotated and `| None` removed, whether None is allowed)."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner, _ = _plain(args[0])
        return inner, True
    return tp, False


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per EngineOptions field, with its docstring as help and its default."""
    hints = typing.get_type_hints(EngineOptions, include_extras=True)
    docs = field_docs(EngineOptions)
    for f in msgspec.structs.fields(EngineOptions):
        tp, _ = _plain(hints[f.name])
        flags = CLI_FLAGS.get(f.name, ("--" + f.name.replace("_", "-"),))
        kw: dict[str, Any] = {"dest": f.name, "help": docs.get(f.name, "")}
        if f.required:
            kw["required"] = True
        else:
            kw["default"] = CLI_DEFAULTS.get(f.name, f.default)
            kw["help"] += " (default: %(default)s)"
        if tp is bool:
            if kw.get("default") is not False:
                raise TypeError(f"{f.name}: a boolean flag must default to False")
            kw["action"] = "store_true"
        elif isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            kw["type"] = json.loads
        elif typing.get_origin(tp) is Literal:
            kw["choices"] = list(typing.get_args(tp))
        else:
            kw["type"] = tp
        p.add_argument(*flags, **kw)


def from_args(args: argparse.Namespace) -> EngineOptions:
    """The options the parsed flags name, checked against the fields' bounds (ValueError if outside)."""
    values = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(EngineOptions)}
    return convert(values)


def convert(values: dict[str, Any]) -> EngineOptions:
    """EngineOptions from plain values, bounds checked; ValueError names the bad option."""
    try:
        return msgspec.convert(values, EngineOptions)
    except msgspec.ValidationError as e:
        raise ValueError(str(e)) from None
