"""Colocated-mode benchmark: engine and trainer on ONE GPU, weights handed over through CUDA IPC
(`placement: colocated`, `bus.backend: ipc`), measured side by side in one run against the device's own
copy speed, against the synchronous schedule, and against TRL's GRPOTrainer on the same GPU.

Parts (`--parts`, default all; each writes into the same result file as soon as it is measured):

- `publish`: one built-in engine process with random weights of a Qwen2.5 shape on the same GPU as this
  process (the trainer); `WeightBus(backend="ipc").publish` of the model's bf16 weights, `--repeats`
  rounds alternating with a raw device-to-device copy of the same bytes (one `copy_` of a flat buffer of
  the weights' size into another, device synced). Headline (key <shape>): the tensors published as the
  trainer's own (`persistent`: the direct handoff, one /update_weights_from_tensor call of per-tensor
  CUDA-IPC handles, its payload serialized once and kept by the engine, pause folded into the call, no
  probe once the engine answered); <shape>-ring-bucket<N>mb: the same tensors as gathered copies, packed
  into the bus's ring of N MiB buffers; <shape>-direct-plain (CUDA): the direct handoff with the engine's
  one-kernel copy and the event completion off (each copy by `_foreach_copy_`, the answer after it).
  ratios.publish_vs_d2d_copy = copy time / whole publish time (medians; the largest shape is the
  headline). pause_ms, transfer_ms and gather_ms from PublishStats;
  handoff, paused, probed, the engine's per-call phases and its payloads opened vs kept.
- `schedules`: the async_vs_sync benchmark's GPU job (Qwen2.5-0.5B shape with random weights, the
  tiny-tools ChatML tokenizer, multi-turn word problems with the calculator) as a colocated job, run
  with max_staleness 0 (sync: the engine releases its memory while the trainer trains) and 2 (async:
  both resident). ratios.async_vs_sync = samples/s at 2 / at 0. Each step's time split from the
  progress records: generate (the trainer waiting for a batch), train (forward/backward/optimizer),
  publish (the whole publish call), release/resume (sync), other (what none of these covers).
- `trl`: TRL's GRPOTrainer (default generation: transformers `generate` in the training process; TRL's
  vLLM modes cannot run on this machine: vLLM is not installable there) and Slipstream colocated (the
  better schedule of `schedules`, or max_staleness 2 when that part did not run) on the same model
  directory, the same prompts (the word-problem task's prompt texts, single turn), group size
  `--group-size`, optimizer-step batch `--groups-per-step` x group size samples, and every response
  exactly `--trl-new-tokens` tokens on both sides (TRL: generation_kwargs min_new_tokens = max_completion_
  length; Slipstream: rollout.sampling.ignore_eos), no KL reference model on either side.
  ratios.vs_trl = Slipstream samples/s / TRL samples/s, both over the steps after `--warmup`.
  TRL runs in a child process so that its GPU memory is gone before Slipstream's job starts.

Run on one GPU (`--device-kind` names it in the result file):
    python -m benchmarks.colocated --device-kind nvidia-h200
    python -m benchmarks.colocated --quick           # CPU smoke: tiny shapes, shared memory, no TRL
Result file: benchmarks/results/colocated-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/colocated.py` as well as `-m`
    sys.path.insert(0, str(ROOT))

PARTS = ("publish", "schedules", "trl")
DEFAULTS = {
    "shapes": "qwen2.5-0.5b-shape,qwen2.5-1.5b-shape",
    "repeats": 5,
    "bucket_mb": "512,4096",
    "steps": 8,
    "warmup": 2,
    "groups_per_step": 16,
    "max_new_tokens": 256,
    "trl_new_tokens": 256,
}
QUICK = {
    "shapes": "tiny",
    "repeats": 2,
    "bucket_mb": "4",
    "steps": 3,
    "warmup": 1,
    "groups_per_step": 4,
    "max_new_tokens": 16,
    "trl_new_tokens": 16,
}


def log(msg: str) -> None:
    print(f"[colocated-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- publish: IPC handoff vs a raw device-to-device copy --------------------------------------------


def d2d_copy_s(nbytes: int, device, repeats: int) -> list[float]:
    """Times of one `copy_` of a flat uint8 buffer of `nbytes` into another on `device` (synced)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # untimed: first touch
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(perf_counter() - t0)
    del src, dst
    return out


