"""Built-in engine benchmark: decode tokens/s and time-to-first-token of generator_fleet's Runner against HF
`generate` on the same prompts, same model, dtype and device, side by side in one run.

The model is random-weight with a real shape (Qwen2.5-0.5B by default: speed does not depend on the weight
values), built with transformers and saved to a temporary directory with a small tokenizer; prompts are
sent as token ids, so the tokenizer only has to load. Every request is greedy with ignore_eos (HF:
min_new_tokens = max_new_tokens), so both sides generate exactly `max_new_tokens` per request.

Per concurrency c, after an untimed warm-up at the same c on other prompts (CUDA graph capture, allocator,
and no prefix-cache hits for the timed prompts):

- engine: c requests submitted at once (the runner is paused while they are queued, so all c arrive at one
  step boundary), wall time until the last finishes. tokens/s = c * max_new_tokens / wall (prefill
  included). TTFT p50/p90 from the completions (time from Request creation to its first token).
- HF: `model.generate` on the same c prompts as one left-padded batch (SDPA attention). tokens/s = c * N /
  wall. TTFT = wall time of the same generate with max_new_tokens=1 (every row gets its first token then).

Roofline: HBM bandwidth is measured once with a large device-to-device copy (read + write bytes). A decode
step reads every weight once (the tied embedding counted once: the lm_head reads the whole matrix, the
input lookup only c rows), so weight_bytes_per_step / bandwidth bounds the step time from below. The
engine's step time at concurrency c is taken as c / tokens_per_s (c tokens per step), and
roofline_fraction_c{c} = bound / step time. KV bytes read per step are reported alongside (and a bound
counting them), since at high concurrency they are no longer small next to the weights.

Both sides stay loaded and take turns at each concurrency (engine then HF, HF then engine at the next), so
drifting load on a shared host falls on both alike. HF is loaded first: the engine sizes its KV pool from
the memory left, capped by max_batch_size x context_length (context_length defaults to the longest prompt +
max_new_tokens here, so the pool is small and HF's transient memory fits beside it).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch

from benchmarks.common import ResultFile
from benchmarks.shapes import COMMON, SHAPES, VOCAB, config_kwargs

TOKENIZER_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "
"""A throwaway character-level tokenizer (prompts go in as ids); the model keeps the full vocabulary."""
FIRST_PROMPT_ID = 3
"""Prompt ids are drawn from [FIRST_PROMPT_ID, VOCAB): above the tokenizer's pad/bos/eos ids."""
PROMPT_LEN_SPREAD = 0.25
"""Prompt lengths are uniform in prompt_len * (1 ± this): left padding costs HF something, as in practice."""
WARMUP_NEW_TOKENS = 16
"""New tokens per request in each warm-up run (capped at max_new_tokens)."""
HF_TTFT_REPEATS = 3
"""HF TTFT is the median of this many max_new_tokens=1 generates."""
BANDWIDTH_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}
"""Size of the buffer copied to measure memory bandwidth (well above any cache)."""
BANDWIDTH_ITERS = {"cuda": 20, "cpu": 5}

DEFAULTS = {
    "model": "qwen2.5-0.5b-shape",
    "concurrency": "1,16,64,256",
    "max_new_tokens": 256,
    "prompt_len": 128,
}
QUICK = {"model": "tiny", "concurrency": "1,4", "max_new_tokens": 8, "prompt_len": 32}


