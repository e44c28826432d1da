"""Job operations of the control plane (what the control API serves): submit a job as a Ray job running
slipstream/job/driver.py, list and inspect jobs, read their logs, scale their pools, stop them, ask for a
checkpoint. State lives in the cluster's Redis (slipstream/cluster/job_store.py); the driver acts on it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

import jobspec
from common.logtext import plain
from generator_fleet.tasks import check_import_paths
from generator_fleet.tools.impl_check import TOOL_MODULES_ENV, check_tools
from jobspec.spec import eval_task
from replay_buffer import ReplayBuffer
from replay_buffer.redis_server import delete_job_user, job_user, set_job_user
from slipstream.cluster.job_store import (
    ACTIVE_STATES,
    NO_POOLS,
    JobStore,
    checkpoint_dir,
    latest_checkpoint,
    resume_fields,
    resume_version,
)
from slipstream.cluster.state import ClusterInfo, project_pythonpath, write_job_redis_url
from slipstream.job.progress import ProgressReader

log = logging.getLogger(__name__)

RAY_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
SUBMIT_GRACE_S = 120.0
"""A job recorded as submitted with no Ray job id after this long never reached Ray (the control API
died between recording it and submitting it): it is marked interrupted."""
REDIS_TIMEOUT_S = 5.0
"""How long the control plane waits for one Redis reply. A request is answered (503, or a status's last
known state) after about this long when Redis stalls, instead of hanging on it or retrying for a minute
as a job's processes do (replay_buffer/client.py)."""
REDIS_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)
"""What redis-py raises when Redis does not answer (stalled, overloaded, down, unreachable)."""