def engine_payloads(url: str) -> dict[str, float]:
    """The engine's /update_weights_from_tensor payloads so far by how it had their tensors: opened
    (unpickled), kept (a repeat of a payload it loaded before) or ref (a reference to one it keeps)."""
    import re

    import httpx

    from benchmarks import weight_bus as wb

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {wb.API_KEY}"}).text
    out = {"opened": 0.0, "kept": 0.0, "ref": 0.0}
    for line in text.splitlines():
        m = re.match(r'slipstream_engine_ipc_payloads_total\{.*how="(\w+)".*\} (\S+)', line)
        if m:
            out[m[1]] = float(m[2])
    return out


PLAIN = {"SLIPSTREAM_IPC_COMPLETION_EVENT": "0", "SLIPSTREAM_ENGINE_COPY_KERNEL": "0"}
"""The handoff without its two CUDA parts, for comparison: the engine answers once its copy is done (not
once it is queued, with an event the bus waits on), and copies with `_foreach_copy_` (not in one kernel);
docs/sglang_api.md, /update_weights_from_tensor."""


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """`extra` in os.environ for the block (the engine process started in it inherits them)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_publish(
    args, shape: str, tmp: Path, bucket_mb: int, persistent: bool = True, plain: bool = False
) -> dict[str, Any]:
    """`persistent`: the bf16 tensors are published as the trainer's own (the direct handoff: a handle
    per tensor, one call, no pack copy); else as gathered copies (packed into the bus's ring buffers of
    `bucket_mb`). `plain`: with the handoff's CUDA parts off (PLAIN)."""
    with environment(PLAIN if plain else {}):
        m = _measure_publish(args, shape, tmp, bucket_mb, persistent)
    m["env"] = PLAIN if plain else {}
    return m