def log(msg: str) -> None:
    print(f"[engine-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- model and prompts ----------------------------------------------------------------------------


def build_model_dir(
    path: Path, shape: str, dtype: torch.dtype, seed: int, device: torch.device | None = None
) -> dict:
    """Random-weight Qwen2 model of `shape` + a tokenizer the Runner loads, saved to `path` in `dtype`.
    The random init runs on `device` (on a GPU the 7B shape builds in seconds; on the CPU it takes
    minutes). Returns the config as saved."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from model_zoo.tiny import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER_ALPHABET, [TOKENIZER_ALPHABET])
    cfg = Qwen2Config(
        **config_kwargs(shape),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    assert model.get_output_embeddings().weight.shape[0] == SHAPES[shape]["vocab_size"]
    model.save_pretrained(path)
    del model
    _free(device or torch.device("cpu"))
    tokenizer.save_pretrained(path)
    return cfg.to_dict()


def make_prompts(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo = max(1, round(prompt_len * (1 - PROMPT_LEN_SPREAD)))
    hi = max(lo, round(prompt_len * (1 + PROMPT_LEN_SPREAD)))
    lens = rng.integers(lo, hi + 1, n)
    return [rng.integers(FIRST_PROMPT_ID, VOCAB, int(k)).tolist() for k in lens]


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- measurements ---------------------------------------------------------------------------------


def memory_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large copy, counting the read and the write."""
    n, iters = BANDWIDTH_BYTES[device.type], BANDWIDTH_ITERS[device.type]
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    t0 = perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    seconds = perf_counter() - t0
    del src, dst
    _free(device)
    return 2 * n * iters / seconds


class HFSide:
    """HF `generate` on one left-padded batch of the c prompts (SDPA attention, the model's defaults)."""

    name = "hf"

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        self.model = model.to(device).eval()
        self.device = device
        self.pad = model.config.pad_token_id

    generate_kwargs: dict[str, Any] = {}

    def generate(self, batch: list[list[int]], n: int) -> tuple[float, torch.Tensor]:
        ids, mask = left_pad(batch, self.pad, self.device)
        _sync(self.device)
        t0 = perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=self.pad,
            **self.generate_kwargs,
        )
        _sync(self.device)
        return perf_counter() - t0, out[:, ids.shape[1] :]

    def measure(self, prompts: list[list[int]], warm_prompts: list[list[int]], n_new: int) -> dict[str, Any]:
        c = len(prompts)
        self.generate(warm_prompts, min(WARMUP_NEW_TOKENS, n_new))
        ttft = statistics.median(self.generate(prompts, 1)[0] for _ in range(HF_TTFT_REPEATS))
        wall, new = self.generate(prompts, n_new)
        if tuple(new.shape) != (c, n_new):
            raise RuntimeError(f"HF generated shape {tuple(new.shape)}, expected {(c, n_new)}")
        return {
            "tokens_per_s": c * n_new / wall,
            "wall_s": wall,
            "ttft_s": ttft,
            "decode_step_s": (wall - ttft) / (n_new - 1) if n_new > 1 else None,
        }

    def close(self) -> None:
        del self.model


class HFStaticSide(HFSide):
    """HF `generate` with a static KV cache (`cache_implementation="static"`): on CUDA transformers then
    compiles the decoding forward with torch.compile (its default compile config), the strongest plain-HF
    decode. The warm-up at the same concurrency absorbs the compile; each new batch shape (c, the padded
    prompt length + n) is a new static cache, so the TTFT generate (n = 1) compiles its own shape first."""

    name = "hf_static"
    generate_kwargs = {"cache_implementation": "static"}

    def measure(self, prompts: list[list[int]], warm_prompts: list[list[int]], n_new: int) -> dict[str, Any]:
        self.generate(prompts, 1)  # compile the TTFT shape outside the timing
        self.generate(prompts, n_new)  # and the timed shape (same padded length and n as the timed run)
        return super().measure(prompts, warm_prompts, n_new)


PROFILE_STEPS = 16
PROFILE_TOP = 15


