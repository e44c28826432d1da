"""Trainer benchmark: model FLOPs utilisation (MFU) and tokens/s of the trainer's packed training step.

What is timed is `Learner.train_step`, the code a job runs per optimizer step: forward + backward of every
packed micro-batch (decoupled-PPO loss, entropy metric, logprobs at the response positions from the fused
chunked LM head unless --logprob-chunk 0), gradient accumulation, grad-norm clipping and the AdamW step,
FSDP2-sharded over the ranks with bf16 compute on GPU. Untimed (reported as prep_s): building the synthetic samples, packing them and scattering them to
the ranks, host work on data the buffer delivers.

Model: random weights of a real shape (Qwen2.5-0.5B / 1.5B: vocab 151936, tied embeddings, GQA), built
with transformers and saved once; every rank loads it as a job would. Data per step: each rank gets
`--micro-batches` micro-batches of exactly `--micro-batch-tokens` tokens, each holding samples of lengths
drawn uniformly from [--min-len, --max-len] (the last one takes the remainder); the first
`--prompt-fraction` of each sample is prompt (no logits computed there), the rest response with random
behaviour logprobs and advantages.

MFU = model FLOPs of the step / step time / (peak bf16 FLOP/s per GPU * ranks), with the FLOPs of
trainer/flops.py: 6 * N_trunk * tokens + 6 * hidden * vocab * response tokens + 6 * layers * d_attn *
sum(len_i^2) (causal attention), i.e. fwd + bwd matmuls, no credit for recomputation. Peak: 989 TFLOP/s
for H100/H200 (dense bf16), or --peak-tflops. Timing: torch.cuda.synchronize() around each step, the
first --warmup steps excluded, mean and median over the rest.

LoRA vs full fine-tuning (--lora RANK): each model is trained twice on the same data in one run, full
fine-tuning then a LoRA adapter of that rank on every linear projection of the decoder (q/k/v/o, gate/up/down;
alpha = 2 x rank), and `ratios.lora_vs_full_tokens_per_s` / `ratios.lora_vs_full_peak_memory` compare them
(the largest model's; per model with a `_<model>` suffix). Peak memory: torch.cuda.max_memory_allocated on
GPU; on CPU the tracked bytes of parameters, gradients (of the trained parameters) and optimizer state,
activations not counted. The FLOPs (and mfu) of a LoRA run use the same formula: it skips the frozen
weights' gradient GEMMs, so its mfu is the full-fine-tuning-equivalent rate.

Run (one GPU / two ranks on one host / CPU smoke / LoRA vs full on one GPU):
    python benchmarks/trainer.py --device-kind nvidia-h200
    torchrun --nproc_per_node 2 benchmarks/trainer.py --device-kind nvidia-h200-x2
    python benchmarks/trainer.py --model tiny --device cpu --ranks 2 --steps 2 --warmup 1 --micro-batch-tokens 512
    python benchmarks/trainer.py --model qwen2.5-1.5b-shape --lora 16 --steps 5 --warmup 2 --device-kind nvidia-h200
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.shapes import SHAPES as _ALL_SHAPES
from benchmarks.shapes import VOCAB, config_kwargs

SHAPES = {k: v for k, v in _ALL_SHAPES.items() if k != "qwen2.5-7b-shape"}
"""What one training GPU holds with AdamW states unsharded (7B needs more ranks)."""

FIRST_TOKEN_ID = 3


def log(msg: str) -> None:
    print(f"[trainer-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model_dir(path: Path, shape: str, seed: int) -> None:
    """Random-weight Qwen2 of `shape`, saved in bf16 (half the bytes to write; ranks load it as fp32)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**config_kwargs(shape))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)


def make_bins(rng: np.random.Generator, bins: int, args) -> list[list]:
    """`bins` lists of samples, each list exactly micro_batch_tokens long (module docstring); the
    aggregation weights are token-mean over all of them."""
    from trainer.packing import TrainSample

    out, total_resp = [], 0
    for _ in range(bins):
        samples, left = [], args.micro_batch_tokens
        while left > 0:
            n = int(rng.integers(args.min_len, args.max_len + 1))
            if left - n < args.min_len:
                n = left
            left -= n
            prompt = max(1, int(n * args.prompt_fraction))
            mask = np.zeros(n, np.float32)
            mask[prompt - 1 : n - 1] = 1.0
            total_resp += int(mask.sum())
            samples.append(
                TrainSample(
                    input_ids=rng.integers(FIRST_TOKEN_ID, VOCAB, size=n).astype(np.int64),
                    loss_mask=mask,
                    behav_logprobs=(-rng.random(n).astype(np.float32) * 3) * mask,
                    advantage=float(rng.standard_normal()),
                    weight=0.0,
                    reward=0.0,
                )
            )
        out.append(samples)
    for s in (s for b in out for s in b):
        s.weight = 1.0 / total_resp
    return out