def _measure_publish(args, shape: str, tmp: Path, bucket_mb: int, persistent: bool) -> dict[str, Any]:
    import torch

    from benchmarks import weight_bus as wb
    from weight_bus import WeightBus

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    params = wb.trainer_weights(shape, device, args.seed)
    nbytes = sum(t.numel() * t.element_size() for _, t in params)
    m: dict[str, Any] = {"bytes": nbytes, "tensors": len(params)}
    log(f"{shape}: {len(params)} tensors, {nbytes / 2**30:.2f} GiB bf16 on {device}")
    eng_args = argparse.Namespace(device=args.device)
    engine = wb.EngineProcess(eng_args, wb.model_dir(tmp / shape, shape), tmp / f"engine-{shape}.log", 0)
    engine.wait_ready()
    bus = WeightBus(
        [engine.url],
        api_key=wb.API_KEY,
        backend="ipc",
        bucket_bytes=bucket_mb * 2**20,
        timeout_s=120.0,
        device=device,
    )
    try:
        bus.connect()
        t0 = perf_counter()
        first = bus.publish(iter(params), version=1, persistent=persistent)
        m["first_publish_ms"] = (perf_counter() - t0) * 1e3
        m["buckets"] = first.buckets
        d2d_copy_s(nbytes, device, 1)  # untimed
        warm = wb.phase_totals(engine.url)
        copy_s, pub_s, transfer_ms, pause_ms, gather_ms = [], [], [], [], []
        for r in range(args.repeats):
            for side in ("copy", "publish") if r % 2 == 0 else ("publish", "copy"):
                if side == "copy":
                    copy_s += d2d_copy_s(nbytes, device, 1)
                else:
                    t0 = perf_counter()
                    stats = bus.publish(iter(params), version=2 + r, persistent=persistent)
                    pub_s.append(perf_counter() - t0)
                    transfer_ms.append(stats.transfer_ms)
                    pause_ms.append(stats.pause_ms)
                    gather_ms.append(stats.gather_ms)
                    if stats.engines != [engine.url] or stats.bytes != nbytes:
                        raise RuntimeError(f"publish reached {stats.engines} with {stats.bytes} bytes")
            log(
                f"{shape} round {r + 1}/{args.repeats}: copy {copy_s[-1] * 1e3:.2f} ms, publish "
                f"{pub_s[-1] * 1e3:.2f} ms (transfer {transfer_ms[-1]:.2f}, pause {pause_ms[-1]:.2f})"
            )
        import httpx

        version = httpx.get(
            engine.url + "/get_weight_version", headers={"Authorization": f"Bearer {wb.API_KEY}"}
        ).json()
        m["engine_weight_version"] = version
        m["timeline_last"] = stats.timeline
        m["engine_bucket_phase_ms"] = wb.engine_phases(engine.url)  # host ms per bucket: wait/receive/load
        m["engine_ipc_payloads"] = engine_payloads(engine.url)  # opened (unpickled) vs kept/ref (repeats)
        now = wb.phase_totals(engine.url)  # the timed rounds only: host ms per call of each phase
        m["engine_call_phase_ms_timed"] = {
            ph: round((s - warm.get(ph, (0, 0))[0]) / (n - warm.get(ph, (0, 0))[1]) * 1e3, 3)
            for ph, (s, n) in now.items()
            if n > warm.get(ph, (0, 0))[1]
        }
        m["handoff"] = stats.handoff  # direct: the tensors' own handles; ring: packed into bus buffers
        m["paused"] = stats.paused  # False: pause/continue folded into the one update call
        m["probed"] = stats.probed  # False: no probe, the engine answered the last update
    finally:
        bus.close()
        engine.stop()
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    med = statistics.median
    m |= {
        "d2d_copy_ms": med(copy_s) * 1e3,
        "d2d_copy_gb_per_s": 2 * nbytes / med(copy_s) / 1e9,  # bytes read + written
        "publish_ms": med(pub_s) * 1e3,
        "publish_gb_per_s": nbytes / med(pub_s) / 1e9,
        "transfer_ms": med(transfer_ms),
        "pause_ms": med(pause_ms),
        "gather_ms": med(gather_ms),
        "bus_outside_transfer_ms": med(pub_s) * 1e3 - med(transfer_ms),
        "d2d_copy_ms_all": [x * 1e3 for x in copy_s],
        "publish_ms_all": [x * 1e3 for x in pub_s],
        "publish_vs_d2d_copy": med(copy_s) / med(pub_s),
    }
    return m


# --- schedules: colocated sync vs async ----------------------------------------------------------------


def colocated_raw(args, model: Path, task: str) -> dict[str, Any]:
    """The async_vs_sync job (benchmarks/async_vs_sync/job.py base_spec) as a colocated job on this GPU."""
    from benchmarks.async_vs_sync.job import base_spec

    ns = argparse.Namespace(
        device=args.device,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        groups_per_step=args.groups_per_step,
        bus_backend="ipc",
        placement="colocated",
        engine_max_batch=256,
        engine_prefill_wait_steps=None,
    )
    return base_spec(ns, model, task)


def step_split(progress: list[dict], warmup: int) -> dict[str, Any]:
    """Mean seconds per timed step: generate (waiting for a batch; the records' wait_s leaves the engines'
    memory release out), train, publish (the publish call less the resume around it), memory release and
    resume (sync), other (the rest of the trainer's wall time between records); and publish_parts, what
    the publish holds."""
    timed = progress[warmup:]
    n = len(timed)
    window = timed[-1]["elapsed_s"] - progress[warmup - 1]["elapsed_s"]
    mean = lambda k: sum(float(r.get(k) or 0.0) for r in timed) / n  # noqa: E731
    out = {
        "step_wall_s": window / n,
        "generate_s": mean("wait_s"),
        "train_s": mean("step_s"),
        "publish_s": mean("publish_call_s") - mean("resume_s"),  # the call includes the resume
        "release_s": mean("release_s"),
        "resume_s": mean("resume_s"),
    }
    out["other_s"] = out["step_wall_s"] - sum(v for k, v in out.items() if k != "step_wall_s")
    # within publish_s (not added again): the buffer commit, the weights' gather and pack, the engines'
    # pause window (which holds the transfer) and the transfer itself
    out["publish_parts"] = {
        "commit_s": mean("commit_s"),
        "gather_s": mean("publish_gather_s"),
        "pause_s": mean("pause_s"),
        "transfer_s": mean("publish_s"),
    }
    return out


