"""Experiment tracking: a job's per-step metrics (its trainer progress records, `train/*`), its evaluations
(the evaluator's `kind: "eval"` records in the same stream, `eval/*`), any other scalars keyed by version
(`Tracker.log_scalars`) and its resolved spec, written to TensorBoard event files
(`<output_dir>/tensorboard/`) and to W&B (`<output_dir>/wandb/`, offline by default), as the spec's
`tracking` section says.

The job driver (slipstream/job/driver.py) owns one Tracker, so `slipstream run` and submitted cluster jobs
track alike. Writing happens on the tracker's own thread behind a bounded queue: the driver's loop never
waits on a writer, and a writer's failure never fails the job (its first error is logged, every error is
counted: `slipstream_tracking_errors_total{backend}` and the job status' `tracking` field).

Steps are the policy versions. A version is written once per run, across trainer restarts and resumed
attempts: the run's high-water mark is kept in `<output_dir>/tracking.json`; records an earlier
attempt already wrote are skipped when a resumed attempt reads them again, and a version trained again after
the trainer resumed from an older checkpoint is rewritten with TensorBoard's purge_step (events at or after
it from before are discarded, evaluations' too). W&B cannot rewrite history: there the first write of a
version stays. Evaluations keep their own high-water mark (`eval_version`), as they trail the steps.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import re
import shutil
import threading
import time
from pathlib import Path

import msgspec
from prometheus_client import Counter

from jobspec import JobSpec, to_json
from slipstream.job.progress import is_eval

log = logging.getLogger("slipstream.job.tracking")

TB_DIR = "tensorboard"
WANDB_DIR = "wandb"
STATE_FILE = "tracking.json"
"""In the output_dir: {run_id, version (highest step written), eval_version (highest evaluation written),
wandb_id, config (written)}."""
QUEUE_MAX = 10_000
"""Writes waiting for the tracker's thread; beyond it a write is dropped (and counted), never waited for."""
PROGRESS_PREFIX = "train"
"""Tag namespace of the trainer's progress records (`train/reward_mean`)."""
EVAL_PREFIX = "eval"
"""Tag namespace of the evaluator's records' scores (`eval/accuracy`, `eval/pass@4`)."""
_NOT_SCALARS = ("step", "version", "attempt")
"""Record keys that are the x-axis or identity, not metrics."""

WRITES = Counter("slipstream_tracking_writes_total", "Steps of scalars written by a tracking backend",
                 ["backend"])  # fmt: skip
ERRORS = Counter(
    "slipstream_tracking_errors_total",
    "Tracking writes that failed or were dropped (the job goes on; the first error is logged)",
    ["backend"],
)


def scalars_of(record: dict) -> dict[str, float]:
    """The finite numeric values of a record (bools as 0/1), minus its identity keys."""
    out = {}
    for k, v in record.items():
        if k in _NOT_SCALARS or not isinstance(v, int | float):
            continue
        v = float(v)
        if math.isfinite(v):
            out[k] = v
    return out


