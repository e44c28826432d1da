"""Async-vs-sync benchmark: the SAME job (model, data, seed, resources, trained samples) run synchronously
(buffer.max_staleness 0) and asynchronously (max_staleness 1, 2, 4) side by side in one invocation, plus the
two pipeline bounds (generators alone, trainer alone), plus a learning-equivalence check.

Every job is a real `slipstream.job.local.run_job`: managed Redis, local Ray, engine, rollout worker(s),
trainer, weight bus. Only buffer.max_staleness differs between the throughput jobs (and the job name /
output directory). max_staleness 0 is synchronous on-policy RL: the buffer's admission control lets the
fleet start only the groups of the current step, so the generators idle while the trainer trains and
publishes, and the trainer idles while the generators generate.

Rates (each throughput job runs `warmup + steps` optimizer steps; the first `warmup` are excluded: Ray and
model start, first batch, allocator warm-up):
- samples/s = steps * groups_per_step * group_size / (elapsed_s[last] - elapsed_s[warmup]), the trainer's
  own clock from its progress records (trained samples per second, end to end); tokens/s the same with the
  records' response_tokens.
- trainer busy fraction = sum(step_s) / window (forward/backward/optimizer; the records' wait_s is time
  spent waiting for a batch, publish_s the weight transfer: both reported too, as fractions).
- generator busy fraction = share of the window's samples, taken every `--sample-interval-s` from the
  engine's Prometheus metrics (sglang:num_running_reqs minus sglang:num_paused_reqs > 0), in which the
  engine had a request decoding; generator utilisation = the engine's generated tokens/s in the window
  (sglang:generation_tokens) / its generated tokens/s in the generator-only phase. The window in wall time
  runs from the arrival of step `warmup`'s progress record to the last one's (the records stream through
  Redis as each step commits).
- staleness distribution: the buffer's histogram of consumed groups (versions), whole job.

Pipeline bounds, measured in one more job-like session on the same stack (launcher.start_engines and the
job's actors, unbounded admission: max_staleness 10^6, so nothing ever waits on the trainer):
- generator-only: the engine and rollout worker(s) with no trainer consuming fill the buffer; rate =
  groups produced between the `warmup`-th and the `(warmup + steps)`-th step's worth of groups / time.
- trainer-only: then the trainer (publishing to the engine every step as in a job) trains `warmup + steps`
  steps on the pre-filled buffer (no wait for data); rate as for the jobs.

Headlines (BENCHMARKS.md): ratios.async_vs_sync = samples/s at max_staleness 2 / at 0 (which one is
`config.async_vs_sync_uses`; the best async one is ratios.best_async_vs_sync); ratios.async_vs_pipeline_bound
= the same async samples/s / min(generator-only, trainer-only).

Learning equivalence (part of the default run; `--no-learning` skips it, `--learning-only` runs only it):
the demo's a+b job on the tiny SFT-warmed `tiny-arith` model on either device (on cuda through the same
stack as the throughput jobs: external bf16 engine, CUDA trainer; `--learning-model job` uses the
throughput job instead, which on cuda has random weights and nothing to learn), `--learning-seeds`
seeds (algorithm.seed and dataset.seed), three jobs per seed: sync (max_staleness 0, decoupled_ppo),
async (max_staleness 2, decoupled_ppo) and async without the importance correction (max_staleness 2,
`ppo`: PPO-clip with the ratio pi/pi_behav, i.e. the behaviour policy is the clipping anchor, no proximal policy and no truncated IS weight; see trainer/losses.py).
Reported: final-window reward (mean training-batch reward of the last `--learning-window` steps) per seed,
and whether the async mean lies within the seed spread of sync (see `learning.definition` in the JSON).

Devices:
- cpu (default): the `tiny-arith` demo model (examples/demo.yaml: a+b, 6 new tokens), built once and
  reused; built-in engine and trainer, 1 torch thread each, share the box's cores.
- cuda: trainer on GPU `--trainer-gpu` (Ray gives it one GPU), one built-in engine on `--engine-gpu`
  started by this script as an `external` engine (the job's built-in engine actor does not take a device
  today, see the report), NCCL weight bus; model: Qwen2.5-0.5B shape with random weights and the
  `tiny-tools` ChatML tokenizer (vocabulary cut to it, so that a random model's EOS comes at varied
  lengths), multi-turn word problems with the calculator (examples/tools_demo.yaml).

Run:
    python benchmarks/async_vs_sync.py                  # CPU, full: ~11 min of jobs on 2 cores + the tiny model's
                                                        # SFT build (1-8 min, by host load)
    python benchmarks/async_vs_sync.py --quick          # CPU smoke (the test)
    python benchmarks/async_vs_sync.py --device cuda --device-kind nvidia-h200-x2
    # learning equivalence alone on one GPU (trainer and engine share it; gloo bus through host memory):
    python benchmarks/async_vs_sync.py --device cuda --learning-only --engine-gpu 0 --trainer-gpu 0 \
        --bus-backend gloo --device-kind nvidia-h100-x1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
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


# --- specs and model ------------------------------------------------------------------------------


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
    if args.device == "cpu":
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
    return raw


def make_spec(raw: dict, *, name: str, out: Path, max_staleness: int, total_steps: int, **over):
    import jobspec

    raw = json.loads(json.dumps(raw))
    raw["name"], raw["output_dir"] = name, str(out)
    raw["buffer"] = {"max_staleness": max_staleness}
    raw["algorithm"]["total_steps"] = total_steps
    for key, value in over.items():  # dotted: algorithm.loss=ppo
        section, field = key.split("__")
        raw[section][field] = value
    return jobspec.from_dict(raw)


def build_tiny_arith(args: argparse.Namespace, work: Path) -> Path:
    """The demo's tiny-arith model (SFT warm-up included), built once; every job loads it via model.path.
    With --tiny-model-dir it is built there, or reused from there when that directory already holds one."""
    import jobspec
    from slipstream.job.local import prepare_model

    where = getattr(args, "tiny_model_dir", None)  # scale_run's arguments have no such option
    path = Path(where).resolve() if where else work / "tiny-arith"
    spec = jobspec.from_dict(
        {
            "model": {"path": str(path), "build": "tiny-arith", "warmup_steps": args.model_warmup_steps},
            "dataset": {"name": "arith", "max_operand": 19, "seed": 0},
        }
    )
    prepare_model(spec)
    return path


def build_cuda_model(args: argparse.Namespace, work: Path) -> Path:
    """Qwen2.5-0.5B-shaped random weights (bf16) with the tiny-tools ChatML tokenizer; the vocabulary is cut
    to the tokenizer's (rounded up to 64) unless --full-vocab."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmarks.shapes import config_kwargs
    from model_zoo.tiny_tools import build_tokenizer

    path = work / "model"
    tok = build_tokenizer()
    kw = config_kwargs(args.model_shape)
    if not args.full_vocab:
        kw["vocab_size"] = (len(tok) + 63) // 64 * 64
    cfg = Qwen2Config(
        **kw,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class ExternalEngine:
    """cuda path: one built-in engine process on --engine-gpu, loading the model directory; a fresh one per
    job (a job starts at version 0; an engine that served an earlier job holds that job's weights)."""

    def __init__(self, args: argparse.Namespace, model: Path, log_path: Path, api_key: str) -> None:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "generator_fleet.engine", "--model", str(model), "--port", "0"]
        cmd += ["--api-key", api_key, "--device", "cuda", "--dtype", "bfloat16", "--log-level", "WARNING"]
        cmd += ["--max-batch-size", str(args.engine_max_batch)]
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


