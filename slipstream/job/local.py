"""`slipstream run`: bring up a job on a local Ray instance — private Redis, engines, rollout workers,
one trainer — stream its progress, and tear everything down on every way out (Ctrl-C included). The job
runs under the cluster's job driver (slipstream/job/driver.py: the same pools, supervision and teardown).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from jobspec import JobSpec, check_context, to_json
from model_zoo.prepare import prepare_model
from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from replay_buffer.redis_server import ManagedRedis
from slipstream.job.driver import JobDriver
from slipstream.job.prepare import (
    init_local_ray,
    own_processes,
    reset_run_state,
    resolve_paths,
    stop_local_ray,
)
from slipstream.job.store import JobStore

log = logging.getLogger(__name__)

TOOLS_WARMUP_PROBLEMS = 4000


class JobResult(msgspec.Struct):
    version: int
    elapsed_s: float
    final_model: str
    progress: list[dict]
    buffer: dict
    evals: list[dict] = []
    """The evaluations' records (a spec with `eval`), one per version evaluated."""
    lengths: dict = {}
    """The run's response-length histograms (ReplayBuffer.length_histograms): trained and stale."""
    restarts: dict = {}
    """Replacements during the run, by kind (rollout_workers, engines, trainer_pool)."""


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both unwind run_job through its `finally` (actors, Ray, Redis stopped).
    Installed after ray.init, which sets handlers of its own; SIGINT is re-enabled even when the shell
    started us with it ignored (background jobs)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_interrupt)


def run_job(spec: JobSpec, on_progress: Callable[[dict], None] | None = None) -> JobResult:
    """Run `spec` to completion with the cluster's job driver (slipstream/job/driver.py: the same pools,
    supervision and teardown); returns the summary. It runs on a fresh local Ray instance, stopped at the
    end, or on the Ray this process is already connected to (`ray.init` before: a notebook, a test
    session running many jobs), which it leaves running with the job's actors gone."""
    import ray

    spec = resolve_paths(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    reset_run_state(out, managed_redis=spec.redis.url is None)
    (out / "job.json").write_text(to_json(spec))
    prepare_model(spec.model, spec.dataset)
    check_context(spec)  # the model's context is known now, also when this run built it

    managed = None
    if spec.redis.url is None:
        managed = ManagedRedis(data_dir=out / "redis", appendfsync=spec.redis.appendfsync).start()
    redis_url = spec.redis.url or managed.url
    url_file = out / "redis.url"  # for `slipstream buffer stats JOB` while the job runs; holds a secret
    url_file.touch(mode=0o600)
    url_file.write_text(redis_url)
    r = connect(redis_url)
    driver = None
    t0 = time.monotonic()
    own_ray = not ray.is_initialized()
    existing = own_processes() if own_ray else set()
    try:
        if own_ray:
            init_local_ray()
        log.info("ray %s; job %s", "started" if own_ray else "connected already", spec.name)
        _interrupt_on_signals()
        store = JobStore(r)
        store.create(spec.name, to_json(spec), spec.generators.num_engines, spec.trainer.num_trainers)
        driver = JobDriver(spec, redis_url, store, on_progress=on_progress)
        result = driver.run()
        driver.close()
        stats = ReplayBuffer(r, spec.name).stats()
        lengths = ReplayBuffer(r, spec.name).length_histograms()
        progress, evals = driver.records, driver.progress.evals
        (out / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress + evals))
        from slipstream.job.report import write_report_logged

        write_report_logged(progress + evals, out)  # PNG plots; never fails the job
        elapsed = time.monotonic() - t0
        return JobResult(
            result.version,
            elapsed,
            result.final_model,
            progress,
            stats,
            evals,
            lengths,
            dict(driver.restarts),
        )
    finally:
        if driver is not None:
            driver.close()  # idempotent: a second call finds nothing left to stop
        if own_ray and ray.is_initialized():
            stop_local_ray(existing)  # with the actors' processes: none outlives the command
        r.close()
        if managed:
            managed.stop()
            url_file.unlink(missing_ok=True)
        log.info("job %s: everything stopped", spec.name)
