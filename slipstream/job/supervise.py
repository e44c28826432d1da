"""What the job's pools share to supervise their Ray actors: the restart budget, how a finished call
ended and the class of its error, a kill that tolerates the dead, and a wait that keeps the caller's
progress flowing.

The budget (the job spec's `supervision`): at most `max_restarts` replacements of one kind, whatever the
cause; and a failure of a deterministic class (out of memory, disk full) that repeats with no version
trained past the previous one fails the job after `out_of_memory_restarts` / `disk_full_restarts`
restarts, with the cause and the keys to change in its error. Restarting a trainer that runs out of
memory on a batch only hands it the same uncommitted batch again: without this a job loops on restarts
for as long as anyone lets it, each one losing the steps since its last checkpoint.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
from prometheus_client import Counter, Gauge

from jobspec.supervision import SupervisionSpec

if TYPE_CHECKING:
    from jobspec import JobSpec

log = logging.getLogger("slipstream.job.supervise")

STOP_TIMEOUT_S = 30.0
"""How long actors told to stop get before they are killed."""
POLL_S = 0.5
"""How often a waiting pool lets its caller read progress (and the driver reads desired state)."""
MAX_RESTARTS = SupervisionSpec().max_restarts
"""Replacements of one kind a job survives by default (`supervision.max_restarts`)."""

OUT_OF_MEMORY, DISK_FULL, OTHER = "out_of_memory", "disk_full", "other"
ErrorClass = Literal["out_of_memory", "disk_full", "other"]
"""What a failure was, as far as what to do about it goes: out of memory and disk full happen again on a
restart (the same batch, the same disk), `other` (a killed process, a lost node, a bug) may not."""

_OOM_MARKERS = (
    "CUDA out of memory",
    "OutOfMemoryError",
    "CUDA error: out of memory",
    "can't allocate memory",  # torch's CPU allocator
    "running low on memory",  # Ray's memory monitor killed the process
    "MemoryPlanError",  # the trainer's memory plan: the longest sample cannot fit (trainer/memory.py)
)
_DISK_MARKERS = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_QUOTED_PATH = re.compile(r"'(/[^']+)'|(?:checkpoint|writing) (/\S+)")

RESTARTS = Counter(
    "slipstream_job_restarts_total",
    "Processes the job driver replaced after a failure, by kind (trainer_pool, engines, rollout_workers) "
    "and error class (out_of_memory, disk_full, other)",
    ["kind", "error_class"],
)
DISK_FREE = Gauge(
    "slipstream_job_disk_free_bytes",
    "Free bytes on the disk of the job's output and checkpoint directories (job driver, every poll), by dir "
    "(output, checkpoints)",
    ["dir"],
)


ENGINES = Gauge(
    "slipstream_job_engines",
    "The job's launched engines by state (job driver, every poll): running (started, taking traffic or "
    "joining), starting (added by a scale up or replacing a lost one, not started yet) and waiting (of "
    "those starting, the ones Ray has not placed for lack of room: status `waiting`)",
    ["state"],
)


def record_engines(running: int, starting: int, waiting: int) -> None:
    """slipstream_job_engines{state}: see ENGINES."""
    for state, n in (("running", running), ("starting", starting), ("waiting", waiting)):
        ENGINES.labels(state=state).set(n)


def record_disk_free(dirs: dict[str, Path]) -> None:
    """slipstream_job_disk_free_bytes{dir} for each of `dirs` (label -> path), as the driver's host sees
    it: a directory not made yet (checkpoints before the first) counts the disk of its nearest existing
    parent, where it will be made. One that cannot be read keeps its last value: a metric never fails a job."""
    for label, d in dirs.items():
        for p in (d, *d.parents):
            try:
                if p.exists():
                    DISK_FREE.labels(dir=label).set(shutil.disk_usage(p).free)
                    break
            except OSError as e:
                log.debug("free space of %s: %s", p, e)
                break


class Failure(msgspec.Struct, kw_only=True):
    """The newest failure the job's supervision handled: the status' `failure` while the job runs, and the
    failure that ended it."""

    kind: str
    """What was replaced: `trainer_pool`, `engines` or `rollout_workers` (the keys of `restarts`)."""
    who: str
    """The process, in words: `trainer rank 0`, `engine http://...`, `rollout worker`."""
    error_class: ErrorClass
    cause: str
    """The error's own line (`CUDA out of memory. Tried to allocate ...`), at most 300 characters."""
    times: int
    """Failures of this class in a row for this kind, this one included, with no version trained past the
    version the first of them happened at."""
    version: int
    """The job's weight version when it failed."""
    at: float
    """Unix time of the failure."""
    restarts: int
    """Replacements of this kind so far (this one included when it was restarted)."""
    action: str
    """`restarted`, or `failed the job`; an engine's `restarted; ...` goes on to say that its replacement waits
    for a node with room, and then after how long it started."""
    fix: str = ""
    """The spec keys to change (deterministic classes), or ""."""
    budget: int | None = None
    """Restarts a repeat of this class is allowed (`supervision.out_of_memory_restarts`,
    `disk_full_restarts`); None = only `max_restarts` bounds it (class `other`)."""
    resumed_at: int | None = None
    """The trainer pool: the version its replacement resumed at (its latest checkpoint); None = not
    restarted, or from the initial model."""


