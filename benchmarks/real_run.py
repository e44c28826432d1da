"""A real-model run's clean-run check: runs one job spec locally (as `slipstream run` does), then writes a
summary JSON to benchmarks/results/real_run-<device kind>-<date>.json: steps, wall time, reward over the
first and last windows of steps, the logprob mismatch (mean |trainer - engine| logprob, k3 KL), weight
versions applied, replacements (engines, rollout workers, trainer pool), aborted rollouts and any error.
Exits 1 when the run was not clean: an error, fewer steps than the spec's total_steps, any replacement, or
a non-finite loss.

    python -m benchmarks.real_run examples/smollm2_gsm_tools_long.yaml --device-kind nvidia-h200
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("--device-kind", default="cpu", help="names the result file (e.g. nvidia-h200)")
    p.add_argument("--set", action="append", default=[], help="spec override key=value (as slipstream run)")
    p.add_argument("--window", type=int, default=20, help="steps in the reward first/last windows")
    p.add_argument("--out-dir", default=str(RESULTS))
    return p.parse_args(argv)


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(spec, result, error: str | None, wall_s: float, window: int) -> dict:
    """The run's figures and `clean` (with the reasons it is not)."""
    records = [r for r in (result.progress if result else []) if "step" in r or "version" in r]
    steps = result.version if result else 0
    rewards = [r.get("reward_mean") for r in records]
    restarts = dict(result.restarts) if result else {}
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), (int, float))]
    problems = []
    if error:
        problems.append("error")
    if steps < spec.algorithm.total_steps:
        problems.append(f"steps {steps} < total_steps {spec.algorithm.total_steps}")
    if any(restarts.values()):
        problems.append(f"replacements {restarts}")
    if any(not math.isfinite(x) for x in losses):
        problems.append("non-finite loss")
    return {
        "benchmark": "real_run",
        "job": spec.name,
        "steps": steps,
        "total_steps": spec.algorithm.total_steps,
        "wall_s": round(wall_s, 1),
        "run_s": round(result.elapsed_s, 1) if result else None,
        "reward_first": _mean(rewards[:window]),
        "reward_last": _mean(rewards[-window:]),
        "logprob_abs_diff_mean": _mean([r.get("logprob_diff_mean") for r in records]),
        "behav_kl_k3_mean": _mean([r.get("behav_kl") for r in records]),
        "weight_versions_published": len({r["version"] for r in records if "version" in r}),
        "restarts": restarts,
        "finish_abort": sum(r.get("finish_abort", 0) or 0 for r in records),
        "fp32_lm_head": spec.generators.fp32_lm_head,
        "trainer_fp32_lm_head": spec.trainer_fp32_lm_head,
        "error": error,
        "problems": problems,
        "clean": not problems,
    }


def main(argv: list[str] | None = None) -> dict:
    from jobspec.loader import load
    from slipstream.job.local import run_job

    args = parse_args(argv)
    spec = load(args.spec, args.set)
    t0 = time.monotonic()
    result, error = None, None
    try:
        result = run_job(spec)
    except BaseException as e:  # noqa: BLE001 - any failure is the run's result, written below
        error = "".join(traceback.format_exception_only(e)).strip()
        traceback.print_exc()
    summary = summarize(spec, result, error, time.monotonic() - t0, args.window)
    summary["device"] = args.device_kind
    summary["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    summary["command"] = " ".join(
        ["python -m benchmarks.real_run", *(argv if argv is not None else sys.argv[1:])]
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = (
        out / f"real_run-{spec.name}-{args.device_kind}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    )
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["clean"] else 1)