# --- engine sampling ------------------------------------------------------------------------------


class EngineSampler:
    """Polls the engine's Prometheus metrics every `interval_s` in a thread: (monotonic time, decoding?,
    generated tokens so far). Finds the engine through the job's redis.url file and metrics_targets hash
    (built-in engine actor) or is given its URL (external engine)."""

    def __init__(self, out_dir: Path, job: str, interval_s: float, url: str | None = None) -> None:
        self.out_dir, self.job, self.interval_s, self.url = out_dir, job, interval_s, url
        self.samples: list[tuple[float, bool, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _find(self) -> str | None:
        import redis

        from replay_buffer.keys import JobKeys

        url_file = self.out_dir / "redis.url"
        if not url_file.exists():
            return None
        try:
            r = redis.Redis.from_url(url_file.read_text().strip(), socket_timeout=2)
            target = r.hget(JobKeys(self.job).metrics_targets, "engine-0")
            r.close()
        except Exception:  # noqa: BLE001 - not up yet
            return None
        return f"http://{target.decode()}" if target else None

    def _run(self) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        client = httpx.Client(timeout=2.0)
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                if self.url is None:
                    self.url = self._find()
                if self.url is not None:
                    vals: dict[str, float] = {}
                    for fam in text_string_to_metric_families(client.get(self.url + "/metrics").text):
                        for s in fam.samples:
                            vals[s.name] = vals.get(s.name, 0.0) + s.value
                    if "sglang:num_running_reqs" in vals:
                        busy = vals["sglang:num_running_reqs"] - vals.get("sglang:num_paused_reqs", 0) > 0
                        tokens = vals.get(
                            "sglang:generation_tokens_total", vals.get("sglang:generation_tokens", 0)
                        )
                        self.samples.append((t, busy, tokens))
            except Exception:  # noqa: BLE001 - engine starting or gone; keep polling
                pass
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))
        client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"busy_fraction": None, "generated_tokens_per_s": None, "samples": len(inside)}
        return {
            "busy_fraction": sum(s[1] for s in inside) / len(inside),
            "generated_tokens_per_s": (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0]),
            "samples": len(inside),
        }


# --- measurements ---------------------------------------------------------------------------------


def rates(progress: list[dict], arrivals: list[float], warmup: int, samples_per_step: int) -> dict[str, Any]:
    """Trainer-clock rates over the steps after `warmup` (module docstring)."""
    timed = progress[warmup:]
    window = timed[-1]["elapsed_s"] - progress[warmup - 1]["elapsed_s"]
    sum_ = lambda key: sum(float(r.get(key) or 0.0) for r in timed)  # noqa: E731
    return {
        "steps_timed": len(timed),
        "window_s": window,
        "samples_per_s": len(timed) * samples_per_step / window,
        "tokens_per_s": sum_("response_tokens") / window,
        "trainer_busy_fraction": sum_("step_s") / window,
        "trainer_wait_fraction": sum_("wait_s") / window,
        "trainer_publish_fraction": sum_("publish_s") / window,
        # the whole publish call (commit, gather, pause and continue too), and what no phase accounts for
        "trainer_publish_call_fraction": sum_("publish_call_s") / window,
        "trainer_other_fraction": 1 - (sum_("step_s") + sum_("wait_s") + sum_("publish_call_s")) / window,
        "step_s_mean": sum_("step_s") / len(timed),
        "staleness_mean": sum_("staleness_mean") / len(timed),
        "staleness_max": max(int(r["staleness_max"]) for r in timed),
        "wall_window": [arrivals[warmup - 1], arrivals[-1]],
    }


