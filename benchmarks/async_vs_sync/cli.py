"""Async-vs-sync benchmark: the command line (`python -m benchmarks.async_vs_sync`), the full run, its
summary ratios and its report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.async_vs_sync.fp32_head import (
    fp32_head_jobs,
    fp32_head_ratios,
    fp32_head_report,
    side_by_side,
    with_fp32_heads,
)
from benchmarks.async_vs_sync.job import (
    CUDA_DEFAULTS,
    DEFAULTS,
    ENGINE_KEY_ENV,
    HEADLINE_STALENESS,
    QUICK,
    ROOT,
    base_spec,
    build_cuda_model,
    build_tiny_arith,
    env_info,
    log,
    make_spec,
    step_samples,
)
from benchmarks.async_vs_sync.learning import learning, learning_job, merge_learning
from benchmarks.async_vs_sync.lengths import length_jobs, length_report
from benchmarks.async_vs_sync.measure import throughput_run
from benchmarks.async_vs_sync.pipeline import pipeline_bounds
from benchmarks.async_vs_sync.plots import plots


def run_lengths(args: argparse.Namespace, argv: list[str]) -> dict:
    """--length-bias: the length-bias jobs only (benchmarks/async_vs_sync/lengths.py)."""
    from benchmarks.common import ResultFile

    rf = ResultFile("async_vs_sync", args.device_kind, argv, args.out_dir, "lengths")
    result = rf.result
    result["config"] = {
        "steps": args.steps + args.warmup,
        "groups_per_step": args.groups_per_step,
        "max_staleness": args.length_staleness,
        "max_new_tokens": args.length_max_new_tokens,
        "model": "tiny a+b model without SFT warm-up (random EOS positions)",
        "definitions": {
            "generated": "every sample of the groups the trainer took from the buffer: trained + dropped stale",
            "ks": "two-sample Kolmogorov-Smirnov D = max |F1 - F2| over response lengths; p asymptotic "
            "(conservative for discrete lengths)",
        },
    }
    work_root = Path(args.work_dir) if args.work_dir else None
    with tempfile.TemporaryDirectory(prefix="async-vs-sync-lengths-", dir=work_root) as tmp:
        with rf.recording(log):

            def partial(res: dict) -> None:
                result["metrics"] = res
                rf.save()

            result["metrics"] = length_jobs(args, Path(tmp), on_job=partial)
            jobs = result["metrics"]["jobs"]
            result["ratios"] = {
                f"{p}_dropped_fraction": jobs[p]["stale"]["n"] / max(1, jobs[p]["generated"]["n"])
                for p in jobs
            } | {
                f"{p}_samples_per_s_vs_sync": jobs[p]["samples_per_s"] / jobs["sync"]["samples_per_s"]
                for p in jobs
            }
    return result


def run_fp32_head(args: argparse.Namespace, argv: list[str]) -> dict:
    """--fp32-lm-head both: each staleness's job without and with the fp32 LM heads (fp32_head.py)."""
    from benchmarks.common import ResultFile

    stalenesses = [int(s) for s in args.staleness.split(",")]
    rf = ResultFile("async_vs_sync", args.device_kind, argv, args.out_dir, "fp32-head")
    result = rf.result
    work_root = Path(args.work_dir) if args.work_dir else None
    with tempfile.TemporaryDirectory(prefix="async-vs-sync-fp32-head-", dir=work_root) as tmp:
        work = Path(tmp)
        with rf.recording(log):
            if args.device == "cuda":
                os.environ[ENGINE_KEY_ENV] = secrets.token_hex(16)
            # the tiny a+b model has trained logits; a random-weight shape model's are near zero (its bf16
            # logits lose next to nothing), so on cuda the a+b job on the same GPU stack is the default
            tiny = args.device == "cpu" or args.fp32_head_model == "tiny-arith"
            model = build_tiny_arith(args, work) if tiny else build_cuda_model(args, work)
            raw = base_spec(args, model, task="arith" if tiny else None)
            make_spec(with_fp32_heads(raw), name="x", out=work / "x", max_staleness=0, total_steps=1)
            samples_per_step = step_samples(raw)
            result["config"] = {
                "max_staleness": stalenesses,
                "steps_timed": args.steps,
                "warmup_steps": args.warmup,
                "samples_per_step": samples_per_step,
                "job": json.loads(json.dumps(raw)),
                "fp32_head_job": json.loads(json.dumps(with_fp32_heads(raw))),
                "model_shape": "tiny-arith (demo)" if tiny else args.model_shape,
                "placement": args.placement,
                "definitions": {
                    "logprob_abs_diff": "mean |trainer - engine| logprob of the trained tokens (progress "
                    "records' logprob_diff_mean), averaged over all the job's steps",
                    "kl_k3": "k3 estimate of KL(behaviour || trainer) on the trained tokens (progress "
                    "records' behav_kl), averaged over all the job's steps",
                    "samples_per_s": "trained samples / trainer wall time over the steps after warmup_steps",
                    "fp32_vs_bf16_head": "the fp32_head job's figure / the bf16_head job's",
                    "trainer_fp32_lm_head": "the values of the progress records' fp32_lm_head: the trainer's "
                    "head ran in fp32 (false on CPU: fp32 compute, nothing to change)",
                },
                "env": env_info(args),
            }
            rf.save()

            def partial(metrics: dict) -> None:
                result["metrics"] = metrics | side_by_side(metrics["runs"])
                result["ratios"] = fp32_head_ratios(metrics["runs"])
                rf.save()

            result["metrics"] = fp32_head_jobs(
                args, raw, model, work, stalenesses, samples_per_step, on_job=partial
            )
            result["ratios"] = fp32_head_ratios(result["metrics"]["runs"])
    return result


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from benchmarks.common import ResultFile  # here: the script runs without PYTHONPATH

    if args.length_bias:
        return run_lengths(args, argv)
    if args.fp32_lm_head == "both":
        return run_fp32_head(args, argv)

    stalenesses = [int(s) for s in args.staleness.split(",")]
    label = args.label or ("learning" if args.learning_only else None)  # not to overwrite a full run's file
    rf = ResultFile(
        "async_vs_sync", args.device_kind, argv, args.out_dir, label, append=args.append, metrics={"runs": {}}
    )
    result, out_path, save = rf.result, rf.path, rf.save
    result["metrics"].setdefault("runs", {})
    # the stalenesses of the whole series: an --append phase adds its own to the earlier commands'
    ran = set() if args.phase == "bounds" else set(stalenesses)
    measured = sorted(set(result["config"].get("max_staleness", [])) | ran)

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
        if args.fp32_lm_head == "on":
            raw = with_fp32_heads(raw)
        make_spec(raw, name="x", out=work / "x", max_staleness=0, total_steps=1)  # a bad job fails here
        samples_per_step = step_samples(raw)
        result["config"] = {
            "max_staleness": measured,
            "steps_timed": args.steps,
            "warmup_steps": args.warmup,
            "samples_per_step": samples_per_step,
            "trained_samples_per_job": (args.steps + args.warmup) * samples_per_step,
            "job": json.loads(json.dumps(raw)),
            "model_shape": "tiny-arith (demo)" if args.device == "cpu" else args.model_shape,
            "async_vs_sync_uses": f"max_staleness={HEADLINE_STALENESS}"
            if HEADLINE_STALENESS in measured
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
            "placement": args.placement,
            "engine": "built-in engine actor (Ray), 1 torch thread"
            if args.device == "cpu"
            else f"built-in engine actor on the trainer's GPU {args.trainer_gpu} (colocated)"
            if args.placement == "colocated"
            else f"built-in engine process on GPU {args.engine_gpu} as an external engine",
            "trainer": "cpu, 1 torch thread"
            if args.device == "cpu"
            else f"cuda (Ray GPU, expected {args.trainer_gpu})",
            "env": env_info(args),
        }
        save()

        def finish() -> None:
            if result["metrics"]["runs"] or result.get("learning"):
                try:
                    result["plots"] = plots(result, args.out_dir, out_path.stem)
                except Exception as exc:  # noqa: BLE001 - plots never lose the numbers
                    result["errors"].append({"error": f"plots: {exc!r}"})

        with rf.recording(log, t_start, finish):
            if not args.learning_only and args.phase in ("all", "staleness"):
                for ms in stalenesses:
                    m = throughput_run(args, raw, model, work, ms, samples_per_step)
                    result["metrics"]["runs"][str(ms)] = m
                    log(
                        f"max_staleness {ms}: {m['samples_per_s']:.1f} samples/s, {m['tokens_per_s']:.0f} tokens/s, "
                        f"trainer busy {m['trainer_busy_fraction']:.2f}, generator busy "
                        f"{m['generator']['busy_fraction']}, decode batch "
                        f"{m['generator'].get('mean_decode_batch')}, prefill time share "
                        f"{m['generator'].get('prefill_time_share')}, prefix hit share "
                        f"{m['generator'].get('prefix_hit_share')}, staleness {m['staleness_histogram']}"
                    )
                    save()
            if not args.learning_only and args.phase in ("all", "bounds", "generator-only"):

                def bound(res: dict) -> None:
                    result["metrics"] |= res
                    save()

                trainer = args.phase != "generator-only"
                pipeline_bounds(args, raw, model, work, samples_per_step, on_bound=bound, trainer=trainer)
            if not args.learning_only:
                summarise(result)
                save()
            if args.learning_steps > 0 and args.phase == "all":
                lraw, lmodel = learning_job(args, raw, model, work)
                result["config"]["learning_job"] = json.loads(json.dumps(lraw))
                save()

                def partial(summary: dict) -> None:
                    result["learning"] = summary
                    save()

                result["learning"] = learning(args, lraw, lmodel, work, on_job=partial)
                save()
    return result


