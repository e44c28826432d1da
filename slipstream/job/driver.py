"""The job driver: runs one submitted job on the cluster's Ray, as a Ray job (`slipstream submit` starts
`python -m slipstream.job.driver --home HOME --job NAME` through Ray's job API). Its loop reads what the
user wants, as the control API recorded it in Redis (slipstream/cluster/job_store.py), reconciles the
job's two pools with it, and reports the job's state and progress (and its last evaluation) there for
`slipstream status`:

- generators N: the generator pool (slipstream/job/generators.py) adds or removes engines and their
  rollout workers while training goes on;
- trainers M: the trainer pool (slipstream/job/trainers.py) stops after its current step with a
  checkpoint, and a pool of M ranks resumes from it;
- checkpoint: the trainer writes one after its current step. stop: the trainer ends after its current
  step (final checkpoint and HF export as the spec says), then everything stops.

Each pool supervises its own actors (replacing dead or hung ones); both share the job's restart budget
(the spec's `supervision`, slipstream/job/supervise.py). The newest failure and the restarts so far are in
the job's status while it runs (`failure`, `restarts`); a failure past the budget (out of memory again on
the same batch, a full disk) ends the job `failed`, with the cause and the setting to change as its error.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis

import jobspec
from common.logtext import PlainFormatter
from jobspec import JobSpec
from jobspec.spec import check_context, check_name
from model_zoo.prepare import prepare_model
from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from slipstream.cluster.job_store import NO_POOLS, JobStore, load_job_spec, resume_fields, resume_version
from slipstream.job.generators import GeneratorPool
from slipstream.job.lease import LeaseRefused, RunLease, exit_now
from slipstream.job.placement import colocation
from slipstream.job.prepare import RUN_FILES
from slipstream.job.progress import STATUS_FIELDS, ProgressReader, format_eval
from slipstream.job.supervise import POLL_S, GiveUp, Restarts
from slipstream.job.tracking import Tracker
from slipstream.job.trainers import TrainerPool, checkpoint_dir

log = logging.getLogger("slipstream.job.driver")


class _Stop(Exception):
    """SIGTERM (Ray's `stop_job`, or the control API's forced stop)."""


class JobDriver:
    """One job: its generator and trainer pools, reconciled with the job store's desired state, and the
    job's status. `on_progress` takes each progress record of this attempt (`slipstream run` prints it)."""

    def __init__(
        self,
        spec: JobSpec,
        redis_url: str,
        store: JobStore,
        on_progress: Callable[[dict], None] | None = None,
    ) -> None:
        self.spec, self.redis_url, self.store = spec, redis_url, store
        self.on_progress = on_progress
        self.job = spec.name
        self.r = connect(redis_url)
        self.buffer = ReplayBuffer(self.r, self.job)
        self.progress = ProgressReader(self.r, self.job)
        self.restarts = Restarts(spec, version=self._version_now, on_failure=lambda f: self.report())
        """The job's restart budget (the spec's `supervision`), shared by both pools."""
        between = lambda: self.read_progress(block_ms=0)  # noqa: E731
        self.placement = colocation(spec)
        self.generators = GeneratorPool(spec, redis_url, self.restarts, between, placement=self.placement)
        self.trainers = TrainerPool(
            spec,
            redis_url,
            endpoints=lambda: (self.generators.engine_urls, self.generators.api_key),
            restarts=self.restarts,
            between=between,
            before_restart=self.generators.continue_engines,
            placement=self.placement,
        )
        self._refused_scale: tuple | None = None
        # a resumed attempt starts at its checkpoint's version: status shows it, not 0, while it starts
        self.version = resume_version(msgspec.to_builtins(spec))
        self.last: dict = {}
        self.last_eval: dict = {}
        """The newest eval record of this attempt (its version and scores go into the status)."""
        self.run_info: dict = {}  # run_id, attempt (ReplayBuffer.begin_run)
        self.tracker: Tracker | None = None
        """TensorBoard / W&B (the spec's `tracking`), from begin_run on: every record of the progress
        stream, the trainer's steps and the evaluator's records alike, goes in through `_track`."""
        self._closed = False

    @property
    def records(self) -> list[dict]:
        """The run's progress records read so far (superseded ones removed): the end-of-job report."""
        return self.progress.records

    # --- the loop -------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Start the pools, then reconcile them with the desired state until the trainer is done; the
        trainer pool's result. A failure past the restart budget raises GiveUp, reported first."""
        try:
            return self._run()
        except GiveUp as e:
            # over, but its processes are not gone yet: `stopping` keeps the name taken until `failed`
            log.error("job %s failed: %s", self.job, e)
            self.report("stopping", phase="failed; stopping every process", error=str(e))
            raise

    def _run(self) -> dict:
        desired = self.store.desired(self.job)
        self.begin_run()
        self.start(desired)
        stopping = stop_checkpoint = False
        while True:
            result, restarted = self.trainers.check()
            if result is not None:
                break
            if restarted | self.generators.check_workers() | self.generators.check_engines():
                self.report()
            self.generators.check_evaluator()
            self.read_progress(block_ms=int(POLL_S * 1000))
            want = self.store.desired(self.job)
            if want["stop"] and (not stopping or (want["stop_checkpoint"] and not stop_checkpoint)):
                self.stop(want, again=stopping)
                stopping, stop_checkpoint = True, want["stop_checkpoint"]
            if stopping:
                continue
            for cmd in self.store.pop_commands(self.job):
                if cmd == "checkpoint":
                    log.info("checkpoint requested")
                    self.trainers.request_checkpoint()
            if (result := self.reconcile(want)) is not None:
                break
        for rec in self.progress.read(block_ms=0):
            self._track(rec)
            if self.progress.this_attempt(rec):
                self.last, self.version = rec, rec["version"]
        self.version = result["version"]
        if self.generators.evaluator is not None:
            # the engines hold the final policy (the trainer publishes its last version): score it
            self.report(phase=f"evaluating the final version {self.version}")
            self.generators.evaluate_now()
            self.read_progress(block_ms=0)
        return result

    def start(self, desired: dict) -> None:
        """The model ready, the buffer's consumer group and version set, both pools started."""
        model, build = Path(self.spec.model.path), self.spec.model.build
        if build is not None and not (model / "config.json").exists():
            phase = f"building model {build} at {model} (once; jobs with this model.path reuse it)"
        else:
            phase = f"loading model {model}"
        log.info("job %s: %s", self.job, phase)
        self.report("starting", phase=phase)
        prepare_model(self.spec.model, self.spec.dataset)
        check_context(self.spec)  # the model's context is known now, also when this job built it
        self.buffer.ensure_group()
        if self.r.get(self.buffer.keys.version) is None:
            self.buffer.set_version(0)
        n = desired.get("generators", self.spec.generators.num_engines)
        self.report(phase=f"starting {n} generator(s) and their rollout workers")
        self.generators.start(n)
        self.generators.start_evaluator()
        if self.generators.evaluator is not None and self.r.get(self.buffer.keys.version) in (b"0", "0"):
            # version 0 before the first step: the engines keep it until the trainer's first publish, so
            # the trainer starts after this evaluation (rollouts fill the buffer meanwhile)
            self.report(phase="evaluating version 0 before the first step")
            self.generators.evaluate_now()
        m = desired.get("trainers", self.spec.trainer.num_trainers)
        self.report(phase=f"starting {m} trainer rank(s)")
        self.trainers.start(m)
        self.report("running", phase=None)

    def stop(self, want: dict, again: bool) -> None:
        """A stop request (`again`: a checkpoint is asked for after the stop began)."""
        if again:
            log.info("stop: a checkpoint is asked for now (it is written where the trainer stops)")
            self.trainers.stop(checkpoint=True)
            return
        log.info(
            "stop requested%s: the trainer ends after its current step, %s",
            f" ({want['stop_reason']})" if want.get("stop_reason") else "",
            "with a checkpoint there" if want["stop_checkpoint"] else "writing no checkpoint",
        )
        self.report("stopping", phase="the trainer ends after its current step")
        self.trainers.stop(checkpoint=want["stop_checkpoint"])

    def reconcile(self, want: dict) -> dict | None:
        """Pool sizes brought to the desired ones. Returns the trainer pool's result if it finished the
        job before a rescale could stop it."""
        n, m = len(self.generators.engines), len(self.trainers.ranks)
        if self.placement is not None:
            self._refuse_colocated_scale(want, n, m)
            return None
        if self.generators.scalable and want.get("generators", n) != n:
            self.report("scaling", scaling=f"generators {n} -> {want['generators']}")
            self.generators.scale(want["generators"])
            self.report("running", scaling=None)
        if want.get("trainers", m) != m:
            self.report("scaling", scaling=f"trainers {m} -> {want['trainers']}")
            if (ended := self.trainers.rescale(want["trainers"])) is not None:
                return ended
            self.report("running", scaling=None)
        return None

    def _refuse_colocated_scale(self, want: dict, n: int, m: int) -> None:
        """A colocated job keeps one engine per trainer rank's device: a scale request is reported in the
        status and logged once, and nothing changes."""
        asked = (want.get("generators", n), want.get("trainers", m))
        if asked == (n, m) or asked == self._refused_scale:
            return
        self._refused_scale = asked
        why = (
            f"refused: placement colocated keeps {n} generators and {m} trainers (one engine per trainer "
            "rank's device); resubmit with other counts"
        )
        log.warning("scale to generators %d, trainers %d %s", *asked, why)
        self.report(scaling=why)

    def begin_run(self) -> None:
        """A new run of the job (fresh run_id; the previous run's Redis state and per-run output files
        deleted), or, when the spec resumes (trainer.resume_from), the next attempt of the same run."""
        self.run_info = self.buffer.begin_run(resume=self.spec.trainer.resume_from is not None)
        self.progress.attempt = self.run_info["attempt"]
        self.trainers.run_id = self.run_info["run_id"]
        if self.run_info["attempt"] == 1:
            for name in RUN_FILES:
                (Path(self.spec.output_dir) / name).unlink(missing_ok=True)
            ckpts = checkpoint_dir(self.spec)
            if self.spec.trainer.resume_from is None and any(ckpts.glob("step-*")):
                # an earlier run's checkpoints: kept, but apart (this run's `latest`, its restarts and
                # keep_checkpoints' pruning see only its own)
                aside = ckpts.with_name(f"{ckpts.name}.before-{self.run_info['run_id']}")
                ckpts.rename(aside)
                log.warning("an earlier run's checkpoints moved from %s to %s", ckpts, aside)
        log.info("job %s: run %s, attempt %d", self.job, self.run_info["run_id"], self.run_info["attempt"])
        t = self.spec.tracking
        try:
            if t.tensorboard or t.wandb.enabled:
                self.tracker = Tracker(self.spec, self.run_info)
                self.tracker.log_config()
        except Exception as e:  # tracking never fails the job
            log.warning("tracking is off for this job: %s: %s", type(e).__name__, e)

    def _track(self, rec: dict) -> None:
        if self.tracker is not None:
            self.tracker.log_progress(rec)

    def _version_now(self) -> int:
        """The version in Redis (set before the step's record is written); the last record's without it."""
        try:
            return self.buffer.version()
        except redis.RedisError:
            return self.version

    # --- status ---------------------------------------------------------------------------------------
    def _clock(self) -> float:
        try:
            return self.buffer.clock() or 0.0
        except redis.RedisError:
            return self.last.get("elapsed_s", 0.0)

    def report(self, state: str | None = None, **extra) -> None:
        fields = {
            **self.run_info,
            "version": self.version,
            "total_steps": self.spec.algorithm.total_steps,
            "pools": {
                "generators": self.generators.size,
                "rollout_workers": len(self.generators.workers),
                "trainers": self.trainers.size,  # ranks set up and training (not those still starting)
            },
            "restarts": self.restarts,
            **({"failure": msgspec.to_builtins(self.restarts.latest)} if self.restarts.latest else {}),
            # the run's clock and the run's own rate (its records: samples trained ÷ their elapsed_s)
            "elapsed_s": self._clock(),
            "samples_per_s": self.last.get("samples_per_s", 0.0),
            "output_dir": self.spec.output_dir,
            **({"tracking": self.tracker.status()} if self.tracker is not None else {}),
            **{k: self.last[k] for k in STATUS_FIELDS if k in self.last},
            **extra,
        }
        if self.last_eval:
            fields["eval"] = {"version": self.last_eval["version"], **self.last_eval["eval"]}
        try:
            fields["buffer"] = self.buffer.stats()
        except redis.RedisError as e:
            log.warning("buffer stats: %s", e)
        if state is not None:
            fields["state"] = state
        self.store.update_status(self.job, **fields)

    def read_progress(self, block_ms: int = 0) -> None:
        """Take the trainer's new progress records (waiting up to block_ms for one) into the status.
        With `on_progress` (`slipstream run` prints each record as its line) the per-step log line is
        DEBUG, so a step shows once on the terminal; the cluster's driver.log keeps it at INFO."""
        for rec in self.progress.read(block_ms=block_ms):
            self._track(rec)  # every attempt's: the tracker skips what an earlier attempt wrote
            if not self.progress.this_attempt(rec):
                continue  # an earlier attempt's record: the run's report keeps it, the status does not
            self.last = rec
            self.version = rec["version"]
            if self.on_progress:
                self.on_progress(rec)
            log.log(
                logging.DEBUG if self.on_progress else logging.INFO,
                "version %d/%d reward %.3f staleness %.2f tok/s %.0f",
                rec["version"],
                self.spec.algorithm.total_steps,
                rec["reward_mean"],
                rec["staleness_mean"],
                rec["tokens_per_s"],
            )
            self.report()
        evals, self.progress.new_evals = self.progress.new_evals, []
        for rec in evals:
            self._track(rec)  # eval/* scalars; the tracker skips what an earlier attempt wrote
            if not self.progress.this_attempt(rec):
                continue
            self.last_eval = rec
            if self.on_progress:
                self.on_progress(rec)
            log.log(logging.DEBUG if self.on_progress else logging.INFO, "%s", format_eval(rec))
            self.report()

    def close(self) -> None:
        """Stop every actor of both pools (the final report then shows pools of 0)."""
        if self._closed:
            return
        self._closed = True
        self.generators.closing = self.trainers.closing = True  # what stops now is no failure to repair
        self.generators.close(others=self.trainers.ranks)
        self.trainers.close()
        if self.placement is not None:
            self.placement.close()
        if self.tracker is not None:
            self.tracker.close()  # flushes the last steps' events


