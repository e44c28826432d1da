"""The control plane's record of jobs in the cluster's Redis: what was submitted (the resolved spec), what
the user wants (pool sizes, stop), what the job driver reports (state, progress), and commands waiting
for the driver. Every key lives under the job's own `slipstream:{job}:` prefix, so jobs sharing a cluster
never touch each other's data; the index of jobs is one hash beside them. The desired state and the
status are typed records (slipstream/job/records.py `Desired`, `Status`), read and written only here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import redis
from msgspec import UNSET

import jobspec
from jobspec.spec import check_name
from replay_buffer.keys import JOBS_INDEX, KEY_PREFIX, JobKeys
from slipstream.job.records import Desired, Status, decode_status, encode_status, merged
from trainer.config import checkpoint_dir

ACTIVE_STATES = ("submitted", "starting", "running", "scaling", "stopping")
"""A job in one of these holds resources; a new job of the same name is refused until it ends."""
ENDED_STATES = ("succeeded", "failed", "stopped", "interrupted")
"""`interrupted`: the job's driver is gone without having reported an end (a cluster restart, a killed
driver); `slipstream status` says why and where its latest checkpoint is, and its name can be reused."""
COMMANDS = ("checkpoint",)
SUBMISSIONS = f"{KEY_PREFIX}control:submissions"
"""Hash job name -> submissions of that name so far: the number in each new submission id."""


def submission_id(job: str, n: int) -> str:
    """The Ray submission id of the job's `n`th submission, derived before Ray is called (passed as Ray's
    `submission_id`): the control plane can always ask Ray about it, and stop it."""
    return f"slipstream-{job}-{n}"


class NameTaken(Exception):
    """The name is not free: the job is `state` (active), or `held`: a driver holds its run lease."""

    def __init__(self, state: str | None, held: bool) -> None:
        super().__init__(state)
        self.state, self.held = state, held


class JobStore:
    """Read and write job records; one instance per process, over a sync redis client."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    # --- submission ------------------------------------------------------------------------------------
    def create(self, job: str, spec_json: str, generators: int, trainers: int, version: int = 0) -> str:
        """Record a submitted job (replacing what an ended job of the same name left) with its Ray
        submission id, before Ray is called, so that the id is never unknown; returns it. `version`: the
        one it resumes from (resume_version), shown until its trainer reports. Atomic with the check that
        the name is free: NameTaken when the job is active or a driver holds its run lease."""
        keys = JobKeys(job)
        n = self.r.hincrby(SUBMISSIONS, job, 1)  # never reset (not even by rm): Ray keeps old ids
        sid = submission_id(job, n)
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(keys.status, keys.lease)
                state = decode_status(pipe.get(keys.status)).state or None
                if state in ACTIVE_STATES or pipe.exists(keys.lease):
                    raise NameTaken(state, held=bool(pipe.exists(keys.lease)))
                pipe.multi()
                pipe.hset(JOBS_INDEX, job, f"{time.time():.3f}")
                pipe.set(keys.spec, spec_json)
                pipe.delete(keys.desired, keys.status, keys.commands)
                pipe.hset(keys.desired, mapping=Desired(generators=generators, trainers=trainers).to_hash())
                status = Status(state="submitted", submitted_at=time.time(), version=version, ray_job_id=sid)
                pipe.set(keys.status, encode_status(status))
                pipe.set(keys.submission, sid)
                pipe.execute()
            except redis.WatchError:
                raise NameTaken("changed", held=False) from None
        return sid

    def settle(self, job: str, decide: Callable[[Status, bytes | None], dict | None]) -> Status:
        """End a submission whose driver is gone, atomically: `decide(status, lease)` runs while the job's
        status, run lease and submission are watched (it may ask Ray); the fields it returns are merged
        into the status, and the lease and the current submission are deleted with it, so no driver can
        start for that submission later. Nothing is written when it returns None, or when a driver
        changed any of them meanwhile (it took the lease, reported). Returns the status."""
        keys = JobKeys(job)
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(keys.status, keys.lease, keys.submission)
                st = decode_status(pipe.get(keys.status))
                fields = decide(st, pipe.get(keys.lease))
                if fields is None:
                    return st
                st = merged(st, **fields, updated_at=time.time())
                pipe.multi()
                pipe.set(keys.status, encode_status(st))
                pipe.delete(keys.lease, keys.submission)
                pipe.execute()
                return st
            except redis.WatchError:
                return self.status(job)

    def names(self) -> list[str]:
        return sorted(n.decode() for n in self.r.hkeys(JOBS_INDEX))

    def exists(self, job: str) -> bool:
        return bool(self.r.hexists(JOBS_INDEX, job))

    def spec_json(self, job: str) -> str | None:
        raw = self.r.get(JobKeys(job).spec)
        return raw.decode() if raw is not None else None

    # --- desired state (the user's side) ---------------------------------------------------------------
    def desired(self, job: str) -> Desired:
        return Desired.from_hash(self.r.hgetall(JobKeys(job).desired))

    def set_desired(self, job: str, generators: int | None = None, trainers: int | None = None) -> None:
        sizes = {k: v for k, v in (("generators", generators), ("trainers", trainers)) if v is not None}
        if sizes:
            self.r.hset(JobKeys(job).desired, mapping=Desired(**sizes).to_hash())

    def request_stop(self, job: str, checkpoint: bool = True, reason: str = "") -> None:
        """The trainer ends after its current step, writing a checkpoint there unless `checkpoint` is
        False; `reason` (e.g. "cluster down") goes to the driver's log and the job's final status."""
        want = Desired(stop=True, stop_checkpoint=checkpoint, stop_reason=reason or UNSET)
        self.r.hset(JobKeys(job).desired, mapping=want.to_hash())

    # --- commands --------------------------------------------------------------------------------------
    def push_command(self, job: str, command: str) -> None:
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}; expected one of {COMMANDS}")
        self.r.rpush(JobKeys(job).commands, command)

    def pop_commands(self, job: str) -> list[str]:
        pipe = self.r.pipeline()
        pipe.lrange(JobKeys(job).commands, 0, -1)
        pipe.delete(JobKeys(job).commands)
        raw, _ = pipe.execute()
        return [c.decode() for c in raw]

    # --- status (the driver's side) --------------------------------------------------------------------
    def status(self, job: str) -> Status:
        """The job's status; an empty one (every field UNSET) when there is none."""
        return decode_status(self.r.get(JobKeys(job).status))

    def has_status(self, job: str) -> bool:
        return bool(self.r.exists(JobKeys(job).status))

    def update_status(self, job: str, **fields: Any) -> Status:
        """Merge `fields` (Status fields) into the job's status (read-modify-write: the driver is its only
        writer once the job runs; the control API writes it only before the driver starts and after it
        died)."""
        st = merged(self.status(job), **fields, updated_at=time.time())
        self.r.set(JobKeys(job).status, encode_status(st))
        return st

    def remove(self, job: str) -> int:
        """Forget an ended job: its index entry and every key under its `slipstream:{job}:` prefix
        (SCAN, not KEYS: the cluster's Redis stays responsive). Returns how many keys were deleted."""
        n = 0
        batch: list[bytes] = []
        for key in self.r.scan_iter(match=JobKeys(job).pattern, count=500):
            batch.append(key)
            if len(batch) >= 500:
                n += self.r.delete(*batch)
                batch.clear()
        if batch:
            n += self.r.delete(*batch)
        self.r.hdel(JOBS_INDEX, job)
        return n

    def active(self, job: str) -> bool:
        return self.status(job).state in ACTIVE_STATES


