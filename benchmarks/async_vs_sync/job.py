"""The benchmark's job: its raw spec per device and task, the models it runs on, and the external engine
of the cuda path."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
UNBOUNDED_STALENESS = 1_000_000
"""max_staleness of the pipeline-bound session: admission never holds the generators."""
ENGINE_KEY_ENV = "ASYNC_VS_SYNC_ENGINE_KEY"
"""cuda path: the external engine's API key reaches the job through this environment variable."""
HEADLINE_STALENESS = 2

DEFAULTS = {
    "staleness": "0,1,2,4",
    "steps": 30,
    "warmup": 5,
    "groups_per_step": 16,
    "learning_steps": 60,
    "learning_seeds": 2,
    "learning_window": 10,
    "model_warmup_steps": 400,
}
QUICK = {
    "staleness": "0,2",
    "steps": 4,
    "warmup": 2,
    "groups_per_step": 4,
    "learning_steps": 0,
    "learning_seeds": 2,
    "learning_window": 2,
    "model_warmup_steps": 20,
}
CUDA_DEFAULTS = {"groups_per_step": 32}


def log(msg: str) -> None:
    print(f"[async-vs-sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def base_spec(args: argparse.Namespace, model_path: Path, task: str | None = None) -> dict[str, Any]:
    """The job every configuration runs (raw spec dict; name, output_dir, staleness set per run).

    task: `arith` (the demo's a+b job; the CPU default) or `tools` (multi-turn word problems with the
    calculator; the cuda default). The device part: cpu runs the job's built-in engine actor and a gloo
    bus; cuda points the job at this script's external engine and trains on the GPU."""
    task = task or ("arith" if args.device == "cpu" else "tools")
    if task == "arith":
        raw: dict[str, Any] = {
            "model": {"path": str(model_path)},
            "dataset": {"name": "arith", "max_operand": 19, "seed": args.seed},
            "reward": {"name": "arith", "format_weight": 0.1},
            "rollout": {
                "group_size": 8,
                "concurrency": 16,
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6},
            },
            "algorithm": {"loss": "decoupled_ppo", "lr": 5.0e-4, "seed": args.seed},
        }
    elif task == "tools":
        raw = {
            "model": {"path": str(model_path)},
            "dataset": {
                "name": "word_problems",
                "num_problems": 400,
                "difficulty": "easy",
                "seed": args.seed,
            },
            "reward": {"name": "math_verify", "format_weight": 0.1},
            "agent": {"max_turns": 3, "max_total_tokens": args.max_new_tokens * 2, "tool_timeout_s": 5},
            "tools": [{"name": "calculator"}],
            "rollout": {
                "group_size": 8,
                "concurrency": 64,
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens},
            },
            "algorithm": {"loss": "decoupled_ppo", "lr": 1.0e-6, "seed": args.seed},
        }
    else:
        raise ValueError(f"task {task!r}: expected arith or tools")
    if colocated(args):
        # engine and trainer on one device (the job's own engine actor; weights handed over through CUDA
        # IPC / shared memory, the bus's ipc backend)
        raw["placement"] = "colocated"
        raw["generators"] = {"engine": "builtin", "num_engines": 1, "num_workers": 1}
        raw["bus"] = {"backend": "ipc", "pause_mode": "in_place"}
        if args.device == "cuda":
            raw["generators"] |= {"gpus_per_engine": 1, "max_batch_size": args.engine_max_batch}
            if getattr(args, "engine_prefill_wait_steps", None) is not None:  # scale_run has no such option
                raw["generators"]["prefill_wait_steps"] = args.engine_prefill_wait_steps
            raw["trainer"] = {"device": "cuda", "micro_batch_tokens": 16384}
    elif args.device == "cpu":
        raw["generators"] = {"engine": "builtin", "num_engines": 1, "num_workers": 1}
        raw["bus"] = {"backend": "gloo", "pause_mode": "in_place"}
    else:
        raw["generators"] = {
            "engine": "external",
            "urls": ["http://placeholder:1"],
            "api_key_env": ENGINE_KEY_ENV,
        }
        raw["trainer"] = {"device": "cuda", "micro_batch_tokens": 16384}
        raw["bus"] = {"backend": args.bus_backend, "pause_mode": "in_place"}
    raw["algorithm"]["groups_per_step"] = args.groups_per_step
    raw["trainer"] = {**raw.get("trainer", {}), "export_hf": False}
    if getattr(args, "overrides", None):
        from jobspec.loader import apply_overrides

        apply_overrides(raw, args.overrides)
    return raw


def colocated(args: argparse.Namespace) -> bool:
    """`--placement colocated`: the job's engine shares the trainer's device (`placement: colocated`)."""
    return getattr(args, "placement", "disaggregated") == "colocated"