def error_text(e: BaseException) -> str:
    """An error in one line for the job's status: its type and first line, and, where it carries a
    traceback (an actor's error through Ray), the line that ends it: the real cause. A failure past the
    restart budget is its own message (the cause and the setting to change)."""
    if isinstance(e, GiveUp):
        return str(e)
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours the actor's name
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or [""]
    cause = f" ... {lines[-1][:500]}" if len(lines) > 1 else ""
    return f"{type(e).__name__}: {lines[0][:300]}{cause}"


def _checkpoint_note(driver: JobDriver, result: dict | None, stopped: bool, failed: bool = False) -> dict:
    """The job's final status fields on its checkpoint: `checkpoint` (path, "" if none),
    `checkpoint_version`, and `note`, one line on what a resumption starts from (`failed`: the job
    failed, no stop wrote one)."""
    from slipstream.cluster.job_store import latest_checkpoint

    if result is not None and result.get("checkpoint"):
        ck = {"path": result["checkpoint"], "version": result.get("checkpoint_version")}
        note = f"checkpoint at version {ck['version']}: {ck['path']}"
    else:
        ck = latest_checkpoint(checkpoint_dir(driver.spec))
        if result is not None and stopped and result["version"] > 0:
            why = "no checkpoint written at the stop (stop --no-checkpoint)"
        elif result is not None:
            why = (
                "no checkpoint written (trainer.checkpoint_every is 0)"
                if result["version"]
                else "no step trained"
            )
        elif failed:
            why = "the job failed"
        else:
            why = "no checkpoint written at the stop (forced)"
        note = why + (
            f"; the latest is at version {ck['version']}: {ck['path']}"
            if ck
            else "; there is none to resume from"
        )
    if ck:
        note += " (resume: submit with trainer.resume_from: latest)"
    return {
        "checkpoint": ck["path"] if ck else "",
        "checkpoint_version": ck["version"] if ck else None,
        "note": note,
    }


