"""Job operations of the control plane (what the control API serves): submit a job as a Ray job running
slipstream/driver.py, list and inspect jobs, read their logs, scale their pools, stop them, ask for a
checkpoint. State lives in the cluster's Redis (slipstream/jobs.py); the driver acts on it.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import msgspec
import redis
import yaml

from slipstream import jobspec
from slipstream.cluster import ClusterInfo, project_pythonpath, ray_env
from slipstream.jobs import ACTIVE_STATES, JobStore, check_name
from slipstream.launcher import ProgressReader

log = logging.getLogger(__name__)

RAY_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ControlError(Exception):
    """A request the control plane refuses; `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def resolve_spec_paths(spec: jobspec.JobSpec, home: Path, cwd: str | None) -> jobspec.JobSpec:
    """Relative paths in a submitted spec by jobspec.resolve_paths' rule, against the submitter's
    working directory (`cwd`, same filesystem as the cluster). Outputs are contained: output_dir is
    the job's own directory HOME/jobs/NAME (a relative one is ignored; an absolute one, normalised with
    symlinks resolved, must lie inside it), and so must checkpoint_dir; so no two jobs share one and no
    job writes outside HOME. Raises JobSpecError naming the key."""
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
    def __init__(self, info: ClusterInfo) -> None:
        self.info = info
        self.home = Path(info.home)
        self.r = redis.Redis.from_url(info.redis_url, socket_connect_timeout=5)
        self.store = JobStore(self.r)
        self._ray = None

    @property
    def ray(self):
        """Ray's job-submission client (token auth), made on first use."""
        if self._ray is None:
            os.environ.update(ray_env(self.info))
            from ray.job_submission import JobSubmissionClient

            self._ray = JobSubmissionClient(
                self.info.dashboard_url, headers={"Authorization": f"Bearer {self.info.ray_auth_token}"}
            )
        return self._ray

    def _job(self, name: str) -> dict[str, Any]:
        if not self.store.exists(name):
            raise ControlError(404, f"no job {name!r} (slipstream list shows the jobs)")
        return self.store.status(name)

    # --- operations -----------------------------------------------------------------------------------
    def submit(self, spec_text: str, overrides: list[str] | None = None, cwd: str | None = None) -> dict:
        try:
            spec = jobspec.loads(spec_text, overrides or [])
        except jobspec.JobSpecError as e:
            raise ControlError(422, str(e)) from None
        except yaml.YAMLError as e:  # loads reports the spec's own YAML errors: this is an override's value
            raise ControlError(422, f"invalid job spec: an override's value is not YAML: {e}") from None
        except RecursionError:
            raise ControlError(422, "invalid job spec: nested too deeply") from None
        if why := _path_problem(spec, cwd):
            raise ControlError(422, f"invalid job spec: {why}")
        if why := check_name(spec.name):
            raise ControlError(422, f"invalid job spec: job name {spec.name!r}: {why} - at `$.name`")
        if self.store.exists(spec.name) and self.store.active(spec.name):
            raise ControlError(
                409, f"job {spec.name!r} is {self.store.status(spec.name)['state']}; stop it first"
            )
        try:
            spec = resolve_spec_paths(spec, self.home, cwd)
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
        self.store.create(
            spec.name, jobspec.to_json(spec), spec.generators.num_engines, spec.trainer.num_trainers
        )
        # Ray runs the entrypoint through a shell: every part is quoted (the name is also validated).
        entry = shlex.join(
            [sys.executable, "-m", "slipstream.driver", "--home", str(self.home), "--job", spec.name]
        )
        try:
            ray_id = self.ray.submit_job(
                entrypoint=entry,
                runtime_env={
                    "env_vars": {
                        "PYTHONPATH": project_pythonpath(),
                        "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false",
                    }
                },
                metadata={"slipstream_job": spec.name},
            )
        except Exception as e:
            self.store.update_status(spec.name, state="failed", error=f"Ray job submission failed: {e}")
            raise ControlError(503, f"Ray job submission failed: {e}") from e
        self.store.update_status(spec.name, ray_job_id=ray_id, output_dir=spec.output_dir)
        log.info("job %s submitted as Ray job %s (output %s)", spec.name, ray_id, spec.output_dir)
        return {"name": spec.name, "ray_job_id": ray_id, "output_dir": spec.output_dir}

    def get(self, name: str) -> dict:
        st = self._job(name)
        st["name"] = name
        st["desired"] = self.store.desired(name)
        ray_id = st.get("ray_job_id")
        if ray_id:
            try:
                info = self.ray.get_job_info(ray_id)
                st["ray_status"] = str(info.status.value if hasattr(info.status, "value") else info.status)
                if st.get("state") in ACTIVE_STATES and st["ray_status"] in RAY_TERMINAL:
                    # the driver died without reporting (killed, crashed before it could)
                    st = self.store.update_status(
                        name, state="failed" if st["ray_status"] == "FAILED" else "stopped",
                        error=info.message or st.get("error"),
                    )  # fmt: skip
                    st.update(name=name, desired=self.store.desired(name), ray_status=info.status.value)
            except Exception as e:  # Ray down: report what Redis has
                st["ray_status"] = f"unknown ({e})"
        return st

    def list(self) -> list[dict]:
        out = []
        for name in self.store.names():
            st = self.store.status(name)
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
        """The job's progress records (one per optimizer step, as ProgressReader yields them: with the
        cumulative `tokens_per_s`) after the first `since`; `next` is the `since` of the next call."""
        self._job(name)
        if since < 0:
            raise ControlError(422, f"since must be >= 0, got {since}")
        reader, records = ProgressReader(self.r, name), []
        while batch := reader.read(block_ms=0):
            records += batch
        return {"name": name, "since": since, "next": len(records), "records": records[since:]}

    def logs(self, name: str, component: str | None = None, tail: int = 200) -> dict:
        st = self._job(name)
        log_dir = Path(st.get("output_dir", self.home / "jobs" / name)) / "logs"
        components = sorted(p.stem for p in log_dir.glob("*.log")) if log_dir.is_dir() else []
        if component is None:
            text = ""
            if st.get("ray_job_id"):
                try:
                    text = self.ray.get_job_logs(st["ray_job_id"])
                except Exception as e:
                    text = f"(Ray job logs unavailable: {e})\n"
        else:
            if component not in components:
                raise ControlError(404, f"job {name!r} has no log {component!r}; it has {components}")
            text = (log_dir / f"{component}.log").read_text(errors="replace")
        lines = text.splitlines()[-tail:] if tail > 0 else text.splitlines()
        return {"name": name, "component": component or "driver", "components": components, "lines": lines}

    def scale(self, name: str, generators: int | None = None, trainers: int | None = None) -> dict:
        st = self._job(name)
        if generators is None and trainers is None:
            raise ControlError(422, "scale needs generators and/or trainers")
        for key, v in (("generators", generators), ("trainers", trainers)):
            if v is not None and not 1 <= v <= jobspec.MAX_POOL:
                raise ControlError(422, f"{key} must be 1 to {jobspec.MAX_POOL} (as in a spec), got {v}")
        if st.get("state") not in ("submitted", "starting", "running", "scaling"):
            raise ControlError(409, f"job {name!r} is {st.get('state')}: nothing to scale")
        spec = jobspec.from_dict(msgspec.json.decode(self.store.spec_json(name)))
        if generators is not None and (spec.generators.engine == "external" or spec.generators.router_url):
            raise ControlError(
                422,
                "generators of a job with external engines or a router are not launched by Slipstream: "
                "add engines to the router or the urls instead",
            )
        self.store.set_desired(name, generators=generators, trainers=trainers)
        log.info("job %s: desired generators=%s trainers=%s", name, generators, trainers)
        return {"name": name, "desired": self.store.desired(name)}

    def stop(self, name: str, force: bool = False) -> dict:
        st = self._job(name)
        self.store.request_stop(name)
        if force and st.get("ray_job_id"):
            try:
                self.ray.stop_job(st["ray_job_id"])
            except Exception as e:
                raise ControlError(503, f"Ray could not stop job {name!r}: {e}") from e
        log.info("job %s: stop requested%s", name, " (forced)" if force else "")
        return {"name": name, "stop": True, "force": force}

    def checkpoint(self, name: str) -> dict:
        st = self._job(name)
        if st.get("state") not in ("running", "scaling"):
            raise ControlError(409, f"job {name!r} is {st.get('state')}: no trainer to checkpoint")
        self.store.push_command(name, "checkpoint")
        return {"name": name, "checkpoint": "requested"}