def slim(progress: list[dict]) -> list[dict]:
    keys = ("step", "reward_mean", "staleness_mean", "staleness_max", "response_tokens", "wait_s", "step_s")
    keys += ("publish_s", "pause_s", "publish_call_s", "elapsed_s")
    return [{k: r.get(k) for k in keys} for r in progress]


def run_config(args, raw: dict, model: Path, work: Path, label: str, max_staleness: int, steps: int, **over):
    """One job through run_job; progress records, their arrival times and the engine samples."""
    from slipstream.job.local import run_job

    out = work / label
    spec = make_spec(raw, name=label, out=out, max_staleness=max_staleness, total_steps=steps, **over)
    engine = None
    if args.device == "cuda":
        engine = ExternalEngine(args, model, work / f"{label}-engine.log", os.environ[ENGINE_KEY_ENV])
        spec = _with_urls(spec, [engine.url])
    sampler = EngineSampler(out, label, args.sample_interval_s, engine.url if engine else None)
    progress, arrivals = [], []

    def on_progress(rec: dict) -> None:
        arrivals.append(time.monotonic())
        progress.append(rec)
        if rec["step"] % max(1, steps // 5) == 0 or rec["step"] == steps:
            log(
                f"{label} step {rec['step']}/{steps}: reward {rec['reward_mean']:.3f} staleness "
                f"{rec['staleness_mean']:.2f} step {rec['step_s'] * 1e3:.0f} ms wait {rec['wait_s'] * 1e3:.0f} ms"
            )

    t0 = time.monotonic()
    try:
        result = run_job(spec, on_progress=on_progress)
    finally:
        sampler.stop()
        if engine:
            engine.stop()
    log(f"{label}: {len(progress)} steps, job {result.elapsed_s:.1f} s, wall {time.monotonic() - t0:.1f} s")
    return progress, arrivals, sampler, result.buffer


def _with_urls(spec, urls: list[str]):
    import msgspec

    return msgspec.structs.replace(spec, generators=msgspec.structs.replace(spec.generators, urls=urls))


def throughput_run(args, raw, model, work, ms: int, samples_per_step: int) -> dict[str, Any]:
    label = f"staleness-{ms}"
    progress, arrivals, sampler, buffer = run_config(
        args, raw, model, work, label, ms, args.warmup + args.steps
    )
    m = rates(progress, arrivals, args.warmup, samples_per_step)
    m["generator"] = sampler.window(*m["wall_window"])
    m["staleness_histogram"] = {str(k): v for k, v in buffer["staleness"].items()}
    m["buffer"] = {k: v for k, v in buffer.items() if k != "staleness"}
    m["progress"] = slim(progress)
    m["wall_window"] = None
    return m


def pipeline_bounds(args, raw: dict, model: Path, work: Path, samples_per_step: int) -> dict[str, Any]:
    """Generator-only, then trainer-only on the filled buffer, in one session (module docstring)."""
    import ray
    import redis

    from replay_buffer import ReplayBuffer
    from replay_buffer.redis_server import ManagedRedis
    from slipstream.job.actors import RolloutActor, TrainerActor
    from slipstream.job.local import (
        ProgressReader,
        init_local_ray,
        reset_run_state,
        resolve_paths,
        start_engines,
        stop_actors,
    )

    total = args.warmup + args.steps
    label = "pipeline-bounds"
    out = work / label
    spec = make_spec(raw, name=label, out=out, max_staleness=UNBOUNDED_STALENESS, total_steps=total)
    engine = None
    if args.device == "cuda":
        engine = ExternalEngine(args, model, work / f"{label}-engine.log", os.environ[ENGINE_KEY_ENV])
        spec = _with_urls(spec, [engine.url])
    spec = resolve_paths(spec)
    out.mkdir(parents=True, exist_ok=True)
    reset_run_state(out, managed_redis=True)
    managed = ManagedRedis(data_dir=out / "redis").start()
    (out / "redis.url").write_text(managed.url)
    sampler = EngineSampler(out, label, args.sample_interval_s, engine.url if engine else None)
    r = redis.Redis.from_url(managed.url)
    buffer = ReplayBuffer(r, label)
    engine_actors: list = []
    actors: list = []
    res: dict[str, Any] = {}
    G = spec.rollout.group_size
    gps = spec.algorithm.groups_per_step
    try:
        init_local_ray({ENGINE_KEY_ENV: os.environ[ENGINE_KEY_ENV]} if engine else None)
        buffer.ensure_group()
        buffer.set_version(0)
        urls, rollout_urls, api_key = start_engines(spec, managed.url, secrets.token_hex(16), engine_actors)
        # generator-only: the workers fill the buffer; no trainer exists yet
        workers = [
            RolloutActor.remote(spec, managed.url, rollout_urls, api_key, i)
            for i in range(spec.generators.num_workers)
        ]
        actors += workers
        runs = [w.run.remote() for w in workers]
        marks: list[tuple[float, int]] = []
        start_at, end_at = args.warmup * gps, total * gps
        t_begin = time.monotonic()
        while True:
            produced = int(r.hget(buffer.keys.stats, "produced") or 0)
            marks.append((time.monotonic(), produced))
            if produced >= end_at:
                break
            done, _ = ray.wait(runs, timeout=0)
            if done:
                ray.get(done)
                raise RuntimeError("a rollout worker exited during the generator-only phase")
            if time.monotonic() - t_begin > args.phase_timeout_s:
                raise TimeoutError(
                    f"generator-only phase: {produced}/{end_at} groups after {args.phase_timeout_s} s"
                )
            time.sleep(0.05)
        t0, g0 = next((t, g) for t, g in marks if g >= start_at)
        t1, g1 = marks[-1]
        gen = sampler.window(t0, t1)
        res["generator_only"] = {
            "groups_timed": g1 - g0,
            "window_s": t1 - t0,
            "samples_per_s": (g1 - g0) * G / (t1 - t0),
            "groups_per_s": (g1 - g0) / (t1 - t0),
            "generator": gen,
            "tokens_per_s": gen["generated_tokens_per_s"],
        }
        log(
            f"generator-only: {g1 - g0} groups in {t1 - t0:.1f} s = {res['generator_only']['samples_per_s']:.1f} "
            f"samples/s (engine busy {gen['busy_fraction']})"
        )
        for w in workers:
            w.stop.remote()
        ray.wait(runs, num_returns=len(runs), timeout=30)
        # trainer-only: the buffer holds every batch it needs
        trainer = TrainerActor.options(num_gpus=1 if spec.trainer.device == "cuda" else 0).remote(
            spec, managed.url, urls, api_key, 0, 1
        )
        actors.append(trainer)
        ray.get(trainer.setup.remote(None))
        reader = ProgressReader(r, label)
        progress, arrivals = [], []
        run = trainer.run.remote()
        while True:
            done, _ = ray.wait([run], timeout=0)
            for rec in reader.read(block_ms=500):
                arrivals.append(time.monotonic())
                progress.append(rec)
            if done:
                ray.get(run)
                progress += reader.read(block_ms=0)
                break
        m = rates(
            progress,
            arrivals + [arrivals[-1]] * (len(progress) - len(arrivals)),
            args.warmup,
            samples_per_step,
        )
        m["wall_window"] = None
        m["progress"] = slim(progress)
        res["trainer_only"] = m
        log(
            f"trainer-only: {m['steps_timed']} steps in {m['window_s']:.1f} s = {m['samples_per_s']:.1f} samples/s "
            f"(busy {m['trainer_busy_fraction']:.2f}, wait {m['trainer_wait_fraction']:.3f})"
        )
    finally:
        sampler.stop()
        if ray.is_initialized():
            stop_actors(engine_actors, actors)
            ray.shutdown()
        r.close()
        managed.stop()
        if engine:
            engine.stop()
    return res


# --- learning equivalence -------------------------------------------------------------------------

LEARNING_CONFIGS = (  # (label, max_staleness, loss)
    ("sync", 0, "decoupled_ppo"),
    ("async", HEADLINE_STALENESS, "decoupled_ppo"),
    ("async_no_is", HEADLINE_STALENESS, "ppo"),
)


def step_samples(raw: dict) -> int:
    """Samples per optimizer step of a raw job spec."""
    return raw["algorithm"]["groups_per_step"] * raw["rollout"]["group_size"]


def learning_job(args, raw: dict, model: Path, work: Path) -> tuple[dict, Path]:
    """The learning-equivalence job and its model. `--learning-model tiny-arith` (the default): the demo's
    a+b job on the tiny SFT-warmed model, which learns within 60 steps (a random-weight shape model, as the
    cuda throughput jobs use, has nothing to learn from); on cuda it runs on the same GPU stack as the
    throughput jobs (bf16 engine, CUDA trainer). `job`: the throughput jobs' own job and model."""
    if args.learning_model == "job":
        return raw, model
    if args.device == "cpu":  # the throughput job is already the tiny-arith job
        lraw = json.loads(json.dumps(raw))
        lmodel = model
    else:
        t = time.monotonic()
        lmodel = build_tiny_arith(args, work)
        log(f"learning model (tiny-arith) at {lmodel} in {time.monotonic() - t:.1f} s")
        lraw = base_spec(args, lmodel, task="arith")
    if args.learning_groups_per_step or args.device != "cpu":
        lraw["algorithm"]["groups_per_step"] = args.learning_groups_per_step or DEFAULTS["groups_per_step"]
    return lraw, lmodel


def learning(args, raw: dict, model: Path, work: Path, on_job=None) -> dict[str, Any]:
    """Three jobs per seed (LEARNING_CONFIGS); `on_job(record)` after each job, so that a run cut short
    keeps what finished: the summary of the seeds done so far, plus the finished jobs of the seed under way
    (`partial_seed`)."""
    seeds = list(range(args.seed, args.seed + args.learning_seeds))
    spp = step_samples(raw)
    curves: dict[str, dict[str, list]] = {c[0]: {} for c in LEARNING_CONFIGS}
    finals: dict[str, dict[str, float]] = {c[0]: {} for c in LEARNING_CONFIGS}
    for seed in seeds:
        raw_s = json.loads(json.dumps(raw))
        raw_s["algorithm"]["seed"] = seed
        raw_s["dataset"]["seed"] = seed
        for label, ms, loss in LEARNING_CONFIGS:
            progress, _, _, _ = run_config(
                args,
                raw_s,
                model,
                work,
                f"learn-{label}-seed{seed}",
                ms,
                args.learning_steps,
                algorithm__loss=loss,
            )
            curves[label][str(seed)] = slim(progress)
            tail = progress[-args.learning_window :]
            finals[label][str(seed)] = statistics.mean(r["reward_mean"] for r in tail)
            log(f"learning {label} seed {seed}: final-window reward {finals[label][str(seed)]:.3f}")
            if on_job is not None:
                on_job(_partial(finals, curves, seeds[: seeds.index(seed) + 1], args, spp))
    return learning_summary(finals, curves, seeds, args.learning_steps, args.learning_window, spp)


def _partial(finals: dict, curves: dict, seeds: list[int], args, spp: int) -> dict[str, Any]:
    """What a learning run cut short keeps: the summary over its complete seeds and the jobs of the last."""
    whole = [s for s in seeds if all(str(s) in finals[c[0]] for c in LEARNING_CONFIGS)]
    out: dict[str, Any] = {}
    if whole:
        keep = {str(s) for s in whole}
        out = learning_summary(
            {c: {k: v for k, v in f.items() if k in keep} for c, f in finals.items()},
            {c: {k: v for k, v in f.items() if k in keep} for c, f in curves.items()},
            whole,
            args.learning_steps,
            args.learning_window,
            spp,
        )
    last = str(seeds[-1])
    if seeds[-1] not in whole:
        out["partial_seed"] = {
            "seed": seeds[-1],
            "final_reward": {c: f[last] for c, f in finals.items() if last in f},
            "curves": {c: f[last] for c, f in curves.items() if last in f},
        }
    return out


def learning_summary(
    finals: dict[str, dict[str, float]],
    curves: dict[str, dict[str, list]],
    seeds: list[int],
    steps: int,
    window: int,
    samples_per_step: int | None = None,
) -> dict[str, Any]:
    """Per-config seed means and the within-spread verdicts of async vs sync (`definition` below)."""
    out: dict[str, Any] = {
        "seeds": seeds,
        "steps": steps,
        "window_steps": window,
        "samples_per_step": samples_per_step,
        "configs": {c[0]: {"max_staleness": c[1], "loss": c[2]} for c in LEARNING_CONFIGS},
        "final_reward": finals,
        "final_reward_mean": {k: statistics.mean(v.values()) for k, v in finals.items()},
        "first_window_reward_mean": {
            k: statistics.mean(statistics.mean(r["reward_mean"] for r in c[:window]) for c in v.values())
            for k, v in curves.items()
        },
        "definition": (
            "final_reward[config][seed] = mean training-batch reward_mean over the last window_steps steps. "
            "sync_seed_range = [min, max] of sync's per-seed values; <config>_within_sync_seed_range: the "
            "config's seed mean lies in it; <config>_within_seed_spread: |mean(config) - mean(sync)| <= the "
            "larger of the two configs' seed ranges (max - min over seeds); <config>_not_worse_than_sync: "
            "mean(config) >= mean(sync) - that same spread (the question asynchrony raises: does it cost "
            "learning?)"
        ),
        "curves": curves,
    }
    sync = list(finals["sync"].values())
    lo, hi = min(sync), max(sync)
    out["sync_seed_range"] = [lo, hi]
    for label in ("async", "async_no_is"):
        vals = list(finals[label].values())
        gap = statistics.mean(vals) - statistics.mean(sync)
        spread = max(hi - lo, max(vals) - min(vals))
        out[f"{label}_minus_sync"] = gap
        out[f"{label}_within_sync_seed_range"] = lo <= statistics.mean(vals) <= hi
        out[f"{label}_within_seed_spread"] = abs(gap) <= spread
        out[f"{label}_not_worse_than_sync"] = gap >= -spread
    return out


# --- plots ----------------------------------------------------------------------------------------


def plots(result: dict, out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    m = result["metrics"]
    runs = m["runs"]
    spp = result["config"]["samples_per_step"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=70)
        plt.close(fig)
        written.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))

    if runs:
        throughput_plot(result, save)
    learn = result.get("learning")
    for xkey, name, xlabel in (
        ("samples", "reward_vs_samples", "trained samples"),
        ("elapsed_s", "reward_vs_time", "trainer wall time (s)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        if learn:
            lspp = learn.get("samples_per_step") or spp
            for i, (label, by_seed) in enumerate(learn["curves"].items()):
                for j, (seed, curve) in enumerate(by_seed.items()):
                    xs = [r["step"] * lspp if xkey == "samples" else r["elapsed_s"] for r in curve]
                    ax.plot(
                        xs,
                        [r["reward_mean"] for r in curve],
                        color=f"C{i}",
                        ls=("-", "--", ":", "-.")[j % 4],
                        lw=1,
                        label=f"{label} seed {seed}",
                    )
            ax.set_title(f"learning equivalence ({result['device']}): training-batch reward", fontsize=9)
        else:
            for i, (ms, run) in enumerate(runs.items()):
                curve = run["progress"]
                xs = [r["step"] * spp if xkey == "samples" else r["elapsed_s"] for r in curve]
                ax.plot(
                    xs, [r["reward_mean"] for r in curve], color=f"C{i}", lw=1, label=f"max_staleness {ms}"
                )
            ax.set_title("throughput jobs: training-batch reward", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        save(fig, name)
    return written


def throughput_plot(result: dict, save) -> None:
    import matplotlib.pyplot as plt

    m = result["metrics"]
    runs = m["runs"]
    labels = [f"stale {k}" for k in runs] + ["gen only", "train only"]
    vals = [runs[k]["samples_per_s"] for k in runs]
    vals += [
        m.get("generator_only", {}).get("samples_per_s", 0),
        m.get("trainer_only", {}).get("samples_per_s", 0),
    ]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    colors = ["tab:gray"] + ["tab:blue"] * (len(runs) - 1) + ["tab:green", "tab:orange"]
    ax.bar(labels, vals, color=colors[: len(vals)])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("trained samples/s")
    ax.set_title(f"async vs sync ({result['device']}): max_staleness and pipeline bounds", fontsize=9)
    save(fig, "throughput")


# --- merging learning runs -----------------------------------------------------------------------

SEED_FREE = (("dataset", "seed"), ("algorithm", "seed"), ("model", "path"))
"""Learning-job fields that may differ between the runs merged (each seed sets its own seeds)."""


def merge_learning(paths: list[Path], out_dir: Path, argv: list[str]) -> dict[str, Any]:
    """One learning result from several learning runs of the same job on the same device kind: their
    complete seeds are pooled and summarised afresh. For runs split across invocations (a one-GPU machine's
    10-minute command limit); each file must hold whole seeds of the same job, and no seed may repeat."""
    from benchmarks.common import ResultFile  # here: the script runs without PYTHONPATH

    docs = [json.loads(Path(p).read_text()) for p in paths]

    def job_key(doc: dict) -> str:
        job = json.loads(json.dumps(doc["config"].get("learning_job") or doc["config"]["job"]))
        for section, field in SEED_FREE:
            job.get(section, {}).pop(field, None)
        return json.dumps(job, sort_keys=True)

    finals: dict[str, dict[str, float]] = {c[0]: {} for c in LEARNING_CONFIGS}
    curves: dict[str, dict[str, list]] = {c[0]: {} for c in LEARNING_CONFIGS}
    first = docs[0]
    for path, doc in zip(paths, docs, strict=True):
        learn = doc.get("learning") or {}
        if doc["benchmark"] != "async_vs_sync" or not learn.get("seeds"):
            raise SystemExit(f"{path}: no complete learning seed in it")
        if doc["device"] != first["device"] or job_key(doc) != job_key(first):
            raise SystemExit(f"{path}: a different device or job than {paths[0]}; only like runs merge")
        if (learn["steps"], learn["window_steps"]) != (
            first["learning"]["steps"],
            first["learning"]["window_steps"],
        ):
            raise SystemExit(f"{path}: different learning steps or window than {paths[0]}")
        for label in finals:
            for seed in map(str, learn["seeds"]):
                if seed in finals[label]:
                    raise SystemExit(f"{path}: seed {seed} of {label} is already in an earlier file")
                finals[label][seed] = learn["final_reward"][label][seed]
                curves[label][seed] = learn["curves"][label][seed]
    seeds = sorted(int(s) for s in finals["sync"])
    L0 = first["learning"]
    job = first["config"].get("learning_job") or first["config"]["job"]
    spp = step_samples(job)
    rf = ResultFile("async_vs_sync", first["device"], argv, out_dir, "learning")
    rf.result["config"] = {
        "merged_from": [
            {
                "file": str(p),
                "command": d["command"],
                "seeds": d["learning"]["seeds"],
                "env": d["config"]["env"],
            }
            for p, d in zip(paths, docs, strict=True)
        ],
        "learning_job": job,
        "samples_per_step": spp,
    }
    rf.result["metrics"] = {"runs": {}}
    rf.result["learning"] = learning_summary(finals, curves, seeds, L0["steps"], L0["window_steps"], spp)
    out_dir.mkdir(parents=True, exist_ok=True)
    rf.result["plots"] = plots(rf.result, out_dir, rf.path.stem)
    rf.save()
    log(f"wrote {rf.path}")
    return rf.result


# --- the run --------------------------------------------------------------------------------------


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


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from benchmarks.common import ResultFile  # here: the script runs without PYTHONPATH

    stalenesses = [int(s) for s in args.staleness.split(",")]
    label = "learning" if args.learning_only else None  # not to overwrite a full run's file
    rf = ResultFile("async_vs_sync", args.device_kind, argv, args.out_dir, label, metrics={"runs": {}})
    result, out_path, save = rf.result, rf.path, rf.save

    t_start = time.monotonic()
    work_root = Path(args.work_dir) if args.work_dir else None
    with tempfile.TemporaryDirectory(prefix="async-vs-sync-", dir=work_root) as tmp:
        work = Path(tmp)
        if args.device == "cuda":
            os.environ[ENGINE_KEY_ENV] = secrets.token_hex(16)
        t = time.monotonic()
        if args.device == "cpu":
            model = build_tiny_arith(args, work)
        elif args.learning_only and args.learning_model != "job":
            model = work / "throughput-model-not-built"  # --learning-only: no throughput job runs
        else:
            model = build_cuda_model(args, work)
        log(f"model at {model} in {time.monotonic() - t:.1f} s")
        raw = base_spec(args, model)
        make_spec(raw, name="x", out=work / "x", max_staleness=0, total_steps=1)  # a bad job fails here
        samples_per_step = step_samples(raw)
        result["config"] = {
            "max_staleness": stalenesses,
            "steps_timed": args.steps,
            "warmup_steps": args.warmup,
            "samples_per_step": samples_per_step,
            "trained_samples_per_job": (args.steps + args.warmup) * samples_per_step,
            "job": json.loads(json.dumps(raw)),
            "model_shape": "tiny-arith (demo)" if args.device == "cpu" else args.model_shape,
            "async_vs_sync_uses": f"max_staleness={HEADLINE_STALENESS}"
            if HEADLINE_STALENESS in stalenesses
            else "best async",
            "definitions": {
                "samples_per_s": "trained samples / trainer wall time over the steps after warmup_steps "
                "(progress records' elapsed_s)",
                "tokens_per_s": "trained response tokens / the same window",
                "trainer_busy_fraction": "sum(step_s: forward+backward+optimizer) / window; wait and publish "
                "fractions likewise from wait_s and publish_s (the weight transfer); publish_call: the whole "
                "publish call (buffer commit, gather, engine pause, transfer, continue); other: 1 - step - "
                "wait - publish_call (progress record, sample log, checkpoints)",
                "generator_busy_fraction": "share of engine /metrics samples (every sample_interval_s) in the "
                "window with sglang:num_running_reqs - sglang:num_paused_reqs > 0",
                "generator_utilisation": "engine generated tokens/s in the window (sglang:generation_tokens) / "
                "in the generator-only phase",
                "staleness_histogram": "buffer histogram of consumed groups' staleness (versions), whole job",
                "generator_only": "engine + rollout workers, no trainer, unbounded admission: groups produced "
                "after the first warmup_steps*groups_per_step until (warmup+steps)*groups_per_step / time",
                "trainer_only": "trainer (with its per-step publish) on the buffer the generator-only phase "
                "filled; rate as for the jobs",
            },
            "sample_interval_s": args.sample_interval_s,
            "engine": "built-in engine actor (Ray), 1 torch thread"
            if args.device == "cpu"
            else f"built-in engine process on GPU {args.engine_gpu} as an external engine",
            "trainer": "cpu, 1 torch thread"
            if args.device == "cpu"
            else f"cuda (Ray GPU, expected {args.trainer_gpu})",
            "env": env_info(args),
        }
        save()
        try:
            if not args.learning_only:
                for ms in stalenesses:
                    m = throughput_run(args, raw, model, work, ms, samples_per_step)
                    result["metrics"]["runs"][str(ms)] = m
                    log(
                        f"max_staleness {ms}: {m['samples_per_s']:.1f} samples/s, {m['tokens_per_s']:.0f} tokens/s, "
                        f"trainer busy {m['trainer_busy_fraction']:.2f}, generator busy "
                        f"{m['generator']['busy_fraction']}, staleness {m['staleness_histogram']}"
                    )
                    save()
                result["metrics"] |= pipeline_bounds(args, raw, model, work, samples_per_step)
                summarise(result, stalenesses)
                save()
            if args.learning_steps > 0:
                lraw, lmodel = learning_job(args, raw, model, work)
                result["config"]["learning_job"] = json.loads(json.dumps(lraw))
                save()

                def partial(summary: dict) -> None:
                    result["learning"] = summary
                    save()

                result["learning"] = learning(args, lraw, lmodel, work, on_job=partial)
                save()
        except BaseException as exc:  # what was measured is still written
            result["errors"].append({"error": repr(exc), "traceback": traceback.format_exception(exc)[-4:]})
            save()
            if not isinstance(exc, Exception):
                raise
        finally:
            result["config"]["env"]["host_load_1m_end"] = os.getloadavg()[0]
            result["config"]["wall_s"] = time.monotonic() - t_start
            if result["metrics"]["runs"] or result.get("learning"):
                try:
                    result["plots"] = plots(result, args.out_dir, out_path.stem)
                except Exception as exc:  # noqa: BLE001 - plots never lose the numbers
                    result["errors"].append({"error": f"plots: {exc!r}"})
            save()
            log(f"wrote {out_path}")
    return result


def summarise(result: dict, stalenesses: list[int]) -> None:
    m, r = result["metrics"], result["ratios"]
    runs = m["runs"]
    gen, tr = m["generator_only"], m["trainer_only"]
    bound = min(gen["samples_per_s"], tr["samples_per_s"])
    m["pipeline_bound_samples_per_s"] = bound
    m["pipeline_bound_is"] = (
        "generator_only" if gen["samples_per_s"] <= tr["samples_per_s"] else "trainer_only"
    )
    gen_tok = gen["generator"]["generated_tokens_per_s"]
    for ms, run in runs.items():
        run["generator_utilisation"] = (
            run["generator"]["generated_tokens_per_s"] / gen_tok
            if gen_tok and run["generator"]["generated_tokens_per_s"] is not None
            else None
        )
        m[f"samples_per_s_staleness_{ms}"] = run["samples_per_s"]
        m[f"tokens_per_s_staleness_{ms}"] = run["tokens_per_s"]
        m[f"trainer_busy_staleness_{ms}"] = run["trainer_busy_fraction"]
        m[f"generator_busy_staleness_{ms}"] = run["generator"]["busy_fraction"]
    m["generator_only_samples_per_s"] = gen["samples_per_s"]
    m["trainer_only_samples_per_s"] = tr["samples_per_s"]
    if "0" not in runs:
        return
    sync = runs["0"]["samples_per_s"]
    asyncs = {ms: run["samples_per_s"] for ms, run in runs.items() if ms != "0"}
    if not asyncs:
        return
    best = max(asyncs, key=asyncs.get)
    head = str(HEADLINE_STALENESS) if str(HEADLINE_STALENESS) in asyncs else best
    for ms, v in asyncs.items():
        r[f"async_vs_sync_staleness_{ms}"] = v / sync
        r[f"async_vs_pipeline_bound_staleness_{ms}"] = v / bound
    r["async_vs_sync"] = asyncs[head] / sync
    r["async_vs_pipeline_bound"] = asyncs[head] / bound
    r["best_async_vs_sync"] = asyncs[best] / sync
    r["sync_vs_pipeline_bound"] = sync / bound
    m["headline_staleness"] = int(head)
    m["best_async_staleness"] = int(best)


def report(result: dict) -> str:
    m, r = result["metrics"], result["ratios"]
    lines = [f"async vs sync on {result['device']}: {result['config'].get('samples_per_step')} samples/step"]
    lines.append(
        f"{'config':<16} {'samples/s':>10} {'tokens/s':>10} {'trainer busy':>13} {'gen busy':>9} {'staleness':>10}"
    )
    for ms, run in m.get("runs", {}).items():
        gb = run["generator"]["busy_fraction"]
        lines.append(
            f"{'max_staleness ' + ms:<16} {run['samples_per_s']:>10.1f} {run['tokens_per_s']:>10.0f} "
            f"{run['trainer_busy_fraction']:>13.2f} {gb if gb is None else round(gb, 2)!s:>9} {run['staleness_mean']:>10.2f}"
        )
    for key in ("generator_only", "trainer_only"):
        if key in m:
            lines.append(f"{key:<16} {m[key]['samples_per_s']:>10.1f}")
    if "learning" in result:
        L = result["learning"]
        for label, by_seed in L["final_reward"].items():
            vals = ", ".join(f"seed {s}: {v:.3f}" for s, v in by_seed.items())
            lines.append(f"learning {label:<12} final-window reward {vals}")
        lines.append(
            f"learning: async within seed spread of sync: {L['async_within_seed_spread']}, not worse: "
            f"{L['async_not_worse_than_sync']}; async without IS: {L['async_no_is_within_seed_spread']}, "
            f"not worse: {L['async_no_is_not_worse_than_sync']}"
        )
    for e in result["errors"]:
        lines.append(f"ERROR {e['error']}")
    if "async_vs_sync" in r:
        lines.append(
            f"async_vs_sync async_vs_sync={r['async_vs_sync']:.3f} async_vs_pipeline_bound="
            f"{r['async_vs_pipeline_bound']:.3f} (max_staleness={m['headline_staleness']}, device={result['device']})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"CPU smoke defaults: {QUICK}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--device-kind", help="device named in the result file (cpu, nvidia-h200-x2; default: --device)"
    )
    p.add_argument(
        "--staleness", help=f"comma-separated max_staleness values (default {DEFAULTS['staleness']})"
    )
    p.add_argument("--steps", type=int, help=f"timed optimizer steps per job (default {DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed first steps per job (default {DEFAULTS['warmup']})")
    p.add_argument("--groups-per-step", type=int, help="algorithm.groups_per_step (default 16 cpu, 32 cuda)")
    p.add_argument("--learning-steps", type=int, help="steps per learning job; 0 = no learning part")
    p.add_argument("--learning-seeds", type=int)
    p.add_argument("--learning-window", type=int, help="final-window steps of the learning reward")
    p.add_argument("--no-learning", action="store_true", help="skip the learning-equivalence jobs")
    p.add_argument("--learning-only", action="store_true", help="only the learning-equivalence jobs")
    p.add_argument("--model-warmup-steps", type=int, help="SFT warm-up of the tiny-arith model")
    p.add_argument(
        "--tiny-model-dir",
        help="build the tiny-arith model here, or reuse the one already here (saves its SFT warm-up)",
    )
    p.add_argument(
        "--learning-model",
        choices=["tiny-arith", "job"],
        default="tiny-arith",
        help="learning jobs: the demo's a+b job on the tiny-arith model (default), or the throughput job",
    )
    p.add_argument(
        "--learning-groups-per-step",
        type=int,
        help=f"algorithm.groups_per_step of the tiny-arith learning jobs (default {DEFAULTS['groups_per_step']})",
    )
    p.add_argument("--model-shape", default="qwen2.5-0.5b-shape", help="cuda: benchmarks/shapes.py shape")
    p.add_argument("--full-vocab", action="store_true", help="cuda: keep the shape's real vocabulary")
    p.add_argument("--max-new-tokens", type=int, default=256, help="cuda: tokens per model turn")
    p.add_argument("--engine-max-batch", type=int, default=256, help="cuda: engine --max-batch-size")
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--engine-gpu", type=int, default=1)
    p.add_argument(
        "--bus-backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="cuda: the weight bus's backend; gloo (through host memory) lets a smoke run put trainer and "
        "engine on one GPU (--engine-gpu 0), which NCCL refuses",
    )
    p.add_argument("--sample-interval-s", type=float, default=0.1, help="engine metrics polling period")
    p.add_argument("--phase-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="parent of the temporary job directories (default: system temp)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--merge-learning",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="pool the learning seeds of these result files (same job and device) into one result; runs nothing",
    )
    args = p.parse_args(argv)
    from benchmarks.common import apply_presets  # here: the script runs without PYTHONPATH

    apply_presets(args, DEFAULTS, CUDA_DEFAULTS, QUICK)
    if args.no_learning:
        args.learning_steps = 0
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the rate window starts at a warm-up step's record)")
    args.learning_window = min(args.learning_window, max(1, args.learning_steps))
    args.device_kind = args.device_kind or args.device
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.merge_learning:
        result = merge_learning(args.merge_learning, args.out_dir, argv)
        print(report(result), flush=True)
        return result
    if args.device == "cuda":
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:  # the cuda job's reward (word problems)
            sys.exit(
                "the cuda job's reward needs the math-verify package (on the GPU machine: carry its wheels)"
            )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.device == "cuda":  # Ray (and so the trainer) sees only the trainer's GPU; the engine gets its own
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.trainer_gpu)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(args, argv)
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
