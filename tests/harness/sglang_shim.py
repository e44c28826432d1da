"""A stand-in for `sglang.launch_server`, for machines without SGLang: tests copy it to
<tmp>/sglang/launch_server.py and put <tmp> first on PYTHONPATH, so `python -m sglang.launch_server`
runs this. It parses the flags the fleet passes with SGLang's names, types and choices
(python/sglang/srt/server_args.py: ServerArgs fields, `tp_size` -> `--tp-size`), rejects any other flag
as SGLang's argparse would, and serves Slipstream's built-in engine, so launch, health, registration,
/generate and stop all run for real.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""SGLang's SUPPORTED_LORA_TARGET_MODULES that a Llama-family model has."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang serve")
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--enable-fp32-lm-head", action="store_true")

    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None, choices=LORA_TARGETS + ["all"])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-paths", nargs="*", default=None)
    args = p.parse_args(argv)
    if args.tp_size != 1:
        p.error("the shim serves one built-in engine: --tp-size must be 1")
    return args


def lora_spec(args: argparse.Namespace):
    """The built-in engine's LoRA shape from SGLang's LoRA flags (None without --enable-lora)."""
    if not args.enable_lora:
        return None
    from models.config import LoraSpec

    targets = args.lora_target_modules or LORA_TARGETS
    if "all" in targets:
        targets = LORA_TARGETS
    return LoraSpec(rank=args.max_lora_rank, alpha=args.max_lora_rank, target_modules=list(targets))


def main() -> None:
    args = parse(sys.argv[1:])  # before the heavy imports: a bad flag fails in a moment, as in SGLang
    print("SHIM_ARGS " + json.dumps(vars(args)), flush=True)

    from generator_fleet.engine import EngineServer

    server = EngineServer(
        args.model_path,
        api_key=args.api_key,
        host=args.host,
        port=args.port,
        torch_threads=1,
        weight_version=args.weight_version,
        context_length=args.context_length,
        served_model_name=args.served_model_name,
        mem_fraction_static=args.mem_fraction_static,
        lora=lora_spec(args),
        max_loras=args.max_loras_per_batch,
    ).start()
    for entry in args.lora_paths or []:  # <NAME>=<PATH>, as SGLang loads them at start
        name, _, path = entry.partition("=")
        server.runner.load_lora_from_dir(name, path)

    def shutdown(signum, frame) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, shutdown)
    server.serve_forever()


if __name__ == "__main__":
    main()
