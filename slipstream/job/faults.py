"""Fault injection into a running job's real processes, for the fault tests and the soak run
(benchmarks/soak.py): a job driver (slipstream/job/driver.py) in a thread of this process, over a local Ray
and a private Redis, and functions that kill -9 or hang (SIGSTOP) its rollout workers, engines and
trainer, each waiting until the driver replaced what it broke.

`books(job)` checks what every fault must leave intact: each group produced was trained, dropped as
stale or as from a future version, dead-lettered, skipped as a duplicate or is still in the stream, and no group_id was trained
twice (the ledger; the spec needs `buffer.ledger: true`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jobspec
from replay_buffer import JobKeys, ReplayBuffer
from replay_buffer.client import connect
from replay_buffer.redis_server import ManagedRedis
from slipstream.job import driver as driver_mod
from slipstream.job.prepare import init_local_ray, own_processes, stop_local_ray
from slipstream.job.store import JobStore
from trainer.result import TrainerResult

log = logging.getLogger("slipstream.job.faults")

WAIT_S = 120.0
"""Bound on each wait for the driver to repair a fault or the trainer to make progress."""
START_WAIT_S = 300.0
"""Bound on the wait for a job's first steps: Ray, the actors' imports and the model loads come first (on a
2-core box busy with other jobs, a job had not taken its first step after 120 s)."""


class JobFailed(AssertionError):
    """The job failed, ended, or did not get where it should within WAIT_S."""


class LocalJob:
    """`spec` run by a JobDriver in a thread; `with LocalJob(spec, data_dir) as job: ...`. Leaving the
    block asks the job to stop (as `slipstream stop` does) and tears everything down."""

    def __init__(self, spec: jobspec.JobSpec, data_dir: Path, num_cpus: int = 4) -> None:
        self.spec, self.data_dir, self.num_cpus = spec, Path(data_dir), num_cpus
        self.keys = JobKeys(spec.name)
        self.result: TrainerResult | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> LocalJob:
        import ray

        self.redis = ManagedRedis(data_dir=self.data_dir / "redis").start()
        self.r = connect(self.redis.url)
        self.store = JobStore(self.r)
        spec = self.spec
        self.store.create(
            spec.name, jobspec.to_json(spec), spec.generators.num_engines, spec.trainer.num_trainers
        )
        self.own_ray = not ray.is_initialized()  # else: the Ray this process is connected to, left running
        if self.own_ray:
            self.existing = own_processes()
            init_local_ray(num_cpus=self.num_cpus)
        self.driver = driver_mod.JobDriver(spec, self.redis.url, self.store)
        self.buffer = ReplayBuffer(self.r, spec.name)
        self.thread = threading.Thread(target=self._run, name="job-driver", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self.driver.run()
        except BaseException as e:  # reported by wait()
            try:  # as the cluster's driver ends a job (driver.main): its final state once every actor is gone
                self.driver.close()
                self.driver.report(phase=None, **driver_mod.final_status(self.driver, error=e))
            except Exception as report_error:
                log.warning("the failed job's final status: %s", report_error)
            self.error = e

    def stop(self, timeout_s: float = WAIT_S) -> TrainerResult:
        """Ask the trainer to end after its step; returns the job's result."""
        self.store.request_stop(self.spec.name)
        self.thread.join(timeout_s)
        if self.error is not None:
            raise JobFailed(f"job failed: {self.error!r}") from self.error
        if self.result is None:
            raise JobFailed(f"job did not stop within {timeout_s:.0f} s")
        return self.result

    def __exit__(self, *exc) -> None:
        try:
            if self.thread.is_alive() and self.error is None:
                try:
                    self.stop()
                except JobFailed as e:
                    log.warning("%s", e)
        finally:
            self.driver.close()
            self.thread.join(60)
            if self.own_ray:
                stop_local_ray(self.existing)
            self.r.close()
            self.redis.stop()

    # --- watching -------------------------------------------------------------------------------------
    def version(self) -> int:
        return self.buffer.version()

    def wait(self, what: str, cond: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.error is not None:
                raise JobFailed(f"job failed while waiting for {what}: {self.error!r}") from self.error
            if self.result is not None:
                raise JobFailed(f"job ended while waiting for {what}: {self.result}")
            if time.monotonic() > deadline:
                raise JobFailed(f"timed out ({timeout_s:.0f} s) waiting for {what}; {self.situation()}")
            time.sleep(0.2)

    def situation(self) -> str:
        """What a timed-out wait reports: the version, the engine registry, the admission books (a job that
        stalls with its rollout workers held by admission has lost slots), the trainer's last lines and
        where each rollout worker's coroutines wait."""
        from weight_bus.registry import EngineRegistry

        parts = []
        try:
            reg = EngineRegistry(self.r, self.spec.name)
            parts.append(f"version {self.version()}, engines live {reg.live()}, joining {reg.joining()}")
            parts.append(self.admission())
        except Exception as e:  # Redis gone: say so, the timeout is the news
            parts.append(f"registry unreadable: {e!r}")
        log_file = Path(self.spec.output_dir) / "logs" / "trainer-0.log"
        if log_file.exists():
            tail = log_file.read_text(errors="replace").splitlines()[-12:]
            parts.append("trainer-0.log ends: " + " | ".join(line[24:] for line in tail))  # sans timestamps
        parts += self.worker_stacks()
        return "; ".join(parts)

    def admission(self) -> str:
        """The buffer's admission books: groups started against the cap at the published version (with
        `buffer.admission: oldest` the oldest version in `admitted` lowers it), each worker's reservations,
        the in-flight groups by admission version, and where the started groups are."""
        st = self.buffer.stats()
        spec = self.spec
        cap = (st["version"] + spec.buffer.max_staleness + 1) * spec.algorithm.groups_per_step

        def counts(key: str) -> dict[str, int]:
            return {k.decode(): int(v) for k, v in self.r.hgetall(key).items()}

        books = f"reservations {counts(self.keys.reservations)}, admitted {counts(self.keys.admitted)}"
        keys = ("produced", "consumed", "unread", "pending", "dropped_future", "reissue_queue", "workers")
        return f"admission: started {st['started']} of cap {cap}, {books}, " + ", ".join(
            f"{k} {st[k]}" for k in keys
        )

    def worker_stacks(self) -> list[str]:
        """Where each rollout worker's coroutines wait (RolloutActor.stacks), or that its event loop did
        not answer."""
        import ray

        out = []
        for i, (actor, _) in enumerate(self.driver.generators.workers):
            try:
                stacks = ray.get(actor.stacks.remote(), timeout=10)
                out.append(f"rollout-{i} tasks: " + " || ".join(stacks))
            except Exception as e:  # a blocked loop or a dead actor: that is the news
                out.append(f"rollout-{i} stacks unreadable: {type(e).__name__}")
        return out

    def wait_progress(self, what: str, steps: int = 3) -> None:
        v0 = self.version()
        self.wait(f"{steps} more steps after {what}", lambda: self.version() >= v0 + steps)

    def pids(self) -> dict[str, int]:
        """Process ids of every actor of the job now, by role."""
        import ray

        d = self.driver
        g, t = d.generators, d.trainers
        out = {f"engine-{i}": ray.get(e.pid.remote()) for i, e in enumerate(g.engines)}
        out |= {f"rollout-{i}": ray.get(a.pid.remote()) for i, (a, _) in enumerate(g.workers)}
        out |= {f"trainer-{i}": ray.get(r.pid.remote()) for i, r in enumerate(t.ranks)}
        return out


# --- faults ---------------------------------------------------------------------------------------------
def _pid(actor) -> int:
    import ray

    return ray.get(actor.pid.remote())


def kill_worker(job: LocalJob, attempts: int = 5) -> dict:
    """kill -9 a rollout worker that has prompts in flight; wait for its replacement and for the prompts
    to be reissued. (A worker that put its last group just before the kill is tried again.)"""
    d = job.driver
    for _ in range(attempts):
        before = d.restarts["rollout_workers"]
        reissued0 = int(job.r.hget(job.keys.stats, "reissued") or 0)
        pid = _pid(d.generators.workers[0][0])
        mine = f"-{pid}-".encode()

        def in_flight() -> int:
            return sum(job.r.llen(k) for k in job.r.scan_iter(job.keys.inflight("*")) if mine in k)  # noqa: B023

        job.wait("a worker with prompts in flight", lambda: in_flight() > 0)
        os.kill(pid, signal.SIGKILL)
        n = in_flight()  # frozen with the process; reaped only when its lease expires
        log.warning("injected: kill -9 rollout worker pid %d with %d prompts in flight", pid, n)
        job.wait("the worker's replacement", lambda: d.restarts["rollout_workers"] > before)  # noqa: B023
        if n:
            job.wait(
                "its prompts reissued",
                lambda: int(job.r.hget(job.keys.stats, "reissued") or 0) >= reissued0 + n,  # noqa: B023
            )
            return {"fault": "kill_worker", "pid": pid, "prompts_in_flight": n}
    raise JobFailed(f"no worker was caught with prompts in flight in {attempts} kills")


def kill_engine(job: LocalJob, index: int = 0) -> dict:
    """kill -9 an engine (mid-generation: engines are always busy); wait until a new one holds the
    current weights and takes traffic."""
    d = job.driver.generators
    old, url = d.engines[index], d.engine_urls[index]
    pid = _pid(old)
    os.kill(pid, signal.SIGKILL)
    log.warning("injected: kill -9 engine %s (pid %d)", url, pid)
    job.wait("the engine's replacement", lambda: d.engines[index] is not old and not d.replacing(index))
    new_url = d.engine_urls[index]  # the OS may hand the dead engine's port to the new one
    job.wait("the new engine to take traffic", lambda: new_url in d_live(job))
    return {"fault": "kill_engine", "pid": pid, "url": url, "replacement": new_url}


def hang_engine(job: LocalJob, index: int = 0) -> dict:
    """SIGSTOP an engine while the trainer keeps publishing: the weight bus drops it after bus.timeout_s,
    the driver replaces it once its registry lease lapsed. Returns the versions trained meanwhile."""
    d = job.driver.generators
    old, url = d.engines[index], d.engine_urls[index]
    pid = _pid(old)
    v0 = job.version()
    os.kill(pid, signal.SIGSTOP)
    log.warning("injected: SIGSTOP engine %s (pid %d) at version %d", url, pid, v0)
    try:
        job.wait(
            "the hung engine's replacement", lambda: d.engines[index] is not old and not d.replacing(index)
        )
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # Ray's kill is already on its way; let it land
        except ProcessLookupError:
            pass
    return {"fault": "hang_engine", "pid": pid, "url": url, "versions_while_hung": job.version() - v0}


def kill_trainer(job: LocalJob) -> dict:
    """kill -9 trainer rank 0 mid-step; wait for the pool to resume from the latest checkpoint."""
    d = job.driver.trainers
    runs = d.runs
    pid = _pid(d.ranks[0])
    v0 = job.version()
    os.kill(pid, signal.SIGKILL)
    log.warning("injected: kill -9 trainer rank 0 pid %d at version %d", pid, v0)
    # the new pool's runs start once it has resumed (and rewound the version to its checkpoint)
    job.wait("the trainer pool's restart", lambda: d.runs is not runs)
    return {"fault": "kill_trainer", "pid": pid, "killed_at": v0, "resumed_at": job.version()}


def restart_redis(job: LocalJob, down_s: float = 1.0) -> dict:
    """kill -9 redis-server, leave it down for `down_s`, start it again on the same AOF, port and
    password: every process's client retries through the outage (replay_buffer/client.py)."""
    v0 = job.version()
    pid = job.redis.proc.pid
    os.kill(pid, signal.SIGKILL)
    job.redis.proc.wait()
    log.warning("injected: kill -9 redis-server pid %d at version %d; down for %.1f s", pid, v0, down_s)
    time.sleep(down_s)
    job.redis.start()
    return {"fault": "restart_redis", "pid": pid, "at_version": v0, "down_s": down_s}


def d_live(job: LocalJob) -> list[str]:
    from weight_bus.registry import EngineRegistry

    return EngineRegistry(job.r, job.spec.name).live()


# --- the books ------------------------------------------------------------------------------------------
def books(job: LocalJob) -> dict:
    """Buffer counters plus the two numbers every fault must keep at zero: `lost` (produced groups not
    accounted for) and `trained_twice` (ledger entries beyond the distinct ones)."""
    st = job.buffer.stats()
    ledger = [g.decode() for g in job.r.lrange(job.keys.ledger, 0, -1)]
    accounted = st["consumed"] + st["dropped_stale"] + st["dropped_future"] + st["dead_letter"]
    accounted += st["duplicates"]
    accounted += st["pending"] + st["unread"]
    return {
        **{k: v for k, v in st.items() if k != "staleness"},
        "ledger": len(ledger),
        "trained_twice": len(ledger) - len(set(ledger)),
        "lost": st["produced"] - accounted,
        "ledger_matches_consumed": len(ledger) == st["consumed"],
    }
