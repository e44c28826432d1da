"""Where a submitted job's files go: relative paths of its spec resolved against the submitter's
directory, its outputs contained in its own directory HOME/jobs/NAME, its inputs (model, dataset,
checkpoint to resume from) in the operator's input roots, and that directory's purge (`rm --purge`), which
follows no link out of it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import msgspec

import jobspec
from jobspec.spec import input_paths as input_paths_of

log = logging.getLogger(__name__)


def output_dir_note(spec: jobspec.JobSpec, home: Path) -> str | None:
    """What the submitter is told when the spec's output_dir is relative: a submitted job writes in its
    own directory instead (resolve_spec_paths), and the user should not look for `runs/x` by the spec."""
    if Path(spec.output_dir).is_absolute():
        return None
    job_dir = (home / "jobs" / spec.name).resolve()
    return (
        f"output_dir {spec.output_dir!r} is relative: a submitted job writes in its own directory "
        f"{job_dir} (an absolute output_dir must lie inside it) - at `$.output_dir`"
    )


def default_input_roots(home: Path) -> list[str]:
    """Where a submitted job may read from when `cluster up` names no `--input-root`: the cluster's HOME
    (which holds every job's directory), the project (its examples and the demo model under runs/) and
    the system temp directory."""
    from slipstream.job.prepare import REPO_ROOT

    return [str(Path(p).resolve()) for p in (home, REPO_ROOT, tempfile.gettempdir())]


def input_paths(spec: jobspec.JobSpec) -> dict[str, str | None]:
    """The paths a job reads from (or builds its model into), by key (`$.model.path`): the spec's input
    keys (jobspec.spec.INPUT_PATH_KEYS); `latest` is no path."""
    return {f"$.{key}": p for key, p in input_paths_of(spec).items()}


def check_input_roots(spec: jobspec.JobSpec, job_dir: Path, roots: list[str]) -> None:
    """Each input path of a resolved spec, its symlinks resolved, must lie in the job's own directory or
    one of `roots` (resolved too): a submitted job reads nothing else of the cluster user's files, e.g.
    `dataset.path: /etc/shadow`. Raises JobSpecError naming the key."""
    allowed = [job_dir, *(Path(r).resolve() for r in roots)]
    for key, p in input_paths(spec).items():
        if p is None:
            continue
        real = Path(os.path.realpath(p))  # resolve_paths resolved it already; a link is never trusted
        if not any(real.is_relative_to(root) for root in allowed):
            raise jobspec.JobSpecError(
                f"invalid job spec: {real} is outside the input roots "
                f"[{', '.join(str(r) for r in allowed)}]: a submitted job reads only there (the operator "
                f"adds roots with `slipstream cluster up --input-root PATH`) - at `{key}`"
            )


def resolve_spec_paths(
    spec: jobspec.JobSpec, home: Path, cwd: str | None, input_roots: list[str] | None = None
) -> jobspec.JobSpec:
    """Relative paths in a submitted spec by jobspec.resolve_paths' rule, against the submitter's
    working directory (`cwd`, same filesystem as the cluster). Outputs are contained: output_dir is
    the job's own directory HOME/jobs/NAME (a relative one is replaced by it, and the submit answer says
    so: output_dir_note; an absolute one, normalised with symlinks resolved, must lie inside it), and so
    must checkpoint_dir; so no two jobs share one and no job writes outside HOME. Inputs must lie in the
    job's directory or `input_roots` (None: default_input_roots). Raises JobSpecError naming the key."""
    job_dir = (home / "jobs" / spec.name).resolve()
    if not Path(spec.output_dir).is_absolute():
        spec = msgspec.structs.replace(spec, output_dir=str(job_dir))
    s = jobspec.resolve_paths(spec, Path(cwd) if cwd else Path.cwd())
    for key, p in (("$.output_dir", s.output_dir), ("$.trainer.checkpoint_dir", s.trainer.checkpoint_dir)):
        if p is not None and not Path(p).is_relative_to(job_dir):
            raise jobspec.JobSpecError(
                f"invalid job spec: {p} is outside the job's directory {job_dir}: a submitted job writes "
                f"only under its own directory (leave it unset, or give a path inside it) - at `{key}`"
            )
    check_input_roots(s, job_dir, default_input_roots(home) if input_roots is None else input_roots)
    return s


def purge_job_dir(home: Path, name: str) -> dict:
    """Delete job `name`'s own directory, HOME/jobs/NAME, and nothing outside it: HOME and the jobs root
    may be links (the operator's choice of disk), but the job's entry in it is not followed. A link there
    is removed as a link, its target kept (it may be another job's directory, or anything at all); a real
    directory is deleted without following the links inside it (shutil.rmtree unlinks them). Returns
    {"deleted": path} or {"link": path, "target": where it pointed}, {} when there is nothing."""
    root = (home / "jobs").resolve()
    job_dir = root / name
    if job_dir.parent != root or name in ("", ".", ".."):  # a name is one plain path component
        raise ValueError(f"job name {name!r} is not a directory name")
    if job_dir.is_symlink():
        target = os.readlink(job_dir)
        job_dir.unlink()
        log.warning("job %s: %s is a link (to %s): removed the link, kept its target", name, job_dir, target)
        return {"link": str(job_dir), "target": target}
    if job_dir.is_dir():
        shutil.rmtree(job_dir)
        log.info("job %s: deleted %s", name, job_dir)
        return {"deleted": str(job_dir)}
    return {}


def path_problem(spec: jobspec.JobSpec, cwd: str | None) -> str | None:
    """A path field no filesystem can hold (a NUL byte), named by its key; checked before any is used."""
    paths = {
        "cwd": cwd,
        "$.output_dir": spec.output_dir,
        "$.model.path": spec.model.path,
        "$.dataset.path": spec.dataset.path,
        "$.algorithm.ref_model_path": spec.algorithm.ref_model_path,
        "$.algorithm.critic_model_path": spec.algorithm.critic_model_path,
        "$.trainer.checkpoint_dir": spec.trainer.checkpoint_dir,
    }
    for key, p in paths.items():
        if p is not None and "\0" in p:
            return f"a path cannot hold a NUL byte - at `{key}`"
    return None
