"""What a job needs before its pools start, locally or on the cluster: absolute paths, its model built
(once per model.path), a new run's per-run files gone, and, for a job on this machine, a private Ray."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from jobspec import JobSpec
from slipstream.cluster.state import project_pythonpath

log = logging.getLogger("slipstream.job.prepare")


def resolve_paths(spec: JobSpec) -> JobSpec:
    """Absolute paths (actors run with another working directory), by jobspec.resolve_paths' rule:
    relative to this process's working directory."""
    import jobspec

    return jobspec.resolve_paths(spec, Path.cwd())


def prepare_model(spec: JobSpec) -> None:
    """Build the model if the spec asks for a recipe and the directory has none yet. Jobs (and `run`s)
    sharing one model.path build it once: under an exclusive lock on `.<name>.lock` beside it, into a
    temporary directory beside it, renamed into place when complete; a second job waits for the lock
    and then finds the finished model, never a half-written one."""
    import fcntl
    import tempfile

    path = Path(spec.model.path)
    if (path / "config.json").exists():
        return
    build = spec.model.build
    if build is None:
        raise FileNotFoundError(f"model.path {path} has no config.json and model.build is not set")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model %s is being built by another job; waiting for it", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists():
            log.info("model %s was built by another job; using it", path)
            return
        if path.exists():
            if not path.is_dir() or any(path.iterdir()):
                raise FileExistsError(
                    f"model.path {path} exists but holds no model (no config.json; an interrupted build?): "
                    "remove it, or point model.path elsewhere"
                )
            path.rmdir()  # an empty directory: the build takes its place
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
        try:
            log.info("building %s model at %s (in %s until complete)", build, path, tmp)
            _build_model(spec, build, tmp)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built %s model at %s", build, path)


def _build_model(spec: JobSpec, build: str, path: Path) -> None:
    if build == "tiny-arith":
        from model_zoo.warmup import build_tiny_arith

        build_tiny_arith(
            path,
            max_operand=spec.dataset.max_operand,
            warmup_steps=spec.model.warmup_steps,
            seed=spec.dataset.seed,
        )
    elif build == "tiny-tools":
        from generator_fleet.tasks import build_task
        from model_zoo.tiny_tools import build_tiny_tools

        build_tiny_tools(
            path,
            build_task(spec.dataset).problems,
            warmup_steps=spec.model.warmup_steps,
            seed=spec.dataset.seed,
        )
    elif build == "smollm2-135m":
        from model_zoo.smollm2 import build_smollm2

        build_smollm2(path)
    else:
        raise ValueError(f"unknown model.build {build!r}")


RUN_FILES = ("samples.txt", "progress.jsonl", "report_reward.png", "report_staleness.png",
             "report_throughput.png")  # fmt: skip
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
                **(env or {}),
            }
        },
    )