def flat_config(spec: JobSpec) -> dict[str, int | float | str | bool]:
    """The resolved spec as dotted keys with scalar values (TensorBoard's hparams take no nesting or
    lists): null is "null", a list is its JSON text."""
    out: dict[str, int | float | str | bool] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        elif v is None:
            out[prefix] = "null"
        elif isinstance(v, bool | int | float | str):
            out[prefix] = v
        else:
            out[prefix] = json.dumps(v)

    walk("", msgspec.to_builtins(spec))
    return out


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self.writer = None
        self.fresh = fresh
        """No earlier process wrote this run's events here: nothing to purge when the writer opens."""
        self.started = False
        """This process wrote a progress step (the first one decides the purge)."""
        self.pending_config: JobSpec | None = None
        """The spec, held until the first step's writer opens (with its purge_step) when not fresh."""

    def _open(self, purge_step: int | None) -> None:
        from slipstream.job.tb_events import EventFile

        if self.writer is not None:
            self.writer.close()
        self._wait_for_a_later_second()
        self.writer = EventFile(str(self.path), purge_step=purge_step, flush_secs=10)

    def _wait_for_a_later_second(self) -> None:
        """TensorBoard reads a run's event files in name order, and a name is `events.out.tfevents.<second>.
        <host>.<pid>.<n>` with n a per-process counter: two files of one second sort by n as text (10 before
        9), so a purge writer's file could be read before the events it discards. The new file takes a
        second later than every file already here (a wait of at most one second, only after a restart; a
        file dated ahead of this host's clock, copied from another host, is not waited for)."""
        seconds = [p.name.split(".")[3] for p in self.path.glob("events.out.tfevents.*")]
        latest = max((int(s) for s in seconds if s.isdigit()), default=0)
        deadline = time.monotonic() + 1.5
        while time.time() < latest + 1 and time.monotonic() < deadline:
            time.sleep(0.05)

    def scalars(self, prefix: str, values: dict[str, float], step: int, rewrite: bool) -> None:
        if prefix == PROGRESS_PREFIX and (rewrite or not self.started):
            # a version trained again, or the first step of a process that follows another: events at or
            # after `step` from before are discarded by TensorBoard's readers
            self.started = True
            if rewrite or not self.fresh:
                self._open(step)
        if self.writer is None:
            self._open(None)
        if self.pending_config is not None:
            self._write_config(self.pending_config)
            self.pending_config = None
        for k, v in values.items():
            self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def config(self, spec: JobSpec) -> None:
        if self.writer is None and not self.fresh:
            self.pending_config = spec  # the first step opens the writer with its purge_step
            return
        if self.writer is None:
            self._open(None)
        self._write_config(spec)

    def _write_config(self, spec: JobSpec) -> None:
        self.writer.add_text("config/spec", "```\n" + to_json(spec) + "\n```")
        self.writer.add_hparams(flat_config(spec))

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.pending_config is not None:  # no step came: the config still goes in
            self._open(None)
            self._write_config(self.pending_config)
            self.pending_config = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _Wandb:
    name = "wandb"

    def __init__(self, spec: JobSpec, wandb_id: str, resume: bool) -> None:
        import wandb  # ImportError: the caller reports it once

        w = spec.tracking.wandb
        self.path = Path(spec.output_dir) / WANDB_DIR
        self.path.mkdir(parents=True, exist_ok=True)
        self.last_step = -1
        self.axes: set[str] = set()
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            name=w.run_name or spec.name,
            id=wandb_id,
            resume="allow" if resume else None,
            mode=w.mode,
            dir=str(Path(spec.output_dir)),  # wandb writes under <dir>/wandb/
            config=msgspec.to_builtins(spec),
            settings=wandb.Settings(console="off", silent=True, init_timeout=120),
            reinit="create_new",
        )

    def scalars(self, prefix: str, values: dict[str, float], step: int, rewrite: bool) -> None:
        row = {f"{prefix}/{k}": v for k, v in values.items()}
        if prefix != PROGRESS_PREFIX:
            # other scalars (eval) may come late: their own x-axis, `<prefix>/version`, not W&B's step
            if prefix not in self.axes:
                self.axes.add(prefix)
                self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/version")
            self.run.log({**row, f"{prefix}/version": step})
            return
        if step <= self.last_step:
            return  # W&B steps only grow: a version trained again keeps its first record there
        self.last_step = step
        self.run.log(row, step=step)

    def config(self, spec: JobSpec) -> None:
        pass  # given to wandb.init

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


_STOP = object()