class GiveUp(RuntimeError):
    """A failure the job does not survive; the message is the job's error, one line that names the cause
    and the setting to change."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


def _chain(error: BaseException):
    """`error`, the actor's own exception behind a Ray error (`.cause`), and what it was raised from."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]


def classify(error: BaseException | str | None) -> tuple[ErrorClass, str]:
    """(error class, the error's own line) of a failure: an exception (Ray's, whose `.cause` is the
    actor's own) or its text. The type and errno decide where there is an exception; the text's markers
    otherwise (a process killed outright leaves only words)."""
    if error is None:
        return OTHER, ""
    if isinstance(error, BaseException):
        for e in _chain(error):
            if isinstance(getattr(e, "cause", None), BaseException):
                continue  # a Ray error of the actor's own exception (its class too): that one decides
            # torch's and Ray's; the trainer's memory plan refusing what cannot fit
            if any(c.__name__ in ("OutOfMemoryError", "MemoryPlanError") for c in type(e).__mro__):
                return OUT_OF_MEMORY, (_lines(str(e)) or [type(e).__name__])[0][:300]
            if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
                return DISK_FULL, str(e)[:300]
        text = str(error)
    else:
        text = error
    lines = _lines(text)
    for markers, cls in ((_DISK_MARKERS, DISK_FULL), (_OOM_MARKERS, OUT_OF_MEMORY)):
        for line in reversed(lines):  # a traceback ends in the error
            if any(m in line for m in markers):
                return cls, _after_type(line)[:300]
    return OTHER, (lines[-1] if lines else "")[:300]


def _after_type(line: str) -> str:
    """`torch.OutOfMemoryError: CUDA out of memory ...` -> `CUDA out of memory ...`."""
    head, sep, rest = line.partition(": ")
    return rest if sep and re.fullmatch(r"[\w.]+(Error|Exception)", head) else line


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def free_space(cause: str) -> str:
    """`<free> free of <total> at <path>` for the path in a disk-full error, where it is on this machine
    (the driver's); "" when the error names none or it is elsewhere."""
    if " free of " in cause:  # the trainer's checkpoint writer said it already, from its own node
        return ""
    m = _QUOTED_PATH.search(cause)
    if not m:
        return ""
    path = Path(m.group(1) or m.group(2))
    for p in (path, *path.parents):
        if p.exists():
            usage = shutil.disk_usage(p)
            return f"{_gib(usage.free)} free of {_gib(usage.total)} at {p}"
    return ""