def final_status(driver: JobDriver, result: dict | None = None, error: BaseException | None = None) -> dict:
    """The job's final status fields, logged: succeeded or stopped (the trainer's `result`), stopped or
    interrupted (a signal: `error` is _Stop or KeyboardInterrupt), or failed (`error`, in one line), each
    with what a resumption starts from."""
    job, store = driver.job, driver.store
    if result is not None:
        stopped = store.desired(job)["stop"]
        final = {"state": "stopped" if stopped else "succeeded", "final_model": result.get("final_model", "")}
        final.update(_checkpoint_note(driver, result, stopped))
        log.info("job %s %s at version %d: %s", job, final["state"], result["version"], final["note"])
    elif isinstance(error, (_Stop, KeyboardInterrupt)):
        want = store.desired(job)
        final = {"state": "stopped" if want["stop"] else "interrupted"}
        final.update(_checkpoint_note(driver, None, want["stop"]))
        if not want["stop"]:
            final["error"] = f"the driver was terminated ({error or 'interrupt'}) without a stop request"
        log.info("job %s %s (%s): %s", job, final["state"], error or "interrupt", final["note"])
    else:
        final = {"state": "failed", "error": error_text(error) if error is not None else "unknown"}
        if isinstance(error, GiveUp):  # a resumption after the fix starts from the latest checkpoint
            final.update(_checkpoint_note(driver, None, False, failed=True))
        log.info("job %s failed: %s", job, final["error"])
    return final