class ControlError(Exception):
    """A request the control plane refuses; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


def resolve_spec_paths(spec: jobspec.JobSpec, home: Path, cwd: str | None) -> jobspec.JobSpec:
    """Relative paths in a submitted spec by jobspec.resolve_paths' rule, against the submitter's
    working directory (`cwd`, same filesystem as the cluster). Outputs are contained: output_dir is
    the job's own directory HOME/jobs/NAME (a relative one is replaced by it, and the submit answer says
    so: output_dir_note; an absolute one, normalised with symlinks resolved, must lie inside it), and so
    must checkpoint_dir; so no two jobs share one and no job writes outside HOME. Raises JobSpecError
    naming the key."""
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
        raise ControlError(422, f"job name {name!r} is not a directory name")
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


def _path_problem(spec: jobspec.JobSpec, cwd: str | None) -> str | None:
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


class JobControl:
    def __init__(
        self,
        info: ClusterInfo,
        tool_modules: list[str] | None = None,
        redis_timeout_s: float = REDIS_TIMEOUT_S,
    ) -> None:
        """`tool_modules`: the modules custom tools may come from ([]: builtin tools only; None: any)."""
        self.info = info
        self.tool_modules = tool_modules
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
        self._admin = None
        self._last_status: dict[str, tuple[float, dict]] = {}
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
        if self._ray is None:  # the token goes in the header: this process's environment stays its own
            from ray.job_submission import JobSubmissionClient

            self._ray = JobSubmissionClient(
                self.info.dashboard_url, headers={"Authorization": f"Bearer {self.info.ray_auth_token}"}
            )
        return self._ray

    def _job(self, name: str, reconcile: bool = False) -> dict[str, Any]:
        """The job's status; `reconcile`: first mark an active job whose driver is gone (see reconcile)."""
        if not self.store.exists(name):
            raise ControlError(404, f"no job {name!r} (slipstream list shows the jobs)")
        st = self.store.status(name)
        return self._reconcile(name, st) if reconcile else st

    def _ray_status(self, ray_id: str) -> tuple[str, str]:
        """(status, message) of a Ray job: Ray's status, `GONE` if Ray does not know the job (its head
        was restarted: job records do not survive it), `UNKNOWN` if Ray cannot be asked."""
        try:
            info = self.ray.get_job_info(ray_id)
        except RuntimeError as e:  # the SDK's answer to an HTTP error status
            if "status code 404" in str(e):
                return "GONE", f"Ray has no job {ray_id} (the cluster was restarted since it started)"
            return "UNKNOWN", str(e)
        except Exception as e:  # Ray down or unreachable
            return "UNKNOWN", f"{type(e).__name__}: {e}"
        return str(getattr(info.status, "value", info.status)), info.message or ""

    def _reconcile(self, name: str, st: dict[str, Any]) -> dict[str, Any]:
        """An active job whose driver is gone (Ray does not know its Ray job, or says it ended, or it
        never reached Ray) without having reported an end is marked `interrupted` (`failed` if Ray says
        the driver failed) with the reason and its latest checkpoint, so that it can be resubmitted
        (resumed with `trainer.resume_from: latest`) and no command finds it stuck. Ray unreachable:
        nothing is decided. Adds `ray_status` to the status it returns."""
        state, ray_id = st.get("state"), st.get("ray_job_id")
        if ray_id:
            ray_status, message = self._ray_status(ray_id)
            st["ray_status"] = ray_status if ray_status != "UNKNOWN" else f"unknown ({message})"
        elif state in ACTIVE_STATES and time.time() - st.get("submitted_at", time.time()) > SUBMIT_GRACE_S:
            ray_status, message = "GONE", "the job never reached Ray (its submission was interrupted)"
        else:
            return st
        if state not in ACTIVE_STATES or ray_status not in RAY_TERMINAL + ("GONE",):
            return st
        if ray_status == "FAILED":
            new, why = "failed", f"the driver failed: {message}"
        elif ray_status == "STOPPED" and self.store.desired(name)["stop"]:
            new, why = "stopped", f"stopped by Ray before the driver could report: {message}"
        else:
            new, why = "interrupted", f"the driver is gone without reporting an end: {message or ray_status}"
        resume = resume_fields(json.loads(self.store.spec_json(name) or "{}"))
        error = f"{why}; last reported version {st.get('version', 0)}; {resume['note']}"
        st = self.store.update_status(name, state=new, error=error, phase=None, pools=NO_POOLS, **resume)
        st["ray_status"] = ray_status
        log.warning("job %s: %s -> %s: %s", name, state, new, error)
        return st

    def reconcile(self) -> list[str]:
        """Mark every active job whose driver is gone (the control API does it at start-up: after a
        cluster restart no job is left `running` with nothing running it). The jobs marked."""
        marked = []
        for name in self.store.names():
            st = self.store.status(name)
            if (
                st.get("state") in ACTIVE_STATES
                and self._reconcile(name, st).get("state") not in ACTIVE_STATES
            ):
                marked.append(name)
        return marked

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
        if why := _path_problem(spec, cwd):
            raise ControlError(422, f"invalid job spec: {why}")
        # Each tools[].impl: allowed, and a class with the Tool protocol's members in its source (read, not run).
        if why := check_tools(spec.tools, self.tool_modules):
            raise ControlError(422, f"invalid job spec: {why}")
        # A task or reward named by import path: the same allow-list, its source read, not run.
        if why := check_import_paths(
            spec.dataset.name, spec.reward.name, self.tool_modules, eval_dataset_name=eval_task(spec)
        ):
            raise ControlError(422, f"invalid job spec: {why}")
        if (
            self.store.exists(spec.name)
            and self._job(spec.name, reconcile=True).get("state") in ACTIVE_STATES
        ):
            raise ControlError(
                409, f"job {spec.name!r} is {self.store.status(spec.name)['state']}; stop it first"
            )
        note = output_dir_note(spec, self.home)
        try:
            spec = resolve_spec_paths(spec, self.home, cwd)
            jobspec.check_context(spec)  # once its model exists; the driver checks again after building it
        except jobspec.JobSpecError as e:
            raise ControlError(422, str(e)) from None
        except (OSError, ValueError) as e:  # e.g. a lone surrogate the filesystem cannot encode
            raise ControlError(422, f"invalid job spec: a path cannot be resolved: {e}") from None
        try:
            Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(spec.output_dir) / "job.json").write_text(jobspec.to_json(spec))
        except OSError as e:
            raise ControlError(
                422, f"invalid job spec: cannot write the output directory: {e} - at `$.output_dir`"
            ) from None
        try:
            self._job_credentials(spec.name)
        except (redis.RedisError, OSError) as e:
            raise ControlError(503, f"cannot create the job's Redis user: {e}") from e
        self.store.create(
            spec.name,
            jobspec.to_json(spec),
            spec.generators.num_engines,
            spec.trainer.num_trainers,
            version=resume_version(msgspec.to_builtins(spec)),
        )
        # Ray runs the entrypoint through a shell: every part is quoted (the name is also validated).
        entry = shlex.join(
            [sys.executable, "-m", "slipstream.job.driver", "--home", str(self.home), "--job", spec.name]
        )
        try:
            ray_id = self.ray.submit_job(
                entrypoint=entry,
                runtime_env={
                    "env_vars": {
                        "PYTHONPATH": project_pythonpath(),
                        "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false",
                        # the rollout workers enforce the allow-list again when they build the tools
                        **(
                            {TOOL_MODULES_ENV: json.dumps(self.tool_modules)}
                            if self.tool_modules is not None
                            else {}
                        ),
                    }
                },
                metadata={"slipstream_job": spec.name},
            )
        except Exception as e:
            self.store.update_status(spec.name, state="failed", error=f"Ray job submission failed: {e}")
            raise ControlError(503, f"Ray job submission failed: {e}") from e
        self.store.update_status(spec.name, ray_job_id=ray_id, output_dir=spec.output_dir)
        log.info("job %s submitted as Ray job %s (output %s)", spec.name, ray_id, spec.output_dir)
        return {
            "name": spec.name,
            "ray_job_id": ray_id,
            "output_dir": spec.output_dir,
            **({"note": note} if note else {}),
        }

    def get(self, name: str) -> dict:
        """The job's status. While Redis does not answer, the last status this process read, with
        `stale_s` (its age, seconds) and `stale_reason`; a job it never read raises (the API's 503)."""
        try:
            st = self._job(name, reconcile=True)
            st["name"] = name
            st["desired"] = self.store.desired(name)
        except REDIS_UNAVAILABLE as e:
            if name not in self._last_status:
                raise
            at, last = self._last_status[name]
            age = time.monotonic() - at
            log.warning("job %s: Redis did not answer (%s); answering its status of %.0f s ago", name, e, age)
            return {**last, "stale_s": round(age, 1), "stale_reason": self.redis_unavailable(e)}
        self._last_status[name] = (time.monotonic(), st)
        return st

    def list(self) -> list[dict]:
        out = []
        for name in self.store.names():
            st = self.store.status(name)
            if st.get("state") in ACTIVE_STATES:
                st = self._reconcile(name, st)
            out.append(
                {
                    "name": name,
                    "state": st.get("state"),
                    "version": st.get("version", 0),
                    "total_steps": st.get("total_steps"),
                    "reward_mean": st.get("reward_mean"),
                    "pools": st.get("pools", {}),
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
        log_dir = Path(st.get("output_dir", self.home / "jobs" / name)) / "logs"
        components = sorted(p.stem for p in log_dir.glob("*.log")) if log_dir.is_dir() else []
        note = None
        if component is None:
            text, unavailable = "", "the job has no Ray job"
            if st.get("ray_job_id"):
                try:
                    text, unavailable = self.ray.get_job_logs(st["ray_job_id"]), None
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
        if st.get("state") not in ("submitted", "starting", "running", "scaling"):
            raise ControlError(409, f"job {name!r} is {st.get('state')}: nothing to scale")
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
        return {"name": name, "desired": self.store.desired(name)}

    def _check_scale(
        self, name: str, raw: dict, spec: jobspec.JobSpec, generators: int | None, trainers: int | None
    ) -> None:
        """Refuse (422, with the spec's own reason) pool sizes the job's spec does not allow: the spec is
        rebuilt with them (and the rollout workers the driver would run), so every rule of the spec
        (fsdp for several trainer ranks, pool caps, ...) applies as at submit."""
        want = self.store.desired(name)
        n = generators if generators is not None else want.get("generators", spec.generators.num_engines)
        m = trainers if trainers is not None else want.get("trainers", spec.trainer.num_trainers)
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
        state = st.get("state")
        ck_dir = checkpoint_dir(json.loads(self.store.spec_json(name) or "{}"))
        latest = latest_checkpoint(ck_dir)
        on_disk = (
            f"the latest checkpoint is at version {latest['version']}: {latest['path']}"
            if latest
            else "there is no checkpoint"
        )
        out = {"name": name, "state": state, "force": force}
        if state not in ACTIVE_STATES:
            at = f" at version {st['version']}" if st.get("version") is not None else ""
            log.info("job %s: stop: already %s, nothing to do", name, state)
            return {
                **out,
                "stop": False,
                "checkpoint": False,
                "message": f"job {name!r} already ended ({state}{at}): nothing to do; {on_disk}",
            }
        want = self.store.desired(name)
        again = want["stop"]
        # a stop asked for with a checkpoint keeps it (the trainer was told so already)
        checkpoint = checkpoint or (again and want["stop_checkpoint"])
        self.store.request_stop(name, checkpoint=checkpoint, reason=reason)
        if force and st.get("ray_job_id"):
            try:
                self.ray.stop_job(st["ray_job_id"])
            except Exception as e:
                raise ControlError(503, f"Ray could not stop job {name!r}: {e}") from e
        if force:
            message = f"stopping the Ray job now: no checkpoint is written at the stop; {on_disk}"
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

    def remove(self, name: str, purge: bool = False) -> dict:
        """Delete an ended job's records: its control entry and every Redis key under its prefix (the
        stream, ledger, progress, status...). Its output directory stays unless `purge` (`purge_job_dir`:
        the job's own directory under HOME/jobs, and nothing outside it). A job that may still run is
        refused."""
        st = self.get(name)  # also notices a driver that died without reporting
        if st.get("state") in ACTIVE_STATES:
            raise ControlError(
                409, f"job {name!r} is {st['state']}; stop it first (slipstream stop {name}), then remove it"
            )
        out = Path(st.get("output_dir") or self.home / "jobs" / name)
        removed = self.store.remove(name)
        self._last_status.pop(name, None)
        try:  # its processes are gone: so goes its Redis user
            delete_job_user(self.admin, name)
            (self.home / "jobs" / name / "redis_url").unlink(missing_ok=True)
        except redis.RedisError as e:
            log.warning("job %s: its Redis user could not be deleted: %s", name, e)
        purged = purge_job_dir(self.home, name) if purge else {}
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
        if st.get("state") not in ("running", "scaling"):
            raise ControlError(409, f"job {name!r} is {st.get('state')}: no trainer to checkpoint")
        self.store.push_command(name, "checkpoint")
        return {"name": name, "checkpoint": "requested"}
