"""Preparing a job's model directory: build it from a recipe (tiny-arith, tiny-tools, smollm2-135m) when the
spec asks for one and the directory has none yet, once, whatever the number of jobs that share it."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from generator_fleet.config import DatasetSpec
from models.config import ModelSpec

log = logging.getLogger(__name__)


def prepare_model(model: ModelSpec, dataset: DatasetSpec) -> None:
    """Build the model if the spec asks for a recipe and the directory has none yet. Jobs (and `run`s)
    sharing one model.path build it once: under an exclusive lock on `.<name>.lock` beside it, into a
    temporary directory beside it, renamed into place when complete; a second job waits for the lock
    and then finds the finished model, never a half-written one."""
    import fcntl
    import tempfile

    path = Path(model.path)
    if (path / "config.json").exists():
        return
    build = model.build
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
            _build_model(model, dataset, build, tmp)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built %s model at %s", build, path)


def _build_model(model: ModelSpec, dataset: DatasetSpec, build: str, path: Path) -> None:
    if build == "tiny-arith":
        from model_zoo.warmup import build_tiny_arith

        build_tiny_arith(
            path,
            max_operand=dataset.max_operand,
            warmup_steps=model.warmup_steps,
            seed=dataset.seed,
        )
    elif build == "tiny-tools":
        from generator_fleet.tasks import build_task
        from model_zoo.tiny_tools import build_tiny_tools

        build_tiny_tools(
            path,
            build_task(dataset).problems,
            warmup_steps=model.warmup_steps,
            seed=dataset.seed,
        )
    elif build == "smollm2-135m":
        from model_zoo.smollm2 import build_smollm2

        build_smollm2(path)
    else:
        raise ValueError(f"unknown model.build {build!r}")
