"""Job operations of the control plane (what the control API serves): submit a job as a Ray job running
slipstream/job/driver.py, list and inspect jobs, read their logs, scale their pools, stop them, ask for a
checkpoint. State lives in the cluster's Redis (slipstream/job/store.py); the driver acts on it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import sys
import threading
import time
from pathlib import Path

import msgspec
import redis
import yaml
from msgspec import UNSET
from redis.backoff import NoBackoff
from redis.retry import Retry

import jobspec
from common import tls
from common.logtext import plain
from generator_fleet.tasks import check_import_paths
from generator_fleet.tools.impl_check import TOOL_MODULES_ENV, check_tools
from jobspec.spec import eval_task
from replay_buffer import ReplayBuffer
from replay_buffer.redis_server import delete_job_user, job_user, set_job_user
from slipstream.cluster.job_paths import output_dir_note, path_problem, purge_job_dir, resolve_spec_paths
from slipstream.cluster.reconcile import DriverReconciler
from slipstream.cluster.state import ClusterInfo, write_job_redis_url
from slipstream.job import lease
from slipstream.job.prepare import project_pythonpath
from slipstream.job.progress import ProgressReader
from slipstream.job.records import Status, known, merged, status_dict
from slipstream.job.store import (
    ACTIVE_STATES,
    JobStore,
    NameTaken,
    job_checkpoint_dir,
    latest_checkpoint,
    resume_version,
)

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 5.0
"""How long the control plane waits for one Redis reply. A request is answered (503, or a status's last
known state) after about this long when Redis stalls, instead of hanging on it or retrying for a minute
as a job's processes do (replay_buffer/client.py)."""
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)
"""What redis-py raises when Redis does not answer (stalled, overloaded, down, unreachable)."""


SUBMIT_TRIES = 3
"""Tries of one Ray job submission when Ray's job server drops the connection (a kept-alive connection it
had closed, a server busy starting) or its job agent is not up yet (NO_AGENT): the same submission id each
time, so a driver starts at most once."""
SUBMIT_BACKOFF_S = 0.5


NO_AGENT = "No available agent to submit job"
"""Ray's job server's answer (HTTP 500, "please try again later") when its node's job agent has not registered
within its 10-s wait: a cluster just started on a busy machine. Nothing was started for the submission."""


def _transient(e: Exception) -> bool:
    """A connection that failed or was dropped before Ray's job server answered, or its answer that its job
    agent is not up yet (NO_AGENT); not an answer refusing the submission."""
    import requests

    if isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    return NO_AGENT in str(e)