def make_spec(raw: dict, *, name: str, out: Path, max_staleness: int, total_steps: int, **over):
    import jobspec

    raw = json.loads(json.dumps(raw))
    raw["name"], raw["output_dir"] = name, str(out)
    raw["buffer"] = {**raw.get("buffer", {}), "max_staleness": max_staleness}
    raw["algorithm"]["total_steps"] = total_steps
    for key, value in over.items():  # dotted: algorithm.loss=ppo
        section, field = key.split("__")
        raw[section][field] = value
    return jobspec.from_dict(raw)


def build_tiny_arith(args: argparse.Namespace, work: Path) -> Path:
    """The demo's tiny-arith model (SFT warm-up included), built once; every job loads it via model.path.
    With --tiny-model-dir it is built there, or reused from there when that directory already holds one."""
    import jobspec
    from model_zoo.prepare import prepare_model

    where = getattr(args, "tiny_model_dir", None)  # scale_run's arguments have no such option
    path = Path(where).resolve() if where else work / "tiny-arith"
    spec = jobspec.from_dict(
        {
            "model": {"path": str(path), "build": "tiny-arith", "warmup_steps": args.model_warmup_steps},
            "dataset": {"name": "arith", "max_operand": 19, "seed": 0},
        }
    )
    prepare_model(spec.model, spec.dataset)
    return path


MODEL_CACHE_ENV = "SLIPSTREAM_BENCH_MODEL_CACHE"
"""A directory where build_cuda_model keeps each (shape, vocabulary, seed) model it builds and takes it from
the next time: the phases of one device call (each its own process) then build a model once, not once per
phase (26-38 s at 0.5B, 72 s at 1.5B on an H200 host). Unset: every call builds into its work directory."""


def build_cuda_model(args: argparse.Namespace, work: Path) -> Path:
    """Qwen2.5-0.5B-shaped random weights (bf16) with the tiny-tools ChatML tokenizer; the vocabulary is cut
    to the tokenizer's (rounded up to 64) unless --full-vocab. The same arguments give the same weights, so
    with $SLIPSTREAM_BENCH_MODEL_CACHE set a model built before is reused."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.shapes import config_kwargs
    from model_zoo.tiny_tools import build_tokenizer

    tok = build_tokenizer()
    kw = config_kwargs(args.model_shape)
    if not args.full_vocab:
        kw["vocab_size"] = (len(tok) + 63) // 64 * 64
    path = work / "model"
    if cache := os.environ.get(MODEL_CACHE_ENV):
        path = Path(cache) / f"{args.model_shape}-vocab{kw['vocab_size']}-seed{args.seed}"
        if (path / "config.json").exists():
            log(f"model from the cache: {path}")
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(
        **kw,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")  # a killed build leaves no half model
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    try:
        os.replace(partial, path)
    except OSError:  # another process put the same model there meanwhile
        shutil.rmtree(partial)
    return path


class ExternalEngine:
    """cuda path: one built-in engine process on --engine-gpu, loading the model directory; a fresh one per
    job (a job starts at version 0; an engine that served an earlier job holds that job's weights).
    fp32_lm_head: the engine's fp32 LM head (--fp32-lm-head), for a job whose trainer has its own on."""

    def __init__(
        self, args: argparse.Namespace, model: Path, log_path: Path, api_key: str, fp32_lm_head: bool = False
    ) -> None:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "generator_fleet.engine", "--model", str(model), "--port", "0"]
        cmd += ["--api-key", api_key, "--device", "cuda", "--dtype", "bfloat16", "--log-level", "WARNING"]
        cmd += ["--max-batch-size", str(args.engine_max_batch)]
        if args.engine_prefill_wait_steps is not None:
            cmd += ["--prefill-wait-steps", str(args.engine_prefill_wait_steps)]
        if fp32_lm_head:
            cmd.append("--fp32-lm-head")
        cmd += getattr(args, "engine_args", None) or []
        if getattr(args, "engine_profile_steps", 0):  # benchmarks/async_vs_sync/measure.py EngineSampler
            cmd += ["--profile-dir", str(Path(args.out_dir).resolve() / "engine-profiles" / log_path.stem)]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.engine_gpu), "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT
        )
        line = "-"
        while line and not line.startswith("engine ready at "):  # "" when it died
            line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"engine did not start; log tail:\n{log_path.read_text()[-2000:]}")
        self.url = line.split()[-1]
        log(f"engine on GPU {args.engine_gpu} ready in {time.monotonic() - t0:.1f} s")

    def stop(self) -> None:
        t0, how = time.monotonic(), "exited"
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                how = "killed after 30 s"
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        log(f"engine {how} in {time.monotonic() - t0:.1f} s after SIGTERM")


def step_samples(raw: dict) -> int:
    """Samples per optimizer step of a raw job spec."""
    return raw["algorithm"]["groups_per_step"] * raw["rollout"]["group_size"]


def env_info(args) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "host_load_1m_start": os.getloadavg()[0],
    }
    if args.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
    return info
