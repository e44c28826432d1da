"""Learning equivalence: the same job sync, async, and async without the importance correction, over
seeds; and the merge of learning runs split across invocations."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync.job import (
    DEFAULTS,
    HEADLINE_STALENESS,
    base_spec,
    build_tiny_arith,
    log,
    step_samples,
)
from benchmarks.async_vs_sync.measure import run_config, slim
from benchmarks.async_vs_sync.plots import plots

LEARNING_CONFIGS = (  # (label, max_staleness, loss)
    ("sync", 0, "decoupled_ppo"),
    ("async", HEADLINE_STALENESS, "decoupled_ppo"),
    ("async_no_is", HEADLINE_STALENESS, "ppo"),
)


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
