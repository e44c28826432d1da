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