class EngineSide:
    """The built-in engine's Runner, driven in-process as the HTTP server drives it."""

    name = "engine"

    def __init__(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, runner_kwargs: dict[str, Any]
    ) -> None:
        from generator_fleet.engine.request import Request, SamplingParams
        from generator_fleet.engine.runner import Runner

        self.Request, self.SamplingParams = Request, SamplingParams
        self.device = device
        self.runner = Runner(str(model_dir), device=str(device), dtype=dtype, **runner_kwargs)
        self.runner.start()

    lora_name: str | None = None
    """The adapter every request runs with (EngineLoraSide)."""

    def run_batch(self, tag: str, batch: list[list[int]], n: int) -> tuple[float, list]:
        params = self.SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        _sync(self.device)
        # Paused while queueing, so all requests reach the generation thread at one step boundary instead
        # of the first one starting alone while the others are still being submitted.
        self.runner.pause("in_place")
        try:
            t0 = perf_counter()
            futures = [
                self.runner.submit(self.Request(f"{tag}-{i}", p, params, lora_name=self.lora_name))
                for i, p in enumerate(batch)
            ]
        finally:
            self.runner.resume()
        completions = [f.result() for f in futures]
        _sync(self.device)
        return perf_counter() - t0, completions

    def measure(self, prompts: list[list[int]], warm_prompts: list[list[int]], n_new: int) -> dict[str, Any]:
        c = len(prompts)
        # the warm-up runs as long as the timed run, so every CUDA graph bucket it reaches (batch, KV
        # length) is captured outside the timing, as HFStaticSide compiles its timed shape first
        self.run_batch(f"warm{c}", warm_prompts, n_new)
        wall, done = self.run_batch(f"c{c}", prompts, n_new)
        lens = [len(d.output_ids) for d in done]
        ttfts = [d.time_to_first_token for d in done if d.time_to_first_token is not None]
        m: dict[str, Any] = {
            "tokens_per_s": sum(lens) / wall,
            "wall_s": wall,
            "output_tokens_min": min(lens),
            "output_tokens_max": max(lens),
            "finish_types": sorted({d.finish_reason.get("type", "?") for d in done}),
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts else None,
            "ttft_max_s": max(ttfts) if ttfts else None,
            "e2e_p50_s": float(np.percentile([d.e2e_latency for d in done], 50)),
        }
        # Once the last request has its first token every request is decoding: the rest of the wall time
        # over the remaining steps is the decode step with no prefill in it.
        m["decode_step_s"] = (wall - m["ttft_max_s"]) / (n_new - 1) if n_new > 1 and ttfts else None
        if min(lens) != n_new or max(lens) != n_new:
            raise MeasureError(f"engine produced {min(lens)}..{max(lens)} tokens, expected {n_new}", m)
        return m

    def profile(self, prompts: list[list[int]], steps: int = PROFILE_STEPS) -> dict[str, Any]:
        """CUDA kernels of one decode step at concurrency len(prompts): the same prompts are run under
        torch.profiler once with 1 new token (prefill only) and once with 1 + `steps`; the difference over
        `steps` is what one decode step launches and spends, per kernel name (the top ones by time)."""
        from torch.profiler import ProfilerActivity, profile

        if self.device.type != "cuda":
            raise RuntimeError("--profile summarises CUDA kernels: it needs --device cuda")

        def kernels(n: int) -> dict[str, tuple[int, float]]:
            self.run_batch("profwarm", prompts, n)  # graphs for these buckets captured outside the profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                self.run_batch("prof", prompts, n)
            out: dict[str, tuple[int, float]] = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    cnt, us = out.get(ev.name, (0, 0.0))
                    out[ev.name] = (cnt + 1, us + ev.device_time_total)
            return out

        base, full = kernels(1), kernels(1 + steps)
        per = {
            name: ((cnt - base.get(name, (0, 0.0))[0]) / steps, (us - base.get(name, (0, 0.0))[1]) / steps)
            for name, (cnt, us) in full.items()
        }
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:PROFILE_TOP]
        return {
            "concurrency": len(prompts),
            "steps": steps,
            "kernels_per_step": sum(c for c, _ in per.values()),
            "kernel_us_per_step": sum(u for _, u in per.values()),
            "top_kernels": [{"name": n[:160], "calls_per_step": c, "us_per_step": u} for n, (c, u) in top],
        }

    def close(self) -> None:
        self.runner.stop()
        del self.runner