def summarise(result: dict) -> None:
    """The ratios of what has been measured so far (every phase command of an --append series calls it):
    per-staleness figures; with the bounds phase, the pipeline bound; with max_staleness 0 and an async
    run, the headline ratios."""
    m, r = result["metrics"], result["ratios"]
    runs = m["runs"]
    gen, tr = m.get("generator_only"), m.get("trainer_only")
    bound = min(gen["samples_per_s"], tr["samples_per_s"]) if gen and tr else None
    if bound is not None:
        m["pipeline_bound_samples_per_s"] = bound
        m["pipeline_bound_is"] = (
            "generator_only" if gen["samples_per_s"] <= tr["samples_per_s"] else "trainer_only"
        )
        m["generator_only_samples_per_s"] = gen["samples_per_s"]
        m["trainer_only_samples_per_s"] = tr["samples_per_s"]
    gen_tok = gen["generator"]["generated_tokens_per_s"] if gen else None
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
        if bound:
            r[f"async_vs_pipeline_bound_staleness_{ms}"] = run["samples_per_s"] / bound
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
    r["async_vs_sync"] = asyncs[head] / sync
    r["best_async_vs_sync"] = asyncs[best] / sync
    if bound:
        r["async_vs_pipeline_bound"] = asyncs[head] / bound
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
        bound = r.get("async_vs_pipeline_bound")
        lines.append(
            f"async_vs_sync async_vs_sync={r['async_vs_sync']:.3f} async_vs_pipeline_bound="
            f"{'n/a' if bound is None else f'{bound:.3f}'} (max_staleness={m['headline_staleness']}, "
            f"device={result['device']})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.async_vs_sync", description=__doc__.splitlines()[0]
    )
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
    p.add_argument(
        "--engine-prefill-wait-steps",
        type=int,
        default=None,
        help="cuda: engine --prefill-wait-steps (default: the engine's; 0 = prefill whenever a slot is free)",
    )
    p.add_argument(
        "--engine-arg",
        dest="engine_args",
        action="append",
        default=[],
        metavar="FLAG",
        help="cuda, disaggregated: a flag for the built-in engine's command line, e.g. "
        "--engine-arg=--disable-radix-cache (repeatable)",
    )
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--engine-gpu", type=int, default=1)
    p.add_argument(
        "--bus-backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="cuda: the weight bus's backend; gloo (through host memory) lets a smoke run put trainer and "
        "engine on one GPU (--engine-gpu 0), which NCCL refuses",
    )
    p.add_argument(
        "--placement",
        choices=["disaggregated", "colocated"],
        default="disaggregated",
        help="colocated: the job's own engine shares the trainer's device (cuda: --trainer-gpu), weights "
        "through CUDA IPC / shared memory (bus.backend ipc)",
    )
    p.add_argument(
        "--length-bias",
        action="store_true",
        help="only the length-bias jobs: trained vs generated response lengths per staleness policy",
    )
    p.add_argument(
        "--length-staleness", type=int, default=1, help="--length-bias: max_staleness of the async jobs"
    )
    p.add_argument(
        "--length-max-new-tokens", type=int, default=48, help="--length-bias: the response budget (tokens)"
    )
    p.add_argument(
        "--fp32-lm-head",
        choices=["off", "on", "both"],
        default="off",
        help="the LM heads of engine and trainer in fp32: off, on (every job), or both: only each "
        "--staleness job (default 0 here) without and with them, side by side (mismatch figures and samples/s)",
    )
    p.add_argument(
        "--fp32-head-model",
        choices=["tiny-arith", "job"],
        default="tiny-arith",
        help="--fp32-lm-head both on cuda: the a+b job on the tiny SFT-warmed model (default), or the "
        "throughput job (random-weight --model-shape, word problems)",
    )
    p.add_argument("--sample-interval-s", type=float, default=0.1, help="engine metrics polling period")
    p.add_argument(
        "--engine-profile-steps",
        type=int,
        default=0,
        help="cuda: profile this many engine steps of each job (torch.profiler over the engine's /start_profile; "
        "trace and summary under OUT_DIR/engine-profiles/<job>-engine/); 0 = off",
    )
    p.add_argument(
        "--engine-profile-after-tokens",
        type=float,
        default=100_000,
        help="--engine-profile-steps: start once the engine has generated this many tokens (past warm-up)",
    )
    p.add_argument("--phase-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--phase",
        choices=["all", "staleness", "bounds", "generator-only"],
        default="all",
        help="run one part only, each short enough for one command on a GPU machine: staleness (the jobs of "
        "--staleness), bounds (generator-only then trainer-only), generator-only (the first bound alone: one "
        "GPU will do); all: staleness and bounds, then the learning jobs",
    )
    p.add_argument("--label", help="result file label (e.g. the model shape: one file per shape)")
    p.add_argument(
        "--append",
        action="store_true",
        help="add to today's result file of the same device and label instead of starting it again (phase "
        "commands run one after another; the ratios are recomputed from everything measured)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of every job's spec, e.g. --set buffer.admission=version (repeatable; VALUE is YAML)",
    )
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
    if args.fp32_lm_head == "both" and args.staleness is None:
        args.staleness = "0"  # on-policy: the mismatch is the two sides' arithmetic alone
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

        arith_only = args.fp32_lm_head == "both" and args.fp32_head_model == "tiny-arith"
        if not arith_only and importlib.util.find_spec("math_verify") is None:  # the cuda job's reward
            sys.exit(
                "the cuda job's reward needs the math-verify package (on the GPU machine: carry its wheels)"
            )
        one_gpu_ok = args.phase == "generator-only"  # no trainer, so no weight bus
        if args.placement == "disaggregated" and args.trainer_gpu == args.engine_gpu and not one_gpu_ok:
            sys.exit(
                f"--trainer-gpu and --engine-gpu are both {args.trainer_gpu}: the disaggregated weight bus is "
                "an NCCL group, which cannot hold two ranks on one GPU (use --placement colocated on one GPU)"
            )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.device == "cuda":  # Ray (and so the trainer) sees only the trainer's GPU; the engine gets its own
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.trainer_gpu)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(args, argv)
    if args.length_bias:
        if result["metrics"].get("jobs"):
            print(length_report(result["metrics"]), flush=True)
        return result
    if args.fp32_lm_head == "both":
        print(fp32_head_report(result["metrics"]), flush=True)
        for e in result["errors"]:
            print(f"ERROR {e['error']}", flush=True)
        r = result["ratios"]
        if "fp32_vs_bf16_head_logprob_abs_diff" in r:
            print(
                f"async_vs_sync fp32_vs_bf16_head_logprob_abs_diff={r['fp32_vs_bf16_head_logprob_abs_diff']:.4g} "
                f"fp32_vs_bf16_head_kl_k3={r['fp32_vs_bf16_head_kl_k3']:.4g} "
                f"fp32_vs_bf16_head_samples_per_s={r['fp32_vs_bf16_head_samples_per_s']:.3f}",
                flush=True,
            )
        return result
    print(report(result), flush=True)
    return result