def make_model_dir(name: str, args, pool) -> str:
    """Rank 0 builds the random-weight model in a temporary directory; every rank gets its path."""
    model_dir = None
    if pool.is_main:
        model_dir = tempfile.mkdtemp(prefix=f"trainer-bench-{name}-", dir=args.tmp_dir)
        t = time.perf_counter()
        build_model_dir(Path(model_dir), name, args.seed)
        log(f"{name}: built random-weight model in {time.perf_counter() - t:.1f} s at {model_dir}")
    return pool.broadcast(model_dir)


def bench_pair(name: str, args, pool) -> list[dict]:
    """Full fine-tuning, then a LoRA adapter (--lora), of one model on the same data (the same seed)."""
    model_dir = make_model_dir(name, args, pool)
    try:
        return [bench_model(name, args, pool, model_dir, lora=lora) for lora in (False, True)]
    finally:
        pool.barrier()
        if pool.is_main:
            shutil.rmtree(model_dir, ignore_errors=True)


def lora_spec(rank: int):
    """The benchmark's adapter: every linear projection of the decoder, alpha = 2 x rank."""
    from models.config import LORA_TARGETS, LoraSpec

    return LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=list(LORA_TARGETS))


def tracked_bytes(learner) -> int:
    """This rank's bytes of parameters, gradients of the trained parameters, and optimizer state."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(learner.model.parameters())
    total = sum(nbytes(p) for p in params) + sum(nbytes(p) for p in params if p.requires_grad)
    for state in learner.opt.state.values():
        total += sum(nbytes(v) for v in state.values() if torch.is_tensor(v))
    return total


def bench_model(name: str, args, pool, model_dir: str | None = None, lora: bool = False) -> dict:
    """One model's timed steps; `model_dir`: built already (and removed by the caller), else built and
    removed here. lora: train an --lora adapter instead of the full model."""
    import jobspec
    from trainer import attention
    from trainer.learner import Learner
    from trainer.packing import pack

    main = pool.is_main
    own_dir = model_dir is None
    if own_dir:
        model_dir = make_model_dir(name, args, pool)
    label = f"{name}-lora" if lora else name
    spec = jobspec.from_dict(
        {
            "model": {"path": model_dir},
            "algorithm": {"loss": "decoupled_ppo", "lr": 1e-6, "kl_coef": 0.001 if args.kl else 0.0},
            "trainer": {
                "device": "cuda" if pool.device.type == "cuda" else "cpu",
                "num_trainers": pool.world_size,
                "micro_batch_tokens": args.micro_batch_tokens,
                "activation_checkpointing": args.activation_checkpointing,
                "offload_optimizer": args.offload,
                "compile": args.compile,
                "logprob_chunk_tokens": args.logprob_chunk,
                "mixed_precision": "bf16",
            },
        }
    )
    if lora:  # on the section: the trainer takes model.lora as a job hands it over
        spec.model.lora = lora_spec(args.lora)
    learner = Learner(spec.model, spec.algorithm, spec.trainer, pool)
    t = time.perf_counter()
    learner.setup()
    n_params = sum(p.numel() for p in learner.model.parameters())  # DTensor numel is the global one
    n_trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    if main:
        log(
            f"{label}: {n_params / 1e6:.0f} M params, {n_trained / 1e6:.1f} M trained (sharded over "
            f"{pool.world_size}) ready in {time.perf_counter() - t:.1f} s"
        )
    rng = np.random.default_rng(args.seed)
    steps = []
    cuda = pool.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    profile = None
    for step in range(args.warmup + args.steps + (1 if args.profile else 0)):
        if step == args.warmup + args.steps:  # --profile: one more step, untimed, under torch.profiler
            profile = _profiler(cuda)
            profile.__enter__()
        t_prep = time.perf_counter()
        per_rank, seq_lens = None, []
        if main:  # exactly --micro-batches full micro-batches per rank (Learner.distribute's plan_step
            # would pack the same samples, but first-fit may need one bin more than they were cut into)
            bins = make_bins(rng, pool.world_size * args.micro_batches, args)
            seq_lens = [len(s) for b in bins for s in b]
            per_rank = [
                [pack(b) for b in bins[r * args.micro_batches : (r + 1) * args.micro_batches]]
                for r in range(pool.world_size)
            ]
        mbs = pool.scatter(per_rank)
        prep_s = time.perf_counter() - t_prep
        if cuda:
            torch.cuda.synchronize()
        pool.barrier()
        t0 = time.perf_counter()
        stats = learner.train_step(mbs)
        if cuda:
            torch.cuda.synchronize()
        step_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=pool.device)
        step_s = float(pool.all_reduce(step_s, torch.distributed.ReduceOp.MAX)[0])  # the slowest rank's
        rec = {
            "step_s": step_s,
            "prep_s": prep_s,
            "flops": stats["flops"],
            "loss": stats["loss"],
            "micro_batches": len(mbs),
            "tokens": sum(seq_lens),
            "samples": len(seq_lens),
            "response_tokens": int(stats["trained_tokens"]),
        }
        if profile is not None:
            profile.__exit__(None, None, None)
            if main:
                profile_top = _profile_summary(profile, cuda)
            continue
        warm = step < args.warmup
        if not warm:
            steps.append(rec)
        if main:
            mfu = (
                rec["flops"] / step_s / (args.peak_flops * pool.world_size)
                if args.peak_flops
                else float("nan")
            )
            log(
                f"{label} step {step + 1}/{args.warmup + args.steps}{' (warm-up)' if warm else ''}: "
                f"{step_s * 1e3:.1f} ms, prep {prep_s * 1e3:.0f} ms, {rec['tokens']} tokens in "
                f"{rec['samples']} samples, {len(mbs)} micro-batches/rank, "
                f"{rec['flops'] / step_s / pool.world_size / 1e12:.1f} TFLOP/s/GPU, mfu {mfu:.3f}, loss {rec['loss']:+.4f}"
            )
    # the largest rank's: CUDA's peak allocation, or on CPU the tracked state (module docstring)
    mem = torch.cuda.max_memory_allocated() if cuda else tracked_bytes(learner)
    mem = torch.tensor([mem / 2**30], dtype=torch.float64, device=pool.device)
    peak_mem = float(pool.all_reduce(mem, torch.distributed.ReduceOp.MAX)[0])
    config = dict(learner.config.to_dict())
    del learner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    pool.barrier()
    if main and own_dir:
        shutil.rmtree(model_dir, ignore_errors=True)
    times = [r["step_s"] for r in steps]
    mean_s = statistics.mean(times)
    flops_step = statistics.mean(r["flops"] for r in steps)
    tokens = statistics.mean(r["tokens"] for r in steps)
    out = {
        "model": name,
        "label": label,
        "mode": "lora" if lora else "full",
        "lora": {"rank": args.lora, "alpha": 2.0 * args.lora, "target_modules": "all linear"}
        if lora
        else None,
        "params": n_params,
        "trained_params": n_trained,
        "world_size": pool.world_size,
        "shape": {
            k: config[k]
            for k in (
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "num_hidden_layers",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
        },
        "micro_batches_per_rank": steps[0]["micro_batches"],
        "tokens_per_step": tokens,
        "samples_per_step": statistics.mean(r["samples"] for r in steps),
        "response_tokens_per_step": statistics.mean(r["response_tokens"] for r in steps),
        "flops_per_step": flops_step,
        "step_s_mean": mean_s,
        "step_s_p50": statistics.median(times),
        "step_s_min": min(times),
        "prep_s_mean": statistics.mean(r["prep_s"] for r in steps),
        "tokens_per_s": tokens / mean_s,
        "tokens_per_s_per_gpu": tokens / mean_s / pool.world_size,
        "tflops_per_gpu": flops_step / mean_s / pool.world_size / 1e12,
        "mfu": flops_step / mean_s / (args.peak_flops * pool.world_size) if args.peak_flops else None,
        "peak_mem_gib": peak_mem,
        "peak_mem_source": "cuda.max_memory_allocated"
        if cuda
        else "tracked: params + grads of trained params + optimizer state",
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "profile": profile_top if (args.profile and main) else None,
        "attention_kernels": sorted(attention._kernel_logged),
        "varlen_error": attention._VARLEN_BROKEN[0] if attention._VARLEN_BROKEN else None,
    }
    return out


def _profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=acts)


PROFILE_CLASSES = (  # first match wins: flash kernels' names mention cutlass
    ("attention", ("flash", "fmha", "attention")),
    ("gemm", ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet", "matmul")),
    ("nccl", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("triton", ("triton",)),
)


def _profile_summary(prof, cuda: bool, top: int = 25) -> dict:
    """Where one step's device time went: the `top` kernels by self device time, and totals per class
    (gemm, attention, nccl, optimizer, compiled triton kernels, other), printed and returned."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if cuda:  # kernels only: CPU-side ops also carry a device time of the kernels they launched
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    classes: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        cls = next((c for c, keys in PROFILE_CLASSES if any(k in name for k in keys)), "other")
        classes[cls] = classes.get(cls, 0.0) + getattr(e, attr) / 1e3
    rows = [
        {
            "kernel": e.key[:120],
            "ms": getattr(e, attr) / 1e3,
            "calls": e.count,
            "share": getattr(e, attr) / total,
        }
        for e in events[:top]
    ]
    log(
        f"profile: {total / 1e3:.1f} ms of {'device' if cuda else 'CPU'} time; by class (ms): "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1]))
    )
    for r in rows:
        log(f"  {r['ms']:8.2f} ms {r['share']:6.1%} x{r['calls']:<5} {r['kernel']}")
    return {"device_ms": total / 1e3, "classes_ms": classes, "top": rows}