def run_colocated_job(args, raw: dict, model: Path, work: Path, label: str, max_staleness: int) -> dict:
    from benchmarks.async_vs_sync.measure import EngineSampler, rates, run_config, slim

    ns = argparse.Namespace(**{**vars(args), "placement": "colocated", "sample_interval_s": 0.1})
    steps = args.warmup + args.steps
    progress, arrivals, sampler, buffer = run_config(ns, raw, model, work, label, max_staleness, steps)
    assert isinstance(sampler, EngineSampler)
    samples_per_step = raw["algorithm"]["groups_per_step"] * raw["rollout"]["group_size"]
    m = rates(progress, arrivals, args.warmup, samples_per_step)
    m["generator"] = sampler.window(*m.pop("wall_window"))
    m["split_s"] = step_split(progress, args.warmup)
    m["progress"] = slim(progress)
    return m


# --- TRL ----------------------------------------------------------------------------------------------


def trl_child(cfg: dict) -> None:
    """In a child process: TRL GRPOTrainer on cfg's model and prompts; prints one JSON line of timings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p} for p in cfg["prompts"]])
    g, length = cfg["group_size"], cfg["new_tokens"]
    per_device = min(32, cfg["samples_per_step"])
    accum = cfg["samples_per_step"] // per_device
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.monotonic())

    def reward(prompts, completions, **_):  # cheap and varied: GRPO needs a spread in each group
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    conf = GRPOConfig(
        output_dir=cfg["out"],
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum,
        num_generations=g,
        max_completion_length=length,
        generation_kwargs={"min_new_tokens": length},
        temperature=1.0,
        top_p=1.0,
        learning_rate=1e-6,
        beta=0.0,
        num_iterations=1,
        max_steps=cfg["steps"],
        logging_steps=1,
        report_to=[],
        bf16=cuda,
        use_cpu=not cuda,
        save_strategy="no",
        seed=cfg["seed"],
        use_vllm=False,
        use_transformers_paged=cfg["variant"] == "paged",
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=conf,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    t0 = time.monotonic()
    trainer.train()
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history]
    print(
        "TRL_RESULT "
        + json.dumps(
            {
                "stamps": [s - t0 for s in stamps],
                "completion_mean_length": [x for x in lengths if x is not None],
                "samples_per_step": per_device * accum,
                "per_device_train_batch_size": per_device,
                "gradient_accumulation_steps": accum,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            }
        ),
        flush=True,
    )


def run_trl(args, model: Path, prompts: list[str], work: Path, variant: str) -> dict[str, Any]:
    cfg = {
        "model": str(model),
        "prompts": prompts,
        "group_size": args.group_size,
        "new_tokens": args.trl_new_tokens,
        "samples_per_step": args.groups_per_step * args.group_size,
        "steps": args.warmup + args.steps,
        "seed": args.seed,
        "out": str(work / f"trl-{variant}"),
        "variant": variant,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.colocated", "--trl-child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=args.phase_timeout_s,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"TRL ({variant}) failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(line.split(" ", 1)[1])
    stamps = out["stamps"]
    window = stamps[-1] - stamps[args.warmup - 1]
    out["samples_per_s"] = args.steps * out["samples_per_step"] / window
    out["step_s_mean"] = window / args.steps
    out["wall_s"] = time.monotonic() - t0
    log(f"TRL {variant}: {out['samples_per_s']:.1f} samples/s, {out['step_s_mean']:.2f} s/step")
    return out


def word_problem_prompts(args, n: int) -> list[str]:
    from generator_fleet.config import DatasetSpec
    from generator_fleet.tasks import build_task

    task = build_task(DatasetSpec(name="word_problems", num_problems=n, difficulty="easy", seed=args.seed))
    return [p.prompt for p in task.problems]


def single_turn_raw(args, model: Path) -> dict[str, Any]:
    """The Slipstream side of the TRL comparison: the word-problem prompts, single turn, fixed lengths."""
    raw = colocated_raw(args, model, "tools")
    raw.pop("agent", None)
    raw.pop("tools", None)
    raw["rollout"]["group_size"] = args.group_size
    raw["rollout"]["sampling"] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": args.trl_new_tokens,
        "ignore_eos": True,
    }
    raw["algorithm"]["lr"] = 1.0e-6
    return raw


# --- driver -----------------------------------------------------------------------------------------


def run(args, argv: list[str]) -> dict:
    from benchmarks.common import ResultFile

    rf = ResultFile("colocated", args.device_kind, argv, args.out_dir)
    result, save = rf.result, rf.save
    result["config"] = {
        "parts": args.parts,
        "device": args.device,
        "shapes": args.shapes,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "groups_per_step": args.groups_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "trl_new_tokens": args.trl_new_tokens,
        "definitions": {
            "publish_vs_d2d_copy": "one copy_ of a flat buffer of the weights' bytes (device synced) / the whole "
            "WeightBus.publish over ipc to one built-in engine on the same GPU (probe, pack, pause, transfer, "
            "continue, as the update needs them); medians over the rounds. Headline: the trainer's own bf16 "
            "tensors (persistent: the direct handoff); <shape>-ring-bucket<N>mb: the same tensors as gathered "
            "copies, packed into the bus's ring of N MiB buffers",
            "publish_vs_d2d_copy_plain": "the same for the direct handoff with SLIPSTREAM_IPC_COMPLETION_EVENT=0 "
            "and SLIPSTREAM_ENGINE_COPY_KERNEL=0 (<shape>-direct-plain; CUDA only)",
            "async_vs_sync": "colocated job samples/s at max_staleness 2 / at 0 (trainer clock, steps after warmup)",
            "vs_trl": "Slipstream colocated samples/s / TRL GRPOTrainer samples/s: same model dir, prompts, group "
            "size, samples per optimizer step, fixed response length; the better TRL generation mode",
        },
    }
    save()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="colocated-bench-", dir=args.work_dir) as tmp:
        work = Path(tmp)
        os.environ.setdefault("SLIPSTREAM_BENCH_KEY", secrets.token_hex(8))
        with rf.recording(log, t_start):
            if "publish" in args.parts:
                result["metrics"]["publish"] = {}
                for shape in args.shapes.split(","):
                    runs = [(None, True, False)]  # the headline: the direct handoff as it is by default
                    if args.device == "cuda":  # beside it, the same without its CUDA parts
                        runs.append((None, True, True))
                    runs += [(int(x), False, False) for x in str(args.bucket_mb).split(",")]
                    for i, (mb, persistent, plain) in enumerate(runs):
                        m = measure_publish(args, shape, work, mb or 512, persistent, plain)
                        m["bucket_mb"] = mb
                        key = (
                            f"{shape}-direct-plain"
                            if plain
                            else f"{shape}-ring-bucket{mb}mb"
                            if mb
                            else shape
                        )
                        result["metrics"]["publish"][key] = m
                        if plain:  # the largest shape's, as the headline
                            result["ratios"]["publish_vs_d2d_copy_plain"] = m["publish_vs_d2d_copy"]
                        log(
                            f"{key}, {m['handoff']} ({mb or '-'} MiB buckets): publish {m['publish_ms']:.1f} ms vs d2d copy "
                            f"{m['d2d_copy_ms']:.2f} ms: ratio {m['publish_vs_d2d_copy']:.3f} (pause "
                            f"{m['pause_ms']:.1f}, transfer {m['transfer_ms']:.1f}); engine per bucket "
                            f"{m['engine_bucket_phase_ms']}"
                        )
                        if i == 0:  # the headline: the direct handoff, the largest shape
                            result["ratios"]["publish_vs_d2d_copy"] = m["publish_vs_d2d_copy"]
                            result["metrics"]["pause_ms"] = m["pause_ms"]
                            result["metrics"]["transfer_ms"] = m["transfer_ms"]
                        save()
            model = build_model(args, work) if {"schedules", "trl"} & set(args.parts) else None
            best_staleness = 2
            if "schedules" in args.parts:
                runs = result["metrics"].setdefault("schedules", {})
                raw = colocated_raw(args, model, None)
                for ms in (0, 2):
                    runs[str(ms)] = run_colocated_job(args, raw, model, work, f"colocated-staleness-{ms}", ms)
                    log(
                        f"max_staleness {ms}: {runs[str(ms)]['samples_per_s']:.1f} samples/s, split {runs[str(ms)]['split_s']}"
                    )
                    save()
                result["ratios"]["async_vs_sync"] = runs["2"]["samples_per_s"] / runs["0"]["samples_per_s"]
                best_staleness = max((0, 2), key=lambda ms: runs[str(ms)]["samples_per_s"])
                save()
            if "trl" in args.parts:
                prompts = word_problem_prompts(args, 400)
                trl: dict[str, Any] = {}
                result["metrics"]["trl"] = trl
                for variant in args.trl_variants.split(","):
                    try:
                        trl[variant] = run_trl(args, model, prompts, work, variant)
                    except Exception as exc:  # noqa: BLE001 - one mode failing leaves the other
                        trl[variant] = {"error": repr(exc)[-2000:]}
                        result["errors"].append({"error": f"trl {variant}: {exc!r}"[:2000]})
                    save()
                raw = single_turn_raw(args, model)
                ours = run_colocated_job(args, raw, model, work, "slipstream-vs-trl", best_staleness)
                ours["max_staleness"] = best_staleness
                result["metrics"]["slipstream_vs_trl"] = ours
                ok = {v: r for v, r in trl.items() if "samples_per_s" in r}
                if ok:
                    best = max(ok, key=lambda v: ok[v]["samples_per_s"])
                    result["config"]["trl_best_variant"] = best
                    result["ratios"]["vs_trl"] = ours["samples_per_s"] / ok[best]["samples_per_s"]
                save()
    return result


def build_model(args, work: Path) -> Path:
    from benchmarks.async_vs_sync.job import build_cuda_model

    ns = argparse.Namespace(model_shape=args.model_shape, full_vocab=False, seed=args.seed)
    return build_cuda_model(ns, work)


def report(result: dict) -> str:
    r = result["ratios"]
    lines = [f"colocated on {result['device']}:"]
    for k in ("publish_vs_d2d_copy", "async_vs_sync", "vs_trl"):
        if k in r:
            lines.append(f"  ratios.{k} = {r[k]:.3f}")
    for e in result["errors"]:
        lines.append(f"  error: {str(e.get('error'))[:300]}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.colocated", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"CPU smoke defaults: {QUICK}")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--device-kind", help="device named in the result file (default: --device)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--shapes", help="publish: benchmarks/shapes.py shapes, smallest first")
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--bucket-mb", help="publish: bucket sizes (MiB, comma-separated; the first is the headline)"
    )
    p.add_argument("--model-shape", default="qwen2.5-0.5b-shape", help="schedules/trl: the job's model shape")
    p.add_argument("--steps", type=int, help="timed optimizer steps per job")
    p.add_argument("--warmup", type=int, help="untimed first steps per job")
    p.add_argument("--groups-per-step", type=int)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, help="schedules: tokens per model turn")
    p.add_argument("--trl-new-tokens", type=int, help="trl: every response's length, both sides")
    p.add_argument("--trl-variants", default="default,paged", help="TRL generation modes to run")
    p.add_argument("--phase-timeout-s", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.quick else "cuda"
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [x for x in args.parts.split(",") if x]
    if bad := set(args.parts) - set(PARTS):
        p.error(f"--parts: unknown {sorted(bad)}; expected some of {PARTS}")
    if args.quick:
        args.parts = [x for x in args.parts if x != "trl"]
        args.model_shape = "tiny"
    args.device_kind = args.device_kind or args.device
    return args


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trl-child"]:
        trl_child(json.loads(argv[1]))
        return None
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(args, argv)
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    main()