class ControlError(Exception):
    """A request the control plane refuses; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# Long: every job command against the store and Ray (submit, stop, scale, rm, logs); reconciling with Ray is a
#   mixin of its own
class JobControl(DriverReconciler):
    def __init__(
        self,
        info: ClusterInfo,
        tool_modules: list[str] | None = None,
        redis_timeout_s: float = REDIS_TIMEOUT_S,
        input_roots: list[str] | None = None,
        submit_backoff_s: float = SUBMIT_BACKOFF_S,
    ) -> None:
        """`tool_modules`: the modules custom tools may come from ([]: builtin tools only; None: any).
        `input_roots`: the directories a job's input paths must lie in, besides its own (None: HOME, the
        project and the temp directory: job_paths.default_input_roots). `submit_backoff_s`: the wait before
        a Ray submission's second try after a transient failure (twice that before the third)."""
        self.info = info
        self.submit_backoff_s = submit_backoff_s
        self.tool_modules = tool_modules
        self.input_roots = input_roots
        self.home = Path(info.home)
        self.redis_timeout_s = redis_timeout_s
        # One retry, on a broken connection only (a restarted Redis leaves the pooled socket dead); a
        # timeout is not retried: the request answers after redis_timeout_s.
        self.r = redis.Redis.from_url(
            info.redis_url,
            socket_timeout=redis_timeout_s,
            socket_connect_timeout=redis_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self.store = JobStore(self.r)
        self._ray = None
        self._ray_lock = threading.Lock()
        self._admin = None
        self._submitting: set[str] = set()
        """Jobs this process is submitting right now: Ray may not know their submission yet."""
        self._last_status: dict[str, tuple[float, Status]] = {}
        """Job name -> (time.monotonic(), status) of the last `get` that Redis answered: what `get`
        answers, with its age, while Redis does not."""

    def redis_unavailable(self, e: redis.RedisError) -> str:
        """The message for a request Redis did not answer (the control API's 503)."""
        where = self.info.redis_url.rsplit("@", 1)[-1]  # host:port/db, never the credentials
        return (
            f"the cluster's Redis at {where} did not answer within {self.redis_timeout_s:g} s "
            f"({type(e).__name__}: {e}): it is stalled, overloaded or down; the jobs keep running and "
            "their processes retry; try again shortly"
        )

    @property
    def admin(self) -> redis.Redis:
        """A client of Redis' admin user, for ACL changes only (made on first use)."""
        if self._admin is None:
            self._admin = redis.Redis.from_url(self.info.redis_admin_url, socket_connect_timeout=5)
        return self._admin

    def _job_credentials(self, name: str) -> None:
        """A fresh ACL user for the job (its keys `slipstream:<name>:*` only, a new random password at every
        submission) and its URL in HOME/jobs/<name>/redis_url (0600), where the driver reads it: never on
        a command line, in the Ray job's runtime env or in job.json. The driver hands it to its actors
        as an argument (Ray's object store, in memory)."""
        password = secrets.token_hex(32)
        set_job_user(self.admin, name, password)
        where = self.info.redis_url.rsplit("@", 1)[1]
        write_job_redis_url(self.home, name, f"redis://{job_user(name)}:{password}@{where}")

    @property
    def ray(self):
        """Ray's job-submission client (token auth), made on first use."""
        with self._ray_lock:
            if self._ray is None:  # the token goes in the header: this process's environment stays its own
                from ray.job_submission import JobSubmissionClient

                self._ray = JobSubmissionClient(
                    self.info.dashboard_url, headers={"Authorization": f"Bearer {self.info.ray_auth_token}"}
                )
        return self._ray

    def warm(self) -> None:
        """Make Ray's job-submission client now (its import and first connection take seconds), so the
        first submit does not wait for it; if Ray does not answer yet, the first use makes it."""
        try:
            self.ray  # noqa: B018 - made for its side effect
        except Exception as e:  # noqa: BLE001 - only an early start; the first use raises it
            log.info("Ray's job client is made at first use (%s)", e)

    def _job(self, name: str, reconcile: bool = False) -> Status:
        """The job's status; `reconcile`: first mark an active job whose driver is gone (see reconcile)."""
        if not self.store.exists(name):
            raise ControlError(404, f"no job {name!r} (slipstream list shows the jobs)")
        st = self.store.status(name)
        return self._reconcile(name, st) if reconcile else st

    # --- operations -----------------------------------------------------------------------------------
    def submit(self, spec_text: str, overrides: list[str] | None = None, cwd: str | None = None) -> dict:
        try:
            spec = jobspec.loads(spec_text, overrides or [], refuse_empty=True)
        except jobspec.JobSpecError as e:
            raise ControlError(422, str(e)) from None
        except yaml.YAMLError as e:  # loads reports the spec's own YAML errors: this is an override's value
            raise ControlError(422, f"invalid job spec: an override's value is not YAML: {e}") from None
        except RecursionError:
            raise ControlError(422, "invalid job spec: nested too deeply") from None
        if why := path_problem(spec, cwd):
            raise ControlError(422, f"invalid job spec: {why}")
        # Each tools[].impl: allowed, and a class with the Tool protocol's members in its source (read, not run).
        if why := check_tools(spec.tools, self.tool_modules):
            raise ControlError(422, f"invalid job spec: {why}")
        # A task or reward named by import path: the same allow-list, its source read, not run.
        if why := check_import_paths(
            spec.dataset.name, spec.reward.name, self.tool_modules, eval_dataset_name=eval_task(spec)
        ):
            raise ControlError(422, f"invalid job spec: {why}")
        if self.store.exists(spec.name) and self._job(spec.name, reconcile=True).state in ACTIVE_STATES:
            raise ControlError(
                409, f"job {spec.name!r} is {self.store.status(spec.name).state}; stop it first"
            )
        note = output_dir_note(spec, self.home)
        try:
            spec = resolve_spec_paths(spec, self.home, cwd, self.input_roots)
            jobspec.check_context(spec)  # once its model exists; the driver checks again after building it
        except jobspec.JobSpecError as e:
            raise ControlError(422, str(e)) from None
        except (OSError, ValueError) as e:  # e.g. a lone surrogate the filesystem cannot encode
            raise ControlError(422, f"invalid job spec: a path cannot be resolved: {e}") from None
        try:
            Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ControlError(
                422, f"invalid job spec: cannot write the output directory: {e} - at `$.output_dir`"
            ) from None
        self._submitting.add(spec.name)
        try:
            sid = self._record(spec)
            self._send(spec, sid)
        finally:
            self._submitting.discard(spec.name)
        log.info("job %s submitted as Ray job %s (output %s)", spec.name, sid, spec.output_dir)
        return {
            "name": spec.name,
            "ray_job_id": sid,
            "output_dir": spec.output_dir,
            **({"note": note} if note else {}),
        }

    def _record(self, spec: jobspec.JobSpec) -> str:
        """The job's record with its submission id (before Ray hears of it), its job.json and its Redis
        user; the id. A name still held by a driver is refused (409); a lease whose holder's submission
        Ray says ended is freed first."""
        for _ in range(2):
            try:
                sid = self.store.create(
                    spec.name,
                    jobspec.to_json(spec),
                    spec.generators.num_engines,
                    spec.trainer.num_trainers,
                    version=resume_version(msgspec.to_builtins(spec)),
                )
                break
            except NameTaken as e:
                if e.state in ACTIVE_STATES:
                    raise ControlError(409, f"job {spec.name!r} is {e.state}; stop it first") from None
                if taken := self._free_lease(spec.name):
                    raise ControlError(409, taken) from None
        else:
            raise ControlError(409, f"job {spec.name!r} was submitted by another request meanwhile")
        try:
            self.store.update_status(spec.name, output_dir=spec.output_dir)  # no driver yet: no race
            (Path(spec.output_dir) / "job.json").write_text(jobspec.to_json(spec))
            self._job_credentials(spec.name)
        except (redis.RedisError, OSError) as e:
            self._abandon(spec.name, sid, f"the job's files or Redis user could not be made: {e}")
            raise ControlError(503, f"cannot create the job's files or Redis user: {e}") from e
        return sid

    def _send(self, spec: jobspec.JobSpec, sid: str) -> None:
        """Submit the job's driver to Ray as submission `sid` (Ray refuses an id twice)."""
        # Ray runs the entrypoint through a shell: every part is quoted (the name is also validated).
        entry = shlex.join(
            [
                sys.executable,
                "-m",
                "slipstream.cluster.job_entry",
                "--home",
                str(self.home),
                "--job",
                spec.name,
            ]
            + ["--submission", sid]
        )
        env = {
            "PYTHONPATH": project_pythonpath(),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # the rollout workers enforce the allow-list again when they build the tools
            **({TOOL_MODULES_ENV: json.dumps(self.tool_modules)} if self.tool_modules is not None else {}),
            # https:// engines and rediss:// behind a private CA: every job process trusts the cluster's
            **({tls.CA_ENV: os.environ[tls.CA_ENV]} if os.environ.get(tls.CA_ENV) else {}),
        }
        for attempt in range(1, SUBMIT_TRIES + 1):
            try:
                self.ray.submit_job(
                    entrypoint=entry,
                    submission_id=sid,
                    runtime_env={"env_vars": env},
                    metadata={"slipstream_job": spec.name},
                )
                return
            except Exception as e:
                ray_status, _ = self._ray_status(sid)
                if ray_status not in ("GONE", "UNKNOWN"):
                    log.warning(
                        "job %s: Ray answered its submission with %s, but has it (%s)",
                        spec.name,
                        e,
                        ray_status,
                    )
                    return
                if attempt < SUBMIT_TRIES and _transient(e):  # the same id: Ray starts it at most once
                    log.warning(
                        "job %s: Ray's job server did not take the submission (%s); try %d of %d in %.1f s",
                        spec.name, e, attempt + 1, SUBMIT_TRIES, self.submit_backoff_s * attempt,
                    )  # fmt: skip
                    time.sleep(self.submit_backoff_s * attempt)
                    continue
                # it has no driver, and none can start for it now
                self._abandon(spec.name, sid, f"Ray job submission failed: {e}")
                raise ControlError(503, f"Ray job submission failed: {e}") from e

    def get(self, name: str) -> dict:
        """The job's status as the control API answers it (records.status_dict of `status`)."""
        return status_dict(self.status(name))

    def status(self, name: str) -> Status:
        """The job's status, with its name and desired state. While Redis does not answer, the last status
        this process read, with `stale_s` (its age, seconds) and `stale_reason`; a job it never read
        raises (the API's 503)."""
        try:
            st = merged(self._job(name, reconcile=True), name=name, desired=self.store.desired(name))
        except REDIS_UNAVAILABLE as e:
            if name not in self._last_status:
                raise
            at, last = self._last_status[name]
            age = time.monotonic() - at
            log.warning("job %s: Redis did not answer (%s); answering its status of %.0f s ago", name, e, age)
            return merged(last, stale_s=round(age, 1), stale_reason=self.redis_unavailable(e))
        self._last_status[name] = (time.monotonic(), st)
        return st

    def list(self) -> list[dict]:
        out = []
        for name in self.store.names():
            st = self.store.status(name)
            if st.state in ACTIVE_STATES:
                st = self._reconcile(name, st)
            out.append(
                {
                    "name": name,
                    "state": known(st.state),
                    "version": known(st.version, 0),
                    "total_steps": known(st.total_steps),
                    "reward_mean": known(st.reward_mean),
                    "pools": known(st.pools, {}),
                }
            )
        return out

    def progress(self, name: str, since: int = 0) -> dict:
        """The job's progress records of its current run (one per optimizer step, as ProgressReader yields
        them: with the cumulative `tokens_per_s`, `samples_per_s`) after the first `since`; `next` is the
        `since` of the next call. `run` names the run, its attempt and its progress trims: when it
        changes, the records a client holds are not a prefix of these any more (read from 0 again). `evals`:
        every evaluation's record of the run (a spec with `eval`)."""
        self._job(name)
        if since < 0:
            raise ControlError(422, f"since must be >= 0, got {since}")
        reader = ProgressReader(self.r, name)
        records = reader.read_all()
        run = ReplayBuffer(self.r, name).run_info()
        run_tag = f"{run['run_id']}.{run['attempt']}.{run['trims']}" if run else None
        return {
            "name": name,
            "run": run_tag,
            "since": since,
            "next": len(records),
            "records": records[since:],
            "evals": reader.evals,
        }

    def logs(self, name: str, component: str | None = None, tail: int = 200) -> dict:
        st = self._job(name)
        log_dir = Path(known(st.output_dir, self.home / "jobs" / name)) / "logs"
        components = sorted(p.stem for p in log_dir.glob("*.log")) if log_dir.is_dir() else []
        note = None
        if component is None:
            text, unavailable = "", "the job has no Ray job"
            if st.ray_job_id:
                try:
                    text, unavailable = self.ray.get_job_logs(st.ray_job_id), None
                except Exception as e:  # e.g. a restarted Ray head no longer knows the job
                    first = (str(e).strip().splitlines() or [""])[0][:300]
                    unavailable = f"{type(e).__name__}: {first}"
            driver_log = log_dir / "driver.log"
            if unavailable is not None:
                if driver_log.is_file():  # what the driver logged itself (its own file, kept across restarts)
                    text = driver_log.read_text(errors="replace")
                    note = f"Ray's log of this job is unavailable ({unavailable}); this is {driver_log}"
                else:
                    note = (
                        f"Ray's log of this job is unavailable ({unavailable}) and there is no {driver_log}"
                    )
        else:
            if component not in components:
                raise ControlError(404, f"job {name!r} has no log {component!r}; it has {components}")
            text = (log_dir / f"{component}.log").read_text(errors="replace")
        text = plain(text)  # Ray's log carries the actors' colours and progress bars
        lines = text.splitlines()[-tail:] if tail > 0 else text.splitlines()
        return {
            "name": name,
            "component": component or "driver",
            "components": components,
            "lines": lines,
            "note": note,
        }

    def scale(self, name: str, generators: int | None = None, trainers: int | None = None) -> dict:
        # a request that cannot be right for any job is refused before the job is looked up
        if generators is None and trainers is None:
            raise ControlError(422, "scale needs generators and/or trainers")
        for key, v in (("generators", generators), ("trainers", trainers)):
            if v is not None and not 1 <= v <= jobspec.MAX_POOL:
                raise ControlError(422, f"{key} must be 1 to {jobspec.MAX_POOL} (as in a spec), got {v}")
        st = self._job(name, reconcile=True)
        if st.state not in ("submitted", "starting", "running", "scaling"):
            raise ControlError(409, f"job {name!r} is {known(st.state)}: nothing to scale")
        raw = msgspec.json.decode(self.store.spec_json(name))
        spec = jobspec.from_dict(raw)
        if generators is not None and (spec.generators.engine == "external" or spec.generators.router_url):
            raise ControlError(
                422,
                "generators of a job with external engines or a router are not launched by Slipstream: "
                "add engines to the router or the urls instead",
            )
        if spec.placement == "colocated":
            raise ControlError(
                422,
                "a job with placement colocated keeps one engine per trainer rank's device: its pools "
                "are not scaled (resubmit it with other counts)",
            )
        self._check_scale(name, raw, spec, generators, trainers)
        self.store.set_desired(name, generators=generators, trainers=trainers)
        log.info("job %s: desired generators=%s trainers=%s", name, generators, trainers)
        return {"name": name, "desired": msgspec.to_builtins(self.store.desired(name))}

    def _check_scale(
        self, name: str, raw: dict, spec: jobspec.JobSpec, generators: int | None, trainers: int | None
    ) -> None:
        """Refuse (422, with the spec's own reason) pool sizes the job's spec does not allow: the spec is
        rebuilt with them (and the rollout workers the driver would run), so every rule of the spec
        (fsdp for several trainer ranks, pool caps, ...) applies as at submit."""
        want = self.store.desired(name)
        n, m = generators, trainers
        if n is None:
            n = spec.generators.num_engines if want.generators is UNSET else want.generators
        if m is None:
            m = spec.trainer.num_trainers if want.trainers is UNSET else want.trainers
        g = dict(raw.get("generators") or {})
        if n != spec.generators.num_engines:  # the driver runs workers_per_engine per engine then
            per = -(
                -spec.generators.num_workers // spec.generators.num_engines
            )  # generators.workers_per_engine
            g.update(num_engines=n, num_workers=per * n)
        scaled = {**raw, "generators": g, "trainer": {**(raw.get("trainer") or {}), "num_trainers": m}}
        try:
            jobspec.from_dict(scaled)
        except jobspec.JobSpecError as e:
            why = str(e).removeprefix("invalid job spec: ")
            asked = ", ".join(
                f"{k} {v}" for k, v in (("generators", generators), ("trainers", trainers)) if v
            )
            raise ControlError(422, f"job {name!r} cannot run with {asked}: {why}") from None

    def stop(self, name: str, force: bool = False, checkpoint: bool = True, reason: str = "") -> dict:
        """Ask the job's trainer to end after its current step, writing a checkpoint there unless
        `checkpoint` is False; `force`: also stop the Ray job now (no checkpoint). The answer's `message`
        says what happens (or that the job has ended already: nothing to do)."""
        st = self._job(name, reconcile=True)
        state = known(st.state)
        ck_dir = job_checkpoint_dir(json.loads(self.store.spec_json(name) or "{}"))
        latest = latest_checkpoint(ck_dir)
        on_disk = (
            f"the latest checkpoint is at version {latest['version']}: {latest['path']}"
            if latest
            else "there is no checkpoint"
        )
        out = {"name": name, "state": state, "force": force}
        if state not in ACTIVE_STATES:
            at = f" at version {st.version}" if st.version not in (UNSET, None) else ""
            log.info("job %s: stop: already %s, nothing to do", name, state)
            return {
                **out,
                "stop": False,
                "checkpoint": False,
                "message": f"job {name!r} already ended ({state}{at}): nothing to do; {on_disk}",
            }
        want = self.store.desired(name)
        again = want.stop
        # a stop asked for with a checkpoint keeps it (the trainer was told so already)
        checkpoint = checkpoint or (again and want.stop_checkpoint)
        self.store.request_stop(name, checkpoint=checkpoint, reason=reason)
        sid, driver = st.ray_job_id or None, st.driver or None
        if force:
            message = (
                self._force_stop(name, sid, driver) + f"; no checkpoint is written at the stop; {on_disk}"
            )
        elif state == "submitted" and not driver:  # no trainer yet that could write a checkpoint
            checkpoint = False
            message = (
                f"the job has not started (Ray submission {sid} has no driver yet): its driver ends it as it "
                f"starts, without training; no checkpoint is written; {on_disk}"
            )
        elif again:
            message = "a stop was requested already: the trainer ends after its current step" + (
                ", with a checkpoint there" if checkpoint else ", writing no checkpoint"
            )
        elif checkpoint:
            message = (
                f"the trainer ends after its current step and writes a checkpoint there (under {ck_dir}); "
                f"`slipstream status {name}` shows it once the job has stopped"
            )
        else:
            message = f"the trainer ends after its current step; no checkpoint is written (--no-checkpoint): {on_disk}"
        log.info(
            "job %s: stop requested%s%s: %s",
            name,
            f" ({reason})" if reason else "",
            " (forced)" if force else "",
            message,
        )
        return {**out, "stop": True, "checkpoint": checkpoint and not force, "message": message}

    def _force_stop(self, name: str, sid: str | None, driver: dict | None) -> str:
        """Have Ray stop the job's submission `sid` now; what happens, in words."""
        if not sid:  # a record from before submission ids: Ray cannot be asked for it by name
            return "its Ray submission id is unknown: nothing is stopped by Ray, its driver (if any) reads the stop"
        try:
            stopping = self.ray.stop_job(sid)
        except Exception as e:
            raise ControlError(503, f"Ray could not stop job {name!r} (submission {sid}): {e}") from e
        if not stopping:
            return f"Ray says submission {sid} has ended already: nothing to stop"
        if driver:
            return f"Ray is stopping submission {sid} now: SIGTERM to its driver ({lease.describe(driver)})"
        return f"Ray is cancelling submission {sid} now: its driver has not started, nothing trained"

    def remove(self, name: str, purge: bool = False) -> dict:
        """Delete an ended job's records: its control entry and every Redis key under its prefix (the
        stream, ledger, progress, status...). Its output directory stays unless `purge` (`purge_job_dir`:
        the job's own directory under HOME/jobs, and nothing outside it). A job that may still run is
        refused."""
        st = self.status(name)  # also notices a driver that died without reporting
        if st.state in ACTIVE_STATES:
            raise ControlError(
                409, f"job {name!r} is {st.state}; stop it first (slipstream stop {name}), then remove it"
            )
        out = Path(st.output_dir or self.home / "jobs" / name)
        removed = self.store.remove(name)
        self._last_status.pop(name, None)
        try:  # its processes are gone: so goes its Redis user
            delete_job_user(self.admin, name)
            (self.home / "jobs" / name / "redis_url").unlink(missing_ok=True)
        except redis.RedisError as e:
            log.warning("job %s: its Redis user could not be deleted: %s", name, e)
        try:
            purged = purge_job_dir(self.home, name) if purge else {}
        except ValueError as e:
            raise ControlError(422, str(e)) from None
        output_removed = purged.get("deleted") is not None
        if purge and out.exists():  # what is left is outside the job's directory (or behind its link)
            log.info("job %s: output %s is outside %s; kept", name, out, self.home / "jobs" / name)
        log.info(
            "job %s removed (%d Redis keys; output %s %s)",
            name, removed, out, "deleted" if output_removed else "kept",
        )  # fmt: skip
        return {
            "name": name,
            "keys": removed,
            "output_dir": str(out),
            "output_removed": output_removed,
            "link_removed": purged.get("link"),
        }

    def checkpoint(self, name: str) -> dict:
        st = self._job(name, reconcile=True)
        if st.state not in ("running", "scaling"):
            raise ControlError(409, f"job {name!r} is {known(st.state)}: no trainer to checkpoint")
        self.store.push_command(name, "checkpoint")
        return {"name": name, "checkpoint": "requested"}
