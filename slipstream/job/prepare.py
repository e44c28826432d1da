"""What a job needs before its pools start, locally or on the cluster: absolute paths, its model built
(once per model.path), a new run's per-run files gone, and, for a job on this machine, a private Ray."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from common import tls
from jobspec import JobSpec

log = logging.getLogger("slipstream.job.prepare")

REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_WAIT_S = 10.0
"""How long stop_local_ray waits for the processes of a private Ray to exit after ray.shutdown before it
kills them."""


def project_pythonpath() -> str:
    """PYTHONPATH for processes Ray starts: the project first, then this process's own entries
    (packages installed with `pip --target`, as on the GPU machine, live only there)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def resolve_paths(spec: JobSpec) -> JobSpec:
    """Absolute paths (actors run with another working directory), by jobspec.resolve_paths' rule:
    relative to this process's working directory."""
    import jobspec

    return jobspec.resolve_paths(spec, Path.cwd())


RUN_FILES = ("samples.txt", "progress.jsonl", "report_reward.png", "report_staleness.png",
             "report_throughput.png", "report_eval.png",
             "report_lengths.png")  # fmt: skip
"""Per-run outputs in a job's output_dir: a new run of the job starts without them."""


def reset_run_state(out: Path, managed_redis: bool) -> None:
    """A new run of a job starts fresh: a previous run's private Redis (its AOF would bring back the old
    version and stream, and the job would think it was already done) and its per-run outputs go.
    The model directory, checkpoints and logs stay. (The job driver resets the run's Redis keys:
    ReplayBuffer.begin_run.)"""
    stale = [out / name for name in RUN_FILES]
    if managed_redis:
        stale.append(out / "redis")
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
            log.info("removed the previous run's %s", path)
        elif path.exists():
            path.unlink()


NO_PRESTART = {"prestart_worker_first_driver": False}
"""Ray's system config for a private Ray: no idle workers started ahead for the driver. Every actor of a job
runs with the job's runtime env (below), so Ray starts it a worker of its own anyway; the workers it would
prestart (one per core) would only sit idle, each a Python process of about 80 MB that polls its raylet."""


def init_local_ray(env: dict[str, str] | None = None, num_cpus: int | None = None) -> None:
    """A private Ray instance for one job on this machine; every actor gets the project on its path,
    no hub access, and `env`."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus or max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        _system_config=NO_PRESTART,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": project_pythonpath(),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                # https:// engines and rediss:// behind a private CA (common/tls.py): every actor trusts it
                **({tls.CA_ENV: os.environ[tls.CA_ENV]} if os.environ.get(tls.CA_ENV) else {}),
                **(env or {}),
            }
        },
    )


def own_processes() -> set[int]:
    """The pids of every process below this one now: taken before init_local_ray, so that stop_local_ray
    ends only what that Ray started (not, say, the job's managed Redis or a notebook's own children)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def stop_local_ray(existing: set[int], wait_s: float = STOP_WAIT_S) -> list[int]:
    """ray.shutdown(), then every process below this one that is not in `existing` (own_processes() before
    init_local_ray) is waited for up to `wait_s` and killed if still running; returns the pids it killed.
    Ray's daemons stop with ray.shutdown, but its workers (the job's actors) exit on their own once their
    raylet is gone, not at once: `slipstream run` was seen returning with a rollout worker still running,
    and a process an actor started (an SGLang server) would outlive it."""
    import psutil
    import ray

    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in existing]
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=wait_s)
    for p in alive:
        try:
            log.warning(
                "%s (pid %d) still ran %.0f s after ray.shutdown: killing it", p.name(), p.pid, wait_s
            )
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]