class EngineLoraSide(EngineSide):
    """The engine with one LoRA adapter of rank `rank` on every projection loaded (random A and B), every
    request running with it: decode tokens/s next to the plain engine's."""

    name = "engine_lora"

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        runner_kwargs: dict[str, Any],
        rank: int,
    ) -> None:
        from generator_fleet.engine.lora import module_dims
        from models.config import LoraSpec

        spec = LoraSpec(rank=rank, alpha=2 * rank)
        super().__init__(model_dir, dtype, device, {**runner_kwargs, "lora": spec, "max_loras": 1})
        cfg = self.runner.config
        dims = module_dims(cfg)
        gen = torch.Generator().manual_seed(0)
        tensors = {}
        for i in range(cfg.num_hidden_layers):
            for mod in spec.target_modules:
                part = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                base = f"base_model.model.model.layers.{i}.{part}.{mod}"
                d_in, d_out = dims[mod]
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
                tensors[f"{base}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
        self.runner.load_lora("bench", spec.peft_config(), tensors)
        self.lora_name = "bench"


class MeasureError(RuntimeError):
    """A measurement that ran but is wrong; the numbers are still recorded next to the error."""

    def __init__(self, message: str, metrics: dict[str, Any]) -> None:
        super().__init__(message)
        self.metrics = metrics


# --- the run --------------------------------------------------------------------------------------


def weight_bytes(cfg: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(all parameter bytes, bytes one decode step reads): parameters counted once, tied or not; an
    untied input embedding is left out of the per-step figure (the lookup reads c rows of it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=dtype)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups tied
    step = total
    if not cfg["tie_word_embeddings"]:
        emb = model.get_input_embeddings().weight
        step -= emb.numel() * emb.element_size()
    return total, step


def kv_bytes_per_token(cfg: dict, dtype: torch.dtype) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * elem


def runner_kwargs_for(args: argparse.Namespace, device: torch.device, context_length: int) -> dict[str, Any]:
    """Only the keywords this Runner has: the script runs against the runner before and after its rewrite."""
    from generator_fleet.engine.runner import Runner

    params = inspect.signature(Runner).parameters
    want: dict[str, Any] = {
        "max_batch_size": args.max_batch_size,
        "context_length": args.context_length or context_length,
        "kv_cache_tokens": args.kv_cache_tokens,
        "cuda_graphs": device.type == "cuda" and not args.no_cuda_graphs,
    }
    kw = {k: v for k, v in want.items() if k in params}
    if kw.get("kv_cache_tokens", 0) is None:
        del kw["kv_cache_tokens"]  # the engine's own default
    return kw


def env_info(device: torch.device) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_load_1m": os.getloadavg()[0],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "device_name": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        }
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    """The whole benchmark; `result` is written to disk after every measurement and on every way out."""
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    n_new = args.max_new_tokens
    prompts = make_prompts(max(concurrencies), args.prompt_len, args.seed)
    warm_prompts = make_prompts(max(concurrencies), args.prompt_len, args.seed + 1)
    prompt_lens = [len(p) for p in prompts]
    context_length = max(map(len, prompts + warm_prompts)) + n_new

    rf = ResultFile(
        "engine",
        args.device_kind,
        argv,
        args.out_dir,
        config={
            "model": args.model,
            "device": str(device),
            "dtype": args.dtype,
            "concurrency": concurrencies,
            "max_new_tokens": n_new,
            "prompt_len": args.prompt_len,
            "prompt_len_min": min(prompt_lens),
            "prompt_len_max": max(prompt_lens),
            "prompt_len_mean": statistics.fmean(prompt_lens),
            "warmup_new_tokens": min(WARMUP_NEW_TOKENS, n_new),
            "seed": args.seed,
            "lora_rank": args.lora,
            "env": env_info(device),
        },
    )
    result, out_path, save = rf.result, rf.path, rf.save
    m, r = result["metrics"], result["ratios"]
    sides: dict[tuple[int, str], dict] = {}

    def record(c: int, side: str, metrics: dict[str, Any]) -> None:
        sides[c, side] = metrics
        m.update({f"{side}_{k}_c{c}": v for k, v in metrics.items()})
        derive(c)
        save()
        ttft = metrics.get("ttft_p50_s", metrics.get("ttft_s"))
        ttft_ms = "-" if ttft is None else f"{ttft * 1e3:.1f}"
        log(f"{side} c={c}: {metrics['tokens_per_s']:,.0f} tok/s, TTFT {ttft_ms} ms")

    def error(c: int | None, side: str, exc: BaseException) -> None:
        log(f"{side} c={c} FAILED: {exc!r}")
        tb = traceback.format_exception(exc)[-3:]
        result["errors"].append({"concurrency": c, "side": side, "error": repr(exc), "traceback": tb})
        save()

    def derive(c: int) -> None:
        eng, hf = sides.get((c, "engine")), sides.get((c, "hf"))
        if eng and hf:
            r[f"vs_hf_generate_c{c}"] = eng["tokens_per_s"] / hf["tokens_per_s"]
        hfs = sides.get((c, "hf_static"))
        if eng and hfs:
            r[f"vs_hf_static_c{c}"] = eng["tokens_per_s"] / hfs["tokens_per_s"]
        lora = sides.get((c, "engine_lora"))
        if eng and lora:
            r[f"lora_vs_base_c{c}"] = lora["tokens_per_s"] / eng["tokens_per_s"]
        kv = c * m["kv_bytes_per_token"] * (statistics.fmean(prompt_lens[:c]) + n_new / 2)
        m[f"kv_bytes_per_step_c{c}"] = kv
        if eng and m.get("memory_bandwidth_bytes_per_s"):
            step = c / eng["tokens_per_s"]
            m[f"engine_step_s_c{c}"] = step
            m[f"roofline_fraction_c{c}"] = m["weight_bound_step_s"] / step
            bw = m["memory_bandwidth_bytes_per_s"]
            m[f"roofline_fraction_weights_kv_c{c}"] = (m["weight_bytes_per_step"] + kv) / bw / step

    try:
        with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
            model_dir = Path(tmp)
            t0 = perf_counter()
            cfg = build_model_dir(model_dir, args.model, dtype, args.seed, device)
            log(f"built {args.model} ({dtype}) in {perf_counter() - t0:.1f}s")
            keys = [*COMMON, *SHAPES[args.model], "rope_parameters"]  # transformers 5 nests rope_theta
            result["config"]["model_config"] = {k: cfg[k] for k in keys if k in cfg}
            total, per_step = weight_bytes(cfg, dtype)
            m |= {"weight_bytes": total, "weight_bytes_per_step": per_step}
            m["kv_bytes_per_token"] = kv_bytes_per_token(cfg, dtype)
            bw = memory_bandwidth(device)
            m["memory_bandwidth_bytes_per_s"] = bw
            m["weight_bound_step_s"] = per_step / bw
            log(f"memory bandwidth {bw / 1e9:,.0f} GB/s; weights {per_step / 1e6:,.0f} MB per step")
            save()

            kw = runner_kwargs_for(args, device, context_length)
            result["config"]["runner_kwargs"] = kw
            live: list[HFSide | EngineSide] = []
            try:
                # HF first: the engine sizes its KV pool from the memory left (capped by context_length).
                makers = {
                    "hf": lambda: HFSide(model_dir, dtype, device),
                    "hf_static": lambda: HFStaticSide(model_dir, dtype, device),
                    "engine": lambda: EngineSide(model_dir, dtype, device, kw),
                    "engine_lora": lambda: EngineLoraSide(model_dir, dtype, device, kw, args.lora),
                }
                peers = [x for x in args.peers.split(",") if x]
                order = [*peers, "engine", *(["engine_lora"] if args.lora else [])]
                for name, make in [(n, makers[n]) for n in order]:
                    log(f"loading {name}" + (f": Runner({kw})" if name == "engine" else ""))
                    try:
                        live.append(make())
                    except Exception as exc:  # noqa: BLE001 - the other side still runs
                        error(None, name, exc)
                for i, c in enumerate(concurrencies):
                    # engine, HF at one concurrency, HF, engine at the next: drift in the host's load (a
                    # shared CPU box) falls on both sides alike.
                    for side in sorted(live, key=lambda s: s.name, reverse=i % 2 == 1):
                        log(f"{side.name} c={c}: warm-up, then {c} x {n_new} tokens")
                        try:
                            record(c, side.name, side.measure(prompts[:c], warm_prompts[:c], n_new))
                        except MeasureError as exc:
                            record(c, side.name, exc.metrics)
                            error(c, side.name, exc)
                        except Exception as exc:  # noqa: BLE001 - recorded; the next one still runs
                            error(c, side.name, exc)
                            _free(device)
                    eng_side = next((s for s in live if s.name == "engine"), None)
                    if args.profile and eng_side is not None and c == max(concurrencies):
                        try:
                            result["profile"] = eng_side.profile(prompts[:c])
                            pr = result["profile"]
                            log(
                                f"profile c={c}: {pr['kernels_per_step']:.0f} kernels, "
                                f"{pr['kernel_us_per_step']:.0f} us of kernels per decode step"
                            )
                            save()
                        except Exception as exc:  # noqa: BLE001
                            error(c, "profile", exc)
            finally:
                for side in live:
                    side.close()
                _free(device)
    except BaseException as exc:  # incl. KeyboardInterrupt: what was measured is still written
        error(None, "setup", exc)
        if not isinstance(exc, Exception):
            raise
    finally:
        result["config"]["env"]["host_load_1m_end"] = os.getloadavg()[0]
        save()
        log(f"wrote {out_path}")
    return result


def report(result: dict) -> str:
    m, r, cfg = result["metrics"], result["ratios"], result["config"]

    def f(key: str, scale: float = 1.0, fmt: str = ".1f", src: dict = m) -> str:
        v = src.get(key)
        return "-" if v is None else format(v * scale, fmt)

    lines = [
        f"{cfg['model']} {cfg['dtype']} on {result['device']} ({cfg['env']['device_name']}), prompts "
        f"{cfg['prompt_len_min']}-{cfg['prompt_len_max']} tokens, {cfg['max_new_tokens']} new tokens, greedy; "
        f"bandwidth {f('memory_bandwidth_bytes_per_s', 1e-9, ',.0f')} GB/s, weights/step "
        f"{f('weight_bytes_per_step', 1e-6, ',.0f')} MB, bound {f('weight_bound_step_s', 1e3, '.3f')} ms/step",
        f"{'c':>4} {'engine tok/s':>13} {'HF tok/s':>10} {'x HF':>6} {'eng TTFT p50/p90 ms':>20} "
        f"{'HF TTFT ms':>10} {'eng step ms':>11} {'eng/HF decode ms':>17} {'roofline':>8} {'KV MB/step':>10}",
    ]
    for c in cfg["concurrency"]:
        ttft = f"{f(f'engine_ttft_p50_s_c{c}', 1e3)}/{f(f'engine_ttft_p90_s_c{c}', 1e3)}"
        dec = f"{f(f'engine_decode_step_s_c{c}', 1e3, '.2f')}/{f(f'hf_decode_step_s_c{c}', 1e3, '.2f')}"
        lines.append(
            f"{c:>4} {f(f'engine_tokens_per_s_c{c}', 1, ',.0f'):>13} {f(f'hf_tokens_per_s_c{c}', 1, ',.0f'):>10} "
            f"{f(f'vs_hf_generate_c{c}', 1, '.2f', r):>6} {ttft:>20} {f(f'hf_ttft_s_c{c}', 1e3):>10} "
            f"{f(f'engine_step_s_c{c}', 1e3, '.2f'):>11} {dec:>17} {f(f'roofline_fraction_c{c}', 1, '.3f'):>8} "
            f"{f(f'kv_bytes_per_step_c{c}', 1e-6, ',.1f'):>10}"
        )
    for e in result["errors"]:
        lines.append(f"ERROR {e['side']} c={e['concurrency']}: {e['error']}")
    # Headline last (the names in benchmarks/README.md); c=64 when it ran, else the largest concurrency measured.
    head = 64 if 64 in cfg["concurrency"] else max(cfg["concurrency"])
    lines.append(
        f"engine vs_hf_generate_c{head}={f(f'vs_hf_generate_c{head}', 1, '.2f', r)} "
        f"vs_hf_static_c{head}={f(f'vs_hf_static_c{head}', 1, '.2f', r)} "
        f"hf_static_tokens_per_s_c{head}={f(f'hf_static_tokens_per_s_c{head}', 1, '.0f')} "
        f"roofline_fraction_c{head}={f(f'roofline_fraction_c{head}', 1, '.3f')} "
        f"engine_tokens_per_s_c{head}={f(f'engine_tokens_per_s_c{head}', 1, '.0f')} (device={result['device']})"
    )
    if cfg.get("lora_rank"):
        for c in cfg["concurrency"]:
            lines.append(
                f"LoRA rank {cfg['lora_rank']} c={c}: engine_lora {f(f'engine_lora_tokens_per_s_c{c}', 1, '.0f')} "
                f"tok/s vs engine {f(f'engine_tokens_per_s_c{c}', 1, '.0f')} tok/s "
                f"(lora_vs_base={f(f'lora_vs_base_c{c}', 1, '.2f', r)})"
            )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), help=f"model shape (default {DEFAULTS['model']})")
    p.add_argument("--concurrency", help=f"comma-separated (default {DEFAULTS['concurrency']})")
    p.add_argument("--max-new-tokens", type=int, help=f"per request (default {DEFAULTS['max_new_tokens']})")
    p.add_argument(
        "--prompt-len", type=int, help=f"mean prompt tokens, ±25%% (default {DEFAULTS['prompt_len']})"
    )
    p.add_argument(
        "--quick", action="store_true", help="CPU smoke: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 on cuda, else float32"
    )
    p.add_argument(
        "--device-kind", help="device named in the result file (nvidia-h100-x1, nvidia-h200, cpu ...)"
    )
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument(
        "--context-length", type=int, default=0, help="Runner context_length (0: longest prompt + new)"
    )
    p.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="Runner kv_cache_tokens (default: the engine's)"
    )
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="write a torch.profiler kernel summary of one engine decode step (largest concurrency)",
    )
    p.add_argument(
        "--peers",
        default="hf,hf_static",
        help="comma-separated HF peers: hf (eager generate), hf_static (static cache + torch.compile)",
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="also run the engine with one active LoRA adapter of this rank on every projection "
        "(side engine_lora; ratio lora_vs_base); that side decodes without CUDA graphs",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.device_kind is None:
        if args.device.startswith("cuda"):
            args.device_kind = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
        else:
            args.device_kind = "cpu"
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate()'s notes and the load/save progress bars would bury
    hf_logging.disable_progress_bar()  # the progress lines
    result = run(args, argv)
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    # the repo root before this script's folder: benchmarks/trainer.py would shadow the trainer package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