def worker(rank: int, world: int, port: int, args) -> dict | None:
    from trainer.distributed import DistInfo, RankGroup
    from trainer.flops import peak_flops

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging_setup()
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if "TORCHELASTIC_RUN_ID" in os.environ and not torch.distributed.is_initialized():
        # torchrun's agent already serves the rendezvous store on MASTER_PORT: join through env://.
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        torch.distributed.init_process_group(backend, init_method="env://", **kw)
    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), device)
    if args.peak_tflops:
        args.peak_flops = args.peak_tflops * 1e12
    else:
        args.peak_flops = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if args.lora:
        results = [r for m in args.model for r in bench_pair(m, args, pool)]
    else:
        results = [bench_model(m, args, pool) for m in args.model]
    result = None
    if pool.is_main:
        result = write_result(results, args, device)
    pool.close()
    return result


def logging_setup() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer.attention").setLevel(logging.INFO)  # which attention kernel ran


def write_result(results: list[dict], args, device: torch.device) -> dict:
    import transformers

    head = max((r for r in results if r["mode"] == "full"), key=lambda r: r["params"])
    metrics = {
        "mfu": head["mfu"],
        "tokens_per_s": head["tokens_per_s"],
        "step_s": head["step_s_mean"],
        "headline_model": head["model"],
    }
    for r in results:
        metrics[f"mfu_{r['label']}"] = r["mfu"]
        metrics[f"tokens_per_s_{r['label']}"] = r["tokens_per_s"]
        metrics[f"tflops_per_gpu_{r['label']}"] = r["tflops_per_gpu"]
        metrics[f"step_s_{r['label']}"] = r["step_s_mean"]
        metrics[f"peak_mem_gib_{r['label']}"] = r["peak_mem_gib"]
    ratios = lora_ratios(results, head["model"])
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "host_load_1m": os.getloadavg()[0],
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    today = datetime.date.today()
    result = {
        "benchmark": "trainer",
        "device": args.device_kind,
        "date": today.isoformat(),
        "command": "python benchmarks/trainer.py " + shlex.join(args.argv),
        "config": {
            "models": args.model,
            "ranks": results[0]["world_size"],
            "device": device.type,
            "micro_batch_tokens": args.micro_batch_tokens,
            "micro_batches_per_rank": args.micro_batches,
            "sample_len": [args.min_len, args.max_len],
            "prompt_fraction": args.prompt_fraction,
            "steps": args.steps,
            "warmup": args.warmup,
            "activation_checkpointing": args.activation_checkpointing,
            "compile": args.compile,
            "logprob_chunk_tokens": args.logprob_chunk,
            "cpu_offload": args.offload,
            "reference_model": args.kl,
            "lora_rank": args.lora,
            "peak_flops_per_gpu": args.peak_flops,
            "flops_formula": "6*N_trunk*T + 6*hidden*vocab*T_response + 6*layers*d_attn*sum(L_i^2)",
            "env": env,
        },
        "metrics": metrics,
        "ratios": ratios,
        "runs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = result_path(args, today)
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path}")
    for r in results:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        print(
            f"trainer mfu={mfu} tokens_per_s={r['tokens_per_s']:.0f} step_s={r['step_s_mean']:.4f} "
            f"tflops_per_gpu={r['tflops_per_gpu']:.1f} peak_mem_gib={r['peak_mem_gib']:.3f} "
            f"(model={r['label']}, ranks={r['world_size']}, device={args.device_kind})",
            flush=True,
        )
    if ratios:
        print(" ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)
    return result


def lora_ratios(results: list[dict], headline: str) -> dict:
    """LoRA ÷ full fine-tuning of each model run both ways: tokens/s and peak memory, suffixed with the
    model's name, and unsuffixed for `headline` (the largest model)."""
    out = {}
    for full in (r for r in results if r["mode"] == "full"):
        lora = next((r for r in results if r["mode"] == "lora" and r["model"] == full["model"]), None)
        if lora is None:
            continue
        tok = lora["tokens_per_s"] / full["tokens_per_s"]
        mem = lora["peak_mem_gib"] / full["peak_mem_gib"]
        out[f"lora_vs_full_tokens_per_s_{full['model']}"] = tok
        out[f"lora_vs_full_peak_memory_{full['model']}"] = mem
        if full["model"] == headline:
            out["lora_vs_full_tokens_per_s"] = tok
            out["lora_vs_full_peak_memory"] = mem
    return out


def result_path(args, day: datetime.date) -> Path:
    """benchmarks/results/trainer-<device>[-lora<rank>]-<YYYYMMDD>.json"""
    label = f"-lora{args.lora}" if args.lora else ""
    return args.out / f"trainer-{args.device_kind}{label}-{day:%Y%m%d}.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", nargs="+", choices=list(SHAPES), default=["qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"]
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--device-kind", help="device named in the result file (nvidia-h200, nvidia-h200-x2, cpu)")
    p.add_argument("--ranks", type=int, default=1, help="spawn this many ranks (not needed under torchrun)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=8,
        help="micro-batches per rank per optimizer step (8 x 8k = 64k tokens per GPU per step: an RL step of "
        "a few hundred samples is larger still; fewer leaves the optimizer step a larger share)",
    )
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--prompt-fraction", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile each decoder layer and the fused head's kernels"
    )
    p.add_argument(
        "--logprob-chunk",
        type=int,
        default=2048,
        help="fused LM head + log-softmax over chunks of this many positions (trainer.logprob_chunk_tokens); "
        "0 = plain unchunked log-softmax",
    )
    p.add_argument("--offload", action="store_true", help="FSDP2 CPU offload of params/grads/optimizer")
    p.add_argument("--kl", action="store_true", help="also run a frozen reference model (KL penalty)")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="run each model twice, full fine-tuning and a LoRA adapter of this rank on every linear "
        "projection, and report the ratios (0: full fine-tuning only)",
    )
    p.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s per device (default: by GPU name)")
    p.add_argument(
        "--profile", action="store_true", help="one extra untimed step under torch.profiler: top kernels"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp-dir", help="where the random-weight model is saved (default: system temp)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.argv = argv
    args.min_len = min(args.min_len, args.micro_batch_tokens)
    args.max_len = min(max(args.max_len, args.min_len), args.micro_batch_tokens)
    if args.device_kind is None:
        world = int(os.environ.get("WORLD_SIZE", args.ranks))
        args.device_kind = "cpu" if args.device == "cpu" else f"cuda-x{world}"
    return args


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        return worker(
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), args
        )
    if args.ranks == 1:
        return worker(0, 1, free_port(), args)
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _spawned, args=(args.ranks, free_port(), args), nprocs=args.ranks, join=False, start_method="spawn"
    )
    while not ctx.join():
        pass
    return json.loads(result_path(args, datetime.date.today()).read_text())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args) -> None:
    worker(rank, world, port, args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