class Tracker:
    """The job's tracking backends behind one queue and thread. `log_progress` takes every progress
    record the driver reads (of every attempt: it skips what an earlier attempt wrote), `log_scalars` any
    other dict of scalars at a version (eval), `log_config` the spec once per run; `close` flushes."""

    def __init__(self, spec: JobSpec, run_info: dict) -> None:
        self.spec = spec
        self.run_id = run_info.get("run_id")
        self.attempt = run_info.get("attempt", 1)
        self.out = Path(spec.output_dir)
        self.tb_dir = self.out / TB_DIR
        self.errors: dict[str, int] = {}
        self.writes: dict[str, int] = {}
        self._logged: set[str] = set()
        self._backends: list = []
        state = self._read_state()
        same_run = state.get("run_id") == self.run_id and self.run_id is not None
        self.written_upto = int(state.get("version", 0)) if same_run else 0
        """Highest version written in this run (by this process or an earlier attempt's driver)."""
        self.eval_written_upto = int(state.get("eval_version", -1)) if same_run else -1
        """Highest evaluated version written in this run (-1: none; version 0 is evaluated too)."""
        self._config_written = same_run and bool(state.get("config"))
        resume = spec.trainer.resume_from is not None
        self.wandb_id = (
            state["wandb_id"]
            if same_run and state.get("wandb_id")
            else re.sub(r"[^a-z0-9-]", "-", f"{spec.name}-{self.run_id or 'run'}".lower())[:64]
        )
        self._fresh_tb = not same_run and not resume
        if self._fresh_tb and self.tb_dir.exists():
            # a new run of the job: the previous run's curves would collide with its versions
            shutil.rmtree(self.tb_dir, ignore_errors=True)
            log.info("tracking: removed the previous run's %s", self.tb_dir)
        self._q: queue.Queue = queue.Queue(maxsize=QUEUE_MAX)
        self._thread = threading.Thread(target=self._work, name="tracking", daemon=True)
        self._thread.start()
        self._put(("open", same_run))

    # --- the driver's side (never blocks) ------------------------------------------------------------
    def log_progress(self, record: dict) -> None:
        """One record of the job's progress stream at its version: a trainer step's (`train/*`) or an
        evaluation's (`kind: "eval"`: its scores, `eval/*`)."""
        version = record.get("version")
        if not isinstance(version, int):
            return
        if is_eval(record):
            if record.get("attempt", self.attempt) < self.attempt and version <= self.eval_written_upto:
                return  # an earlier attempt's evaluation, already written by its driver
            self.eval_written_upto = max(self.eval_written_upto, version)
            self._put(("scalars", EVAL_PREFIX, scalars_of(record.get("eval") or {}), version, False))
            return
        if record.get("attempt", self.attempt) < self.attempt and version <= self.written_upto:
            return  # an earlier attempt's record, already written by its driver
        rewrite = version <= self.written_upto
        self.written_upto = version
        self._put(("scalars", PROGRESS_PREFIX, scalars_of(record), version, rewrite))

    def log_scalars(self, values: dict, version: int, prefix: str = EVAL_PREFIX) -> None:
        """Any scalars at a version, under `prefix/` (the evaluator's records go in through log_progress)."""
        self._put(("scalars", prefix, scalars_of(values), int(version), False))

    def log_config(self) -> None:
        """The resolved spec: as text and hparams in TensorBoard, as the run's config in W&B (once per run)."""
        if not self._config_written:
            self._config_written = True
            self._put(("config",))

    def status(self) -> dict:
        """For the job status: where each backend writes, versions written, errors."""
        return {
            "tensorboard": str(self.tb_dir) if self.spec.tracking.tensorboard else None,
            "wandb": str(self.out / WANDB_DIR) if self.spec.tracking.wandb.enabled else None,
            "version": self.written_upto,
            "writes": dict(self.writes),
            "errors": dict(self.errors),
        }

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush and close every backend (waits at most timeout_s for the thread)."""
        if not self._thread.is_alive():
            return
        try:
            self._q.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracking: the writers did not finish within %.0f s; their last steps may be missing",
                        timeout_s)  # fmt: skip

    def _put(self, item) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self._error("queue", RuntimeError(f"{QUEUE_MAX} writes waiting: a writer is stuck; dropped"))

    def _settle(self, how: str) -> None:
        """`flush` or `close` every writer, then record how far they got; errors are counted, not raised."""
        for b in self._backends:
            try:
                getattr(b, how)()
            except Exception as e:
                self._error(b.name, e)
        try:
            self._write_state()
        except OSError as e:
            self._error("state", e)

    def _error(self, backend: str, e: BaseException) -> None:
        self.errors[backend] = self.errors.get(backend, 0) + 1
        ERRORS.labels(backend).inc()
        if backend not in self._logged:
            self._logged.add(backend)
            log.warning("tracking: %s failed (logged once; the job goes on, errors are counted): %s: %s",
                        backend, type(e).__name__, e)  # fmt: skip

    # --- the tracker's thread ------------------------------------------------------------------------
    def _read_state(self) -> dict:
        try:
            return json.loads((self.out / STATE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self) -> None:
        state = {"run_id": self.run_id, "version": self._done_upto, "eval_version": self._eval_done_upto,
                 "wandb_id": self.wandb_id, "config": self._config_done}  # fmt: skip
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.out / STATE_FILE)

    def _open(self, same_run: bool) -> None:
        t = self.spec.tracking
        if t.tensorboard:
            try:
                self.tb_dir.mkdir(parents=True, exist_ok=True)
                self._backends.append(_TensorBoard(self.tb_dir, fresh=self._fresh_tb))
                log.info("tracking: TensorBoard event files in %s", self.tb_dir)
            except Exception as e:
                self._error("tensorboard", e)
        if t.wandb.enabled:
            try:
                resume = same_run or self.spec.trainer.resume_from is not None
                self._backends.append(_Wandb(self.spec, self.wandb_id, resume))
                log.info("tracking: W&B run %s (%s) in %s", self.wandb_id, t.wandb.mode, self.out / WANDB_DIR)
            except ImportError as e:
                self._error("wandb", RuntimeError(f"tracking.wandb.enabled but wandb is not installed ({e})"))
            except Exception as e:
                self._error("wandb", e)

    def _work(self) -> None:
        self._done_upto = self.written_upto
        self._eval_done_upto = self.eval_written_upto
        self._config_done = self._config_written
        while True:
            item = self._q.get()
            if item is _STOP:
                break
            if item[0] == "open":
                self._open(item[1])
                continue
            for b in list(self._backends):
                try:
                    if item[0] == "config":
                        b.config(self.spec)
                    else:
                        _, prefix, values, step, rewrite = item
                        b.scalars(prefix, values, step, rewrite)
                        self.writes[b.name] = self.writes.get(b.name, 0) + 1
                        WRITES.labels(b.name).inc()
                except Exception as e:
                    self._error(b.name, e)
            if item[0] == "config":
                self._config_done = True
            elif item[1] == PROGRESS_PREFIX:
                self._done_upto = item[3]
            elif item[1] == EVAL_PREFIX:
                self._eval_done_upto = max(self._eval_done_upto, item[3])
            if self._q.empty():  # a pause in the stream of writes: make them durable
                self._settle("flush")
        self._settle("close")