def _raise_stop(signum, frame):
    raise _Stop(f"signal {signum}")


RAY_CONNECT_GRACE_S = 10.0
"""How long ray.init may still block after the job's stop was requested or its Redis went away."""


def _connect_ray(store: JobStore, job: str) -> None:
    """ray.init, watched. While the Ray cluster it dials goes away (a cluster down racing the driver's
    start), Ray's GCS client blocks in C++, where no Python signal handler runs, SIGTERM's included: the
    driver would outlive its cluster. A watchdog thread ends the process if ray.init has not returned
    RAY_CONNECT_GRACE_S after a stop was requested or the cluster's Redis went away; the control API marks
    the job from Ray's state (`_reconcile`)."""
    import ray

    connected = threading.Event()

    def watch() -> None:
        since = None
        while not connected.wait(1.0):
            try:
                why = "its stop was requested" if store.desired(job)["stop"] else None
            except redis.RedisError as e:
                why = f"the cluster's Redis is gone ({e})"
            since = (since or time.monotonic()) if why else None
            if (
                since is not None
                and time.monotonic() - since >= RAY_CONNECT_GRACE_S
                and not connected.is_set()
            ):
                log.error(
                    "job %s: %s and Ray has not answered for %.0f s since: the driver exits",
                    job, why, RAY_CONNECT_GRACE_S,
                )  # fmt: skip
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(1)

    threading.Thread(target=watch, name="ray-connect-watch", daemon=True).start()
    try:
        # The Ray job's runtime env (PYTHONPATH, HF_HUB_OFFLINE: slipstream/cluster/control.py) reaches
        # every actor.
        ray.init(
            address="auto", namespace=f"slipstream-{job}", log_to_driver=True, logging_level=logging.WARNING
        )
    finally:
        connected.set()