def remedy(kind: str, error_class: str, cause: str, spec: JobSpec | None) -> str:
    """The spec keys that change the outcome of a deterministic failure, with their values now."""

    def now(value) -> str:
        return f" (now {value})" if spec is not None else ""

    if error_class == DISK_FULL:
        keep = spec.trainer.keep_checkpoints if spec is not None else None
        return (
            f"free disk space there, lower trainer.keep_checkpoints{now(keep)} or point "
            "trainer.checkpoint_dir at a larger disk"
        )
    if error_class != OUT_OF_MEMORY:
        return ""
    gpu = "CUDA" in cause or "GPU" in cause
    if kind == "trainer_pool":
        tr = spec.trainer if spec is not None else None
        tokens = tr and (
            tr.micro_batch_tokens or (8192 if tr.device == "cpu" else "planned from free memory")
        )
        keys = [f"lower trainer.micro_batch_tokens{now(tokens)}"]
        if tr is None or not tr.activation_checkpointing:
            keys.append("turn on trainer.activation_checkpointing")
        if tr is None or tr.logprob_chunk_tokens == 0 or tr.logprob_chunk_tokens > 1024:
            keys.append(f"lower trainer.logprob_chunk_tokens{now(tr and tr.logprob_chunk_tokens)}")
        if gpu and (tr is None or (tr.fsdp and not tr.offload_optimizer)):
            keys.append("turn on trainer.offload_optimizer")
        if not gpu and tr is not None and tr.offload_optimizer:
            keys.append("turn off trainer.offload_optimizer (it holds the optimizer state in host memory)")
        ranks = f"now {tr.num_trainers}; " if tr is not None else ""
        keys.append(f"or add ranks (trainer.num_trainers, {ranks}FSDP shards weights and optimizer state)")
        return ", ".join(keys)
    if kind == "engines":
        g = spec.generators if spec is not None else None
        if g is not None and g.engine == "sglang":
            return "lower generators.sglang.mem_fraction_static or raise generators.sglang.tp_size"
        return (
            f"lower generators.max_batch_size{now(g and g.max_batch_size)} or generators.mem_fraction_static"
        )
    if kind == "rollout_workers":
        return f"lower rollout.concurrency{now(spec and spec.rollout.concurrency)}"
    return ""


def _what(error_class: str, cause: str) -> str:
    if error_class == OUT_OF_MEMORY:
        return "ran out of GPU memory" if "CUDA" in cause or "GPU" in cause else "ran out of memory"
    if error_class == DISK_FULL:
        return "found its disk full"
    return "failed"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


class Restarts(dict):
    """Replacements so far, by kind: {"rollout_workers", "engines", "trainer_pool"}; shared by the pools
    of one job and reported in its status, with the newest failure (`latest`). `spec`: its `supervision`
    is the budget and its values go into the advice; `version()`: the job's weight version now (a repeat
    is a failure with no version trained past the previous one); `on_failure` is called with each failure
    as soon as it is counted (the driver puts it in the status before a restart that takes a while)."""

    def __init__(
        self,
        spec: JobSpec | None = None,
        version: Callable[[], int] = lambda: 0,
        on_failure: Callable[[Failure], None] | None = None,
    ) -> None:
        super().__init__(rollout_workers=0, engines=0, trainer_pool=0)
        self.spec, self.version, self.on_failure = spec, version, on_failure
        self.policy = spec.supervision if spec is not None else SupervisionSpec()
        self.latest: Failure | None = None
        self._streak: dict[str, tuple[str, int, int]] = {}
        """kind -> (error class, failures in a row, highest version any of them happened at)."""

    def count(
        self, kind: str, why: str = "", error: BaseException | str | None = None, who: str = ""
    ) -> Failure:
        """One more replacement of `kind` after `who` failed with `error` (an exception or its text;
        `why` when None). Returns the failure (now `latest`); GiveUp, with the cause and what to change,
        when the budget is spent: a deterministic class repeated past its restarts, or past
        max_restarts of the kind."""
        who = who or kind
        cls, cause = classify(error if error is not None else why)
        version = self.version()
        prev = self._streak.get(kind)
        if prev is not None and prev[0] == cls and version <= prev[2]:
            times, high = prev[1] + 1, prev[2]
        else:
            times, high = 1, version
        self._streak[kind] = (cls, times, high)
        budget = {
            OUT_OF_MEMORY: ("supervision.out_of_memory_restarts", self.policy.out_of_memory_restarts),
            DISK_FULL: ("supervision.disk_full_restarts", self.policy.disk_full_restarts),
        }.get(cls)
        failure = Failure(
            kind=kind,
            who=who,
            error_class=cls,
            cause=cause,
            times=times,
            version=version,
            at=time.time(),
            restarts=self[kind],
            action="failed the job",
            fix=remedy(kind, cls, cause, self.spec),
            budget=budget[1] if budget is not None else None,
        )
        self.latest = failure
        if budget is not None and times > budget[1]:
            where = free_space(cause) if cls == DISK_FULL else ""
            spent = (
                "at once" if budget[1] == 0 else f"after {budget[1]} restart{'s' if budget[1] > 1 else ''}"
            )
            message = (
                f"{who} {_what(cls, cause)}{'' if times == 1 else ' ' + _times(times)} ({cause}"
                f"{'; ' + where if where else ''}): {failure.fix}. The job failed {spent} "
                f"({budget[0]}: {budget[1]})"
            )
            log.error("%s: %s", kind, message)
            self.report(failure)
            raise GiveUp(message, failure)
        if self[kind] + 1 > self.policy.max_restarts:
            message = (
                f"{kind}: more than {self.policy.max_restarts} replacements (supervision.max_restarts); "
                f"giving up. The last one: {who} {why or cause}"
                + (f" ({cls.replace('_', ' ')}: {failure.fix})" if failure.fix else "")
            )
            log.error("%s", message)
            self.report(failure)
            raise GiveUp(message, failure)
        self[kind] += 1
        failure.restarts, failure.action = self[kind], "restarted"
        RESTARTS.labels(kind, cls).inc()
        left = f", {budget[1] - times + 1} more allowed ({budget[0]})" if budget is not None else ""
        log.warning(
            "%s: %s %s%s (%s); restarting it: restart %d of at most %d%s",
            kind,
            who,
            _what(cls, cause),
            "" if times == 1 else f" {_times(times)} in a row",
            cause or why,
            self[kind],
            self.policy.max_restarts,
            left,
        )
        self.report(failure)
        return failure

    def report(self, failure: Failure) -> None:
        """Hand `failure` (new, or with a new `action`) to `on_failure`: the status."""
        if self.on_failure is not None:
            self.on_failure(failure)