def load_job_spec(store: JobStore, job: str) -> jobspec.JobSpec:
    """The spec the control plane stored for `job`; JobSpecError (never a default spec) when the name
    is invalid, there is none, it does not parse or validate, or it names another job."""
    if why := check_name(job):
        raise jobspec.JobSpecError(f"job name {job!r}: {why}")
    raw = store.spec_json(job)
    if raw is None:
        raise jobspec.JobSpecError(
            f"job {job!r}: no spec stored for it in the cluster's Redis (not submitted?)"
        )
    try:
        spec = jobspec.from_dict(msgspec.json.decode(raw))
    except (msgspec.DecodeError, jobspec.JobSpecError) as e:
        raise jobspec.JobSpecError(f"job {job!r}: its stored spec is invalid: {e}") from None
    if spec.name != job:
        raise jobspec.JobSpecError(f"job {job!r}: its stored spec is job {spec.name!r}'s")
    return spec


def latest_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """{"version", "path"} of the newest complete checkpoint under `checkpoint_dir` (what
    `resume_from: latest` resumes from), or None; reads trainer/checkpoint.py's files without torch."""
    d = Path(checkpoint_dir)
    try:
        path = d / (d / "latest").read_text().strip()
        state = json.loads((path / "trainer_state.json").read_text())
        return {"version": int(state["version"]), "path": str(path)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_version(spec: dict[str, Any]) -> int:
    """The version a job's trainer resumes from (`trainer.resume_from`: `latest`, a checkpoint, or a
    directory with a `latest` pointer, as trainer/checkpoint.py resolves it), so that its status shows
    that version while it starts, not 0; 0 for a fresh job or one whose checkpoint cannot be read (the
    trainer then fails with the reason)."""
    src = (spec.get("trainer") or {}).get("resume_from")
    if not src:
        return 0
    path = job_checkpoint_dir(spec) if src == "latest" else Path(src)
    if ck := latest_checkpoint(path):
        return ck["version"]
    try:
        return int(json.loads((path / "trainer_state.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


NO_POOLS = {"generators": 0, "rollout_workers": 0, "trainers": 0}
"""The `pools` status field of a job that ended."""


def resume_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """The status fields of a job that ended without its driver's report: `checkpoint` (path, "" if
    none), `checkpoint_version` and `note`, one line on what a resubmission starts from."""
    ck = latest_checkpoint(job_checkpoint_dir(spec))
    note = (
        f"latest checkpoint at version {ck['version']}: {ck['path']} "
        "(resume: submit with trainer.resume_from: latest)"
        if ck
        else "no checkpoint was written (a resubmission starts from the initial model)"
    )
    return {
        "checkpoint": ck["path"] if ck else "",
        "checkpoint_version": ck["version"] if ck else None,
        "note": note,
    }


def job_checkpoint_dir(spec: jobspec.JobSpec | dict[str, Any]) -> Path:
    """Where a job's checkpoints go, from its spec (a JobSpec, or the resolved spec as stored at submit),
    by the trainer's own rule (trainer.config.checkpoint_dir)."""
    if isinstance(spec, dict):
        tr = spec.get("trainer") or {}
        return checkpoint_dir(spec.get("output_dir", "."), tr.get("checkpoint_dir"))
    return checkpoint_dir(spec.output_dir, spec.trainer.checkpoint_dir)