def main(argv: list[str] | None = None) -> int:
    from slipstream.cluster import state as cluster_state

    p = argparse.ArgumentParser(prog="python -m slipstream.job.driver", description=__doc__.splitlines()[0])
    p.add_argument("--home", required=True, help="the cluster's state directory")
    p.add_argument("--job", required=True)
    p.add_argument("--submission", help="the Ray submission id it runs as (default: the job's current)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The job's own Redis user (its keys only), not the control plane's: cluster_state.job_redis_url.
    if why := check_name(args.job):
        print(f"slipstream.job.driver: job name {args.job!r}: {why}", file=sys.stderr)
        return 1
    try:
        redis_url = cluster_state.job_redis_url(args.home, args.job)
    except OSError as e:
        print(f"slipstream.job.driver: job {args.job!r} has no Redis credentials: {e}", file=sys.stderr)
        return 1
    store = JobStore(connect(redis_url))
    lease = RunLease(store.r, args.job, args.submission)
    try:  # before any of the job's keys is read or written: one driver per job name, ever
        store.update_status(args.job, driver=lease.take())
    except (LeaseRefused, redis.RedisError) as e:
        print(f"slipstream.job.driver: {e}", file=sys.stderr)
        return 1
    lease.keep(on_lost=exit_now)
    try:
        return _main(args, store, redis_url, lease)
    finally:
        lease.release()


def _main(args: argparse.Namespace, store: JobStore, redis_url: str, lease: RunLease) -> int:
    try:
        spec = load_job_spec(store, args.job)
    except jobspec.JobSpecError as e:  # never run a job on defaults: fail it, loudly
        print(f"slipstream.job.driver: {e}", file=sys.stderr)
        try:
            if store.status(args.job):
                store.update_status(args.job, state="failed", error=str(e))
        except redis.RedisError as re_:
            print(f"slipstream.job.driver: could not mark the job failed: {re_}", file=sys.stderr)
        return 1
    out = Path(spec.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)
    fh = logging.FileHandler(out / "logs" / "driver.log")
    fh.setFormatter(PlainFormatter(fmt))  # no colours or progress-bar redraws in the file
    logging.getLogger().addHandler(fh)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if (want := store.desired(args.job))["stop"]:  # a stop (or cluster down) came between submit and here
        resume = resume_fields(msgspec.json.decode(store.spec_json(args.job)))
        store.update_status(args.job, state="stopped", phase=None, pools=NO_POOLS, **resume)
        log.info(
            "job %s stopped before its driver started (%s): %s",
            args.job, want.get("stop_reason") or "stop requested", resume["note"],
        )  # fmt: skip
        return 0
    import ray

    _connect_ray(store, args.job)
    signal.signal(signal.SIGTERM, _raise_stop)
    driver = JobDriver(spec, redis_url, store)
    try:  # restarts by kind and error class, tracking writes: scraped as replica `driver`
        from slipstream.job.actors import serve_metrics

        serve_metrics(redis_url, args.job, "driver")
    except (OSError, redis.RedisError) as e:  # metrics never fail the job
        log.warning("the driver's metrics are not served: %s", e)
    log.info("job %s: driver pid %d, output in %s", args.job, os.getpid(), out)
    code, final = 0, {}
    try:
        result = driver.run()
        final = final_status(driver, result)
    except (_Stop, KeyboardInterrupt) as e:
        final = final_status(driver, error=e)
    except GiveUp as e:  # its message is the cause and the fix: no traceback to read
        final = final_status(driver, error=e)
        code = 1
    except Exception as e:
        log.exception("job %s failed", args.job)
        final = final_status(driver, error=e)
        code = 1
    finally:
        driver.close()  # the final state is reported once every actor is gone
        from slipstream.job.report import write_report_logged

        # PNG plots (the steps' and the evaluations'); logs and swallows any failure
        write_report_logged(driver.records + driver.progress.evals, out)
        lease.release()  # before the final state: once the job shows ended, its name is free
        driver.report(phase=None, **(final or {"state": "failed", "error": "the driver was interrupted"}))
        ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
