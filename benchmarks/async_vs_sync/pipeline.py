"""The two pipeline bounds, in one session on the job's stack: the generators alone fill the buffer
(unbounded admission), then the trainer alone trains on it, publishing to the same engines every step."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync.job import ENGINE_KEY_ENV, UNBOUNDED_STALENESS, ExternalEngine, log, make_spec
from benchmarks.async_vs_sync.measure import EngineSampler, _with_urls, profiling, rates, slim


def pipeline_bounds(
    args,
    raw: dict,
    model: Path,
    work: Path,
    samples_per_step: int,
    on_bound=lambda res: None,
    trainer: bool = True,
) -> dict[str, Any]:
    """Generator-only, then trainer-only on the filled buffer, in one session (package docstring).
    `on_bound(res)` after each bound, so a phase cut short by its timeout keeps the generator-only one.
    `trainer=False`: the generator-only bound alone (it needs no second GPU)."""
    import ray

    from replay_buffer.redis_server import ManagedRedis
    from slipstream.job.generators import generators_only
    from slipstream.job.prepare import (
        init_local_ray,
        own_processes,
        reset_run_state,
        resolve_paths,
        stop_local_ray,
    )
    from slipstream.job.trainers import trainer_only

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
    sampler = EngineSampler(
        out, label, args.sample_interval_s, engine.url if engine else None, **profiling(args, engine)
    )
    pool = None
    res: dict[str, Any] = {}
    G = spec.rollout.group_size
    gps = spec.algorithm.groups_per_step
    # what runs already (Redis, the engine, a Ray): not the bounds' Ray, so left to its owners at the end
    existing = own_processes()
    # the bounds' actors need the engine key in their environment: a Ray of their own; without an outside
    # engine, a Ray this process is already connected to (the staleness phases', a test session's) serves
    own_ray = engine is not None or not ray.is_initialized()
    try:
        if own_ray:
            if ray.is_initialized():
                ray.shutdown()
            init_local_ray({ENGINE_KEY_ENV: os.environ[ENGINE_KEY_ENV]} if engine else None)
        # generator-only: the workers fill the buffer; no trainer exists yet
        pool, marks = generators_only(spec, managed.url, total * gps, args.phase_timeout_s)
        t0, g0 = next((t, g) for t, g in marks if g >= args.warmup * gps)
        t1, g1 = marks[-1]
        if t1 <= t0:  # the timed groups came between two polls of the buffer: no window to divide by
            raise ValueError(
                "generator-only: the timed groups all arrived within one poll of the buffer; time more "
                "of them (--steps, --groups-per-step)"
            )
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
            f"samples/s (engine busy {gen['busy_fraction']}, decode batch {gen.get('mean_decode_batch')}, "
            f"prefill time share {gen.get('prefill_time_share')}, prefix hit share {gen.get('prefix_hit_share')})"
        )
        on_bound(res)
        if not trainer:
            return res
        # trainer-only: the buffer holds every batch it needs
        progress, arrivals = [], []

        def on_record(rec: dict) -> None:
            arrivals.append(time.monotonic())
            progress.append(rec)

        trainer_only(spec, managed.url, pool.engine_urls, pool.api_key, on_record=on_record)
        m = rates(progress, arrivals, args.warmup, samples_per_step)
        m["wall_window"] = None
        m["progress"] = slim(progress)
        res["trainer_only"] = m
        log(
            f"trainer-only: {m['steps_timed']} steps in {m['window_s']:.1f} s = {m['samples_per_s']:.1f} samples/s "
            f"(busy {m['trainer_busy_fraction']:.2f}, wait {m['trainer_wait_fraction']:.3f})"
        )
        on_bound(res)
    finally:
        sampler.stop()
        if ray.is_initialized():
            if pool is not None:
                pool.close()
            if own_ray:
                stop_local_ray(existing)  # with its workers: none outlives the phase
        managed.stop()
        if engine:
            engine.stop()
    return res
