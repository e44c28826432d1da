"""fp32 LM heads (`python -m benchmarks.async_vs_sync --fp32-lm-head both`): the same job with and without
the fp32 LM head on both sides, side by side.

For each max_staleness of `--staleness`, two jobs that differ only in the head: `bf16_head` (the job as
the throughput runs have it) and `fp32_head` (`with_fp32_heads`: the built-in engines'
`generators.fp32_lm_head`, which the trainer's `trainer.fp32_lm_head` follows; the cuda path's external
engine is started with `--fp32-lm-head` and the job sets `trainer.fp32_lm_head`). Reported per job: the
train/infer mismatch the trainer measures on every batch, mean |trainer - engine| logprob of the trained
tokens (`logprob_diff_mean`) and the k3 estimate of KL(behaviour || trainer) (`behav_kl`), averaged over
all the job's steps, and samples/s and tokens/s over the timed steps (module measure.rates). Ratios:
fp32 / bf16 of each.

The figures compare the engine's logprobs with the trainer's on the same tokens at training time, so at
max_staleness > 0 they include the policy's drift over the data's staleness; max_staleness 0 (the
default of `--fp32-lm-head both`) leaves the two sides' arithmetic alone.

Both sides only compute in bf16 on a GPU: on CPU the engine and the trainer are fp32 and the option has
nothing to change, so a CPU run checks the mechanics (both figures of both jobs, side by side), not the
effect.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync.job import HEADLINE_STALENESS, log
from benchmarks.async_vs_sync.measure import rates, run_config, slim

HEADS = ("bf16_head", "fp32_head")
FIGURES = {
    "logprob_abs_diff": "logprob_diff_mean",
    "kl_k3": "behav_kl",
}
"""Reported mismatch figure -> the progress record's per-step field."""


def with_fp32_heads(raw: dict[str, Any]) -> dict[str, Any]:
    """The raw job with the fp32 LM head on both sides: built-in engines take `generators.fp32_lm_head` (the
    trainer's head follows it); with an external engine (the cuda path's, which `run_config` then starts
    with --fp32-lm-head) the job sets `trainer.fp32_lm_head`."""
    raw = json.loads(json.dumps(raw))
    if raw["generators"]["engine"] == "external":
        raw.setdefault("trainer", {})["fp32_lm_head"] = True
    else:
        raw["generators"]["fp32_lm_head"] = True
    return raw


def mismatch(progress: list[dict]) -> dict[str, Any]:
    """Each mismatch figure averaged over the job's steps (None when no record has it)."""
    out: dict[str, Any] = {}
    for name, key in FIGURES.items():
        vals = [float(r[key]) for r in progress if r.get(key) is not None]
        out[f"{name}_mean"] = sum(vals) / len(vals) if vals else None
    out["trainer_fp32_lm_head"] = sorted({bool(r.get("fp32_lm_head")) for r in progress})
    return out


def fp32_head_jobs(
    args: argparse.Namespace,
    raw: dict[str, Any],
    model: Path,
    work: Path,
    stalenesses: list[int],
    samples_per_step: int,
    on_job: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Runs both jobs per staleness; metrics.runs[staleness][head] and the flat side-by-side figures."""
    runs: dict[str, dict[str, Any]] = {}
    jobs = {"bf16_head": raw, "fp32_head": with_fp32_heads(raw)}
    for ms in stalenesses:
        for head, job in jobs.items():
            label = f"staleness-{ms}-{head.replace('_', '-')}"
            progress, arrivals, sampler, buffer = run_config(
                args, job, model, work, label, ms, args.warmup + args.steps
            )
            m = rates(progress, arrivals, args.warmup, samples_per_step)
            m["wall_window"] = None
            m |= mismatch(progress)
            m["buffer"] = {k: v for k, v in buffer.items() if k != "staleness"}
            m["progress"] = slim(progress)
            runs.setdefault(str(ms), {})[head] = m
            log(
                f"max_staleness {ms} {head}: mean |trainer - engine| logprob {m['logprob_abs_diff_mean']}, "
                f"k3 KL {m['kl_k3_mean']}, {m['samples_per_s']:.1f} samples/s"
            )
            if on_job:
                on_job({"runs": runs})
    return {"runs": runs} | side_by_side(runs)


def side_by_side(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Flat metrics `<figure>_<head>_staleness_<ms>` for every finished job."""
    flat: dict[str, Any] = {}
    for ms, by_head in runs.items():
        for head, m in by_head.items():
            for name in (*FIGURES, "samples_per_s", "tokens_per_s"):
                value = m[f"{name}_mean"] if name in FIGURES else m[name]
                flat[f"{name}_{head}_staleness_{ms}"] = value
    return flat


def fp32_head_ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """fp32 / bf16 of each figure per staleness, and at the headline staleness (HEADLINE_STALENESS when
    run, else the first) without the suffix."""

    def ratio(a, b):
        return a / b if a is not None and b else None

    out: dict[str, float | None] = {}
    done = [ms for ms, by_head in runs.items() if set(HEADS) <= by_head.keys()]
    for ms in done:
        bf, fp = runs[ms]["bf16_head"], runs[ms]["fp32_head"]
        for name in FIGURES:
            out[f"fp32_vs_bf16_head_{name}_staleness_{ms}"] = ratio(fp[f"{name}_mean"], bf[f"{name}_mean"])
        out[f"fp32_vs_bf16_head_samples_per_s_staleness_{ms}"] = ratio(
            fp["samples_per_s"], bf["samples_per_s"]
        )
    if done:
        head = str(HEADLINE_STALENESS) if str(HEADLINE_STALENESS) in done else done[0]
        for name in (*FIGURES, "samples_per_s"):
            out[f"fp32_vs_bf16_head_{name}"] = out[f"fp32_vs_bf16_head_{name}_staleness_{head}"]
    return out


def fp32_head_report(metrics: dict[str, Any]) -> str:
    lines = [f"{'config':<28} {'|lp diff|':>10} {'k3 KL':>10} {'samples/s':>10} {'tokens/s':>10}"]
    for ms, by_head in metrics.get("runs", {}).items():
        for head, m in by_head.items():
            lp, kl = m["logprob_abs_diff_mean"], m["kl_k3_mean"]
            lines.append(
                f"{f'max_staleness {ms} {head}':<28} {'-' if lp is None else f'{lp:.4g}':>10} "
                f"{'-' if kl is None else f'{kl:.4g}':>10} {m['samples_per_s']:>10.1f} {m['tokens_per_s']:>10.0f}"
            )
    return "\n".join(lines)
