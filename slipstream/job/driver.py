"""The job driver: runs one job on Ray (a submitted job's, through slipstream/cluster/job_entry.py, which
`slipstream submit` starts as a Ray job; `slipstream run`'s, in process). Its loop reads what the
user wants, as the control API recorded it in Redis (slipstream/job/store.py), reconciles the
job's two pools with it, and reports the job's state and progress (and its last evaluation) there for
`slipstream status`:

- generators N: the generator pool (slipstream/job/generators.py) adds or removes engines and their
  rollout workers while training goes on; added engines start in the background (the loop goes on while
  Ray finds room for them), each joining once started;
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

import logging
import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis
from msgspec import UNSET

from jobspec import JobSpec
from jobspec.spec import check_context
from model_zoo.prepare import prepare_model
from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from replay_buffer.stream import full_error, is_oom, memory
from slipstream.job import model_files
from slipstream.job.generators import GeneratorPool
from slipstream.job.placement import colocation
from slipstream.job.prepare import RUN_FILES
from slipstream.job.progress import STATUS_FIELDS, ProgressReader, format_eval
from slipstream.job.records import Desired
from slipstream.job.store import JobStore, job_checkpoint_dir, resume_version
from slipstream.job.supervise import POLL_S, GiveUp, Restarts, record_disk_free, record_engines
from slipstream.job.tracking import Tracker
from slipstream.job.trainers import TrainerPool
from trainer.result import TrainerResult
from weight_bus.registry import EngineRegistry

log = logging.getLogger("slipstream.job.driver")


class Stop(Exception):
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
        serve_metrics: bool = False,
    ) -> None:
        """`serve_metrics`: serve this process's Prometheus registry (restarts, disk, engines) as the
        job's replica `driver` once the run has begun (a new run deletes the previous run's targets)."""
        self.spec, self.redis_url, self.store = spec, redis_url, store
        self.on_progress = on_progress
        self.serve_metrics = serve_metrics
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
        self._scaling = False  # the status says `scaling` until the engines a scale up added started
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
    def run(self) -> TrainerResult:
        """Start the pools, then reconcile them with the desired state until the trainer is done; the
        trainer pool's result. A failure past the restart budget raises GiveUp, reported first."""
        try:
            return self._run()
        except GiveUp as e:
            # over, but its processes are not gone yet: `stopping` keeps the name taken until `failed`
            log.error("job %s failed: %s", self.job, e)
            self.report("stopping", phase="failed; stopping every process", error=str(e))
            raise
        except redis.RedisError as e:
            # e.g. the command poll's pipeline at maxmemory: the documented "Redis is full" error, with
            # the memory used and the fix, rather than redis-py's bare OutOfMemoryError
            if is_oom(e):
                raise full_error(e, self.job, memory(self.r), "record its state or read its commands") from e
            raise

    def _run(self) -> TrainerResult:
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
                if self._scaling and not stopping and not self.generators.starting:
                    self._scaled()  # the engines a scale up added joined
            self.generators.check_evaluator()
            self.read_progress(block_ms=int(POLL_S * 1000))
            record_disk_free(
                {"output": Path(self.spec.output_dir), "checkpoints": job_checkpoint_dir(self.spec)}
            )
            record_engines(*self.generators.engine_states)
            want = self.store.desired(self.job)
            if want.stop and (not stopping or (want.stop_checkpoint and not stop_checkpoint)):
                self.stop(want, again=stopping)
                stopping, stop_checkpoint = True, want.stop_checkpoint
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
        self.version = result.version
        if self.generators.evaluator is not None:
            # the engines hold the final policy (the trainer publishes its last version): score it
            self.report(phase=f"evaluating the final version {self.version}")
            self.generators.evaluate_now()
            self.read_progress(block_ms=0)
        return result

    def start(self, desired: Desired) -> None:
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
        model_files.publish(self.r, self.job, self.spec.model.path)  # for nodes without the model
        self.buffer.ensure_group()
        if self.r.get(self.buffer.keys.version) is None:
            self.buffer.set_version(0)
        n = self.spec.generators.num_engines if desired.generators is UNSET else desired.generators
        m = self.spec.trainer.num_trainers if desired.trainers is UNSET else desired.trainers
        self.trainers.spawn(m)  # the ranks' processes start beside the engines; set up once those are up
        self.report(phase=f"starting {n} generator(s) and their rollout workers")
        self.generators.start(n)
        self.generators.start_evaluator()
        if self.generators.evaluator is not None and self.r.get(self.buffer.keys.version) in (b"0", "0"):
            if EngineRegistry(self.r, self.job).live():
                # version 0 before the first step: the engines keep it until the trainer's first publish,
                # so the trainer starts after this evaluation (rollouts fill the buffer meanwhile)
                self.report(phase="evaluating version 0 before the first step")
                self.generators.evaluate_now()
            else:  # every engine waits for the trainer's weights (started on nodes without the model)
                log.info("job %s: no engine holds version 0's weights yet: it is not evaluated", self.job)
        self.report(phase=f"starting {m} trainer rank(s)")
        self.trainers.start(m)
        self.report("running", phase=None)

    def stop(self, want: Desired, again: bool) -> None:
        """A stop request (`again`: a checkpoint is asked for after the stop began)."""
        if again:
            log.info("stop: a checkpoint is asked for now (it is written where the trainer stops)")
            self.trainers.stop(checkpoint=True)
            return
        log.info(
            "stop requested%s: the trainer ends after its current step, %s",
            f" ({want.stop_reason})" if want.stop_reason else "",
            "with a checkpoint there" if want.stop_checkpoint else "writing no checkpoint",
        )
        self.report("stopping", phase="the trainer ends after its current step")
        self.trainers.stop(checkpoint=want.stop_checkpoint)

    def reconcile(self, want: Desired) -> TrainerResult | None:
        """Pool sizes brought to the desired ones. Returns the trainer pool's result if it finished the
        job before a rescale could stop it."""
        n, m = self.generators.target, len(self.trainers.ranks)  # engines not started yet count
        if self.placement is not None:
            self._refuse_colocated_scale(want, n, m)
            return None
        if self.generators.scalable and want.generators not in (UNSET, n):
            self.report("scaling", scaling=f"generators {n} -> {want.generators}")
            self.generators.scale(want.generators)
            self._scaled()
        if want.trainers not in (UNSET, m):
            self.report("scaling", scaling=f"trainers {m} -> {want.trainers}")
            if (ended := self.trainers.rescale(want.trainers)) is not None:
                return ended
            self._scaled()
        return None

    def _scaled(self) -> None:
        """The status after a rescale: `running`, or `scaling` while engines a scale up added still start
        in the background (the loop goes on meanwhile; `waiting` says what those Ray cannot place need)."""
        g = self.generators
        self._scaling = bool(g.starting)
        if self._scaling:
            scaling = f"generators {g.size} -> {g.target}: {g.starting} engine(s) starting"
            self.report("scaling", scaling=scaling)
        else:
            self.report("running", scaling=None)

    def _refuse_colocated_scale(self, want: Desired, n: int, m: int) -> None:
        """A colocated job keeps one engine per trainer rank's device: a scale request is reported in the
        status and logged once, and nothing changes."""
        asked = (
            n if want.generators is UNSET else want.generators,
            m if want.trainers is UNSET else want.trainers,
        )
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
        if self.serve_metrics:  # after begin_run: a new run deletes the previous run's metrics targets
            from slipstream.job.actors import serve_metrics

            try:
                serve_metrics(self.redis_url, self.job, "driver")
            except (OSError, redis.RedisError) as e:  # metrics never fail the job
                log.warning("the driver's metrics are not served: %s", e)
        self.progress.attempt = self.run_info["attempt"]
        self.trainers.run_id = self.run_info["run_id"]
        if self.run_info["attempt"] == 1:
            for name in RUN_FILES:
                (Path(self.spec.output_dir) / name).unlink(missing_ok=True)
            ckpts = job_checkpoint_dir(self.spec)
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
        # the engines gauge first: a reader who sees the status (a waiting note, a starting engine) finds
        # the gauge saying the same (it is also set every poll)
        record_engines(*self.generators.engine_states)
        fields = {
            **self.run_info,
            "version": self.version,
            "total_steps": self.spec.algorithm.total_steps,
            "pools": {
                "generators": self.generators.size,
                "rollout_workers": len(self.generators.workers),
                "trainers": self.trainers.size,  # ranks set up and training (not those still starting)
            },
            "restarts": dict(self.restarts),
            **({"failure": msgspec.to_builtins(self.restarts.latest)} if self.restarts.latest else {}),
            # engines no node has room for yet: replacements, whatever failed since (old URL -> what it
            # waits on), and those a scale up added (engine-N -> the same)
            "waiting": self.generators.waiting_notes,
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


def _checkpoint_note(
    driver: JobDriver, result: TrainerResult | None, stopped: bool, failed: bool = False
) -> dict:
    """The job's final status fields on its checkpoint: `checkpoint` (path, "" if none),
    `checkpoint_version`, and `note`, one line on what a resumption starts from (`failed`: the job
    failed, no stop wrote one)."""
    from slipstream.job.store import latest_checkpoint

    if result is not None and result.checkpoint:
        ck = {"path": result.checkpoint, "version": result.checkpoint_version}
        note = f"checkpoint at version {ck['version']}: {ck['path']}"
    else:
        ck = latest_checkpoint(job_checkpoint_dir(driver.spec))
        if result is not None and stopped and result.version > 0:
            why = "no checkpoint written at the stop (stop --no-checkpoint)"
        elif result is not None:
            why = (
                "no checkpoint written (trainer.checkpoint_every is 0)"
                if result.version
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


def _signal_in(error: BaseException | None) -> BaseException | None:
    """The Stop or KeyboardInterrupt behind `error`, when a signal is what it came from (SIGTERM inside
    Ray's C++ code surfaces as a SystemError whose context is the Stop its handler raised); else `error`."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        if isinstance(e, (Stop, KeyboardInterrupt)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return error


def final_status(
    driver: JobDriver, result: TrainerResult | None = None, error: BaseException | None = None
) -> dict:
    """The job's final status fields, logged: succeeded or stopped (the trainer's `result`), stopped or
    interrupted (a signal: `error` is Stop or KeyboardInterrupt), or failed (`error`, in one line), each
    with what a resumption starts from."""
    job, store = driver.job, driver.store
    if result is not None:
        stopped = store.desired(job).stop
        final = {"state": "stopped" if stopped else "succeeded", "final_model": result.final_model}
        final.update(_checkpoint_note(driver, result, stopped))
        log.info("job %s %s at version %d: %s", job, final["state"], result.version, final["note"])
    elif isinstance(error := _signal_in(error), (Stop, KeyboardInterrupt)):
        want = store.desired(job)
        final = {"state": "stopped" if want.stop else "interrupted"}
        final.update(_checkpoint_note(driver, None, want.stop))
        if not want.stop:
            final["error"] = f"the driver was terminated ({error or 'interrupt'}) without a stop request"
        log.info("job %s %s (%s): %s", job, final["state"], error or "interrupt", final["note"])
    else:
        final = {"state": "failed", "error": error_text(error) if error is not None else "unknown"}
        if isinstance(error, GiveUp):  # a resumption after the fix starts from the latest checkpoint
            final.update(_checkpoint_note(driver, None, False, failed=True))
        log.info("job %s failed: %s", job, final["error"])
    return final