def waiting_for_room(g, waited_s: float, running: int, scaled: bool = False) -> str:
    """The `failure.action` of an engine whose replacement has waited `waited_s` for Ray to place it
    (`g`: the spec's generators), with what it needs, what the cluster has free, and the `running` engines
    the job goes on with; `scaled`: the status' note on an engine a scale up added instead."""
    import ray

    needs = {"CPU": g.cpus_per_engine, "GPU": g.gpus_per_engine, **g.resources}
    needs = {k: v for k, v in needs.items() if v}
    free = {k: round(ray.available_resources().get(k, 0), 2) for k in needs}
    what = "added by a scale up; it" if scaled else "restarted; the replacement"
    return (
        f"{what} has not started after {waited_s:.0f} s, waiting for a node with room "
        f"(it needs {needs or 'nothing'}, the cluster has {free or 'nothing'} free): Ray starts it when "
        f"one joins, and the job goes on with {running} engines"
        + ("; a scale down cancels it first" if scaled else "")
    )


def error_of(ref) -> BaseException | None:
    """The exception a finished Ray call raised (None if it returned)."""
    import ray

    try:
        ray.get(ref)
    except Exception as e:  # RayActorError (killed, OOM), or the actor's own exception
        return e
    return None


def wait_all(refs: list, timeout_s: float | None = None, between: Callable[[], None] | None = None) -> list:
    """ray.wait for all of `refs` (at most timeout_s), calling `between` every POLL_S meanwhile (the
    driver reads progress there: the trainer trains on while engines start or stop)."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=left)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            return done
        if between is not None:
            between()


def died(e: BaseException) -> str:
    """A Ray call's failure in a few words: its type, first line and (a task error's traceback ends in
    it) last line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [""]
    cause = f" ... {lines[-1][:300]}" if len(lines) > 1 else ""
    return f"died: {type(e).__name__}: {lines[0][:200]}{cause}"


def outcome(ref, failed_only: bool = False) -> str | None:
    """How a finished Ray call ended, in a few words (None with failed_only when it returned)."""
    import ray

    try:
        value = ray.get(ref)
    except Exception as e:  # RayActorError (killed, OOM), or the actor's own exception
        return died(e)
    return None if failed_only else f"exited ({value})"


def kill(actor) -> None:
    """ray.kill, for an actor that may be gone already."""
    import ray

    try:
        ray.kill(actor)
    except Exception as e:  # already gone
        log.debug("ray.kill: %s", e)
