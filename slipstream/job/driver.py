"""The job driver: runs one submitted job on the cluster's Ray, as a Ray job (`slipstream submit` starts
`python -m slipstream.job.driver --home HOME --job NAME` through Ray's job API). It starts the job's pools,
then reconciles them with what the user wants, as recorded in Redis by the control API:

- generators N: engines (+ their rollout workers) are added or removed while training goes on. A new
  engine registers as *joining*: it takes rollout traffic only once the weight bus gave it the current
  weights at the next update. A removed engine leaves the registry first, so workers stop routing to it;
  requests still running there are retried on the others. Removed rollout workers finish their groups.
- trainers M: the trainer pool stops after its current step with a checkpoint, and a pool of M ranks
  resumes from it (FSDP2 reshards); generators keep filling the buffer meanwhile.
- checkpoint: the trainer writes one after its current step. stop: the trainer ends after its current
  step (final checkpoint and HF export as the spec says), then everything stops.

It also supervises the pools (at most MAX_RESTARTS replacements per kind):
- a rollout worker that dies is replaced; the prompts it had in flight are reissued to the others once
  its buffer lease expires (replay_buffer admission);
- an engine whose process dies, or whose registry lease stays lapsed for LAPSED_S (hung, e.g. stuck in a
  weight update that the bus gave up on), is killed and replaced by a new one that joins through the
  weight bus before it takes traffic; its requests are retried on the other engines meanwhile;
- a trainer rank that dies takes its pool down: every rank is killed, the engines are told to continue
  (a rank 0 that died mid-update leaves them paused), and a pool of the same size resumes from the
  latest checkpoint (or the initial model if none was written); the groups it had read but not committed
  are redelivered to the new rank 0, and the commit ledger never trains a group twice.

It reports the job's state and progress to Redis (slipstream/cluster/job_store.py) for `slipstream status`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis

import jobspec
from common.logtext import PlainFormatter
from generator_fleet.registry import EngineRegistry, engines_key, joining_key
from jobspec import JobSpec
from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from slipstream.cluster.job_store import JobStore, check_name
from slipstream.job.local import (
    RUN_FILES,
    STOP_TIMEOUT_S,
    ProgressReader,
    launch_engine,
    prepare_model,
    start_engines,
    stop_actors,
)

log = logging.getLogger("slipstream.job.driver")

POLL_S = 0.5
"""How often desired state and commands are read."""
DRAIN_S = 2.5
"""A removed engine's grace between leaving the registry and stopping (rollout workers refresh the
registry every generator_fleet.rollout.ENGINE_REFRESH_S = 2 s)."""
LAPSED_S = 10.0
"""An engine of ours absent from the registry (neither live nor joining: its lease ran out) for this long
is presumed hung and replaced. A dropped engine is briefly in neither set, until its next renewal."""
MAX_RESTARTS = 20
"""Replacements of one kind (rollout worker, engine, trainer pool) a job survives; one more fails it: a
crash loop is a bug to report, not bad luck to retry forever."""
EARLY_DEATH_S = 20.0
CRASH_LOOP = 3
"""CRASH_LOOP rollout workers in a row that die within EARLY_DEATH_S of their start (a missing package, a
reward that cannot load) fail the job at once with the last one's error, instead of after MAX_RESTARTS."""


class _Stop(Exception):
    """SIGTERM (Ray's `stop_job`, or the control API's forced stop)."""


def workers_per_engine(spec: JobSpec) -> int:
    g = spec.generators
    return max(1, math.ceil(g.num_workers / g.num_engines))


class JobDriver:
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
        self.api_key = secrets.token_hex(16)
        self.engines: list = []  # launched engine actors, in order (the last ones go first)
        self.engine_urls: list[str] = []
        self.rollout_urls: list[str] = []
        self.attached: list = []  # external/router attachments (not scaled)
        self.workers: list[tuple] = []  # (actor, run ref)
        self.trainers: list = []
        self.train_runs: list = []
        self.version = 0
        self.last: dict = {}
        self.run_info: dict = {}  # run_id, attempt (ReplayBuffer.begin_run)
        self._next_engine = 0
        self._next_worker = 0
        self.engine_watch: list = []  # per engine in self.engines: its watch() call, which fails on death
        self.restarts = {"rollout_workers": 0, "engines": 0, "trainer_pool": 0}
        self._lapsed_since: dict[str, float] = {}
        self._starting: dict[int, str] = {}  # engine index -> the URL of the engine it replaces
        self.closing = False  # close() began: what stops now is not a failure to repair
        self._closed = False
        self._next_registry_check = 0.0
        self._worker_born: dict = {}  # run ref -> monotonic start
        self._early_deaths = 0  # rollout workers in a row that died within EARLY_DEATH_S of their start

    @property
    def records(self) -> list[dict]:
        """The run's progress records read so far (superseded ones removed): the end-of-job report."""
        return self.progress.records

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
                "generators": len(self.engines) if self.engines else len(self.engine_urls),
                "rollout_workers": len(self.workers),
                "trainers": len(self.train_runs),  # ranks set up and training (not those still starting)
            },
            "restarts": self.restarts,
            # the run's clock and the run's own rate (its records: samples trained ÷ their elapsed_s)
            "elapsed_s": self._clock(),
            "samples_per_s": self.last.get("samples_per_s", 0.0),
            "output_dir": self.spec.output_dir,
            **{
                k: self.last[k]
                for k in (
                    "reward_mean",
                    "staleness_mean",
                    "staleness_max",
                    "tokens_per_s",
                    "train_tokens_per_s",
                    "step_s",
                    "loss",
                    "mfu",
                    "lr",
                    "behav_kl",
                    "is_masked_fraction",
                    "clip_fraction",
                )
                if k in self.last
            },
            **extra,
        }
        try:
            fields["buffer"] = self.buffer.stats()
        except redis.RedisError as e:
            log.warning("buffer stats: %s", e)
        if state is not None:
            fields["state"] = state
        self.store.update_status(self.job, **fields)

    # --- pools ----------------------------------------------------------------------------------------
    def _spec_with(self, **trainer) -> JobSpec:
        return msgspec.structs.replace(
            self.spec, trainer=msgspec.structs.replace(self.spec.trainer, **trainer)
        )

    def start_generators(self, n: int) -> None:
        """The job's first engines (through the launcher's start_engines: builtin, sglang or external)."""
        g = msgspec.structs.replace(self.spec.generators, num_engines=n)
        spec = msgspec.structs.replace(self.spec, generators=g)
        started: list = []
        urls = start_engines(spec, self.redis_url, self.api_key, started)
        self.engine_urls, self.rollout_urls = urls.workers, urls.rollout
        self.api_key = urls.api_key
        if self.spec.generators.engine == "external" or self.spec.generators.router_url:
            self.attached = started
            self.engines = []
        else:
            self.engines = started
            self.engine_watch = [e.watch.remote() for e in started]
        self._next_engine = n
        g = self.spec.generators  # the spec's own worker count at its own engine count
        self.add_workers(g.num_workers if n == g.num_engines else workers_per_engine(self.spec) * n)

    def add_workers(self, count: int) -> None:
        from slipstream.job.actors import RolloutActor

        for _ in range(count):
            a = RolloutActor.remote(
                self.spec, self.redis_url, self.rollout_urls, self.api_key, self._next_worker
            )
            self._next_worker += 1
            ref = a.run.remote()
            self._worker_born[ref] = time.monotonic()
            self.workers.append((a, ref))

    def remove_workers(self, count: int) -> None:
        import ray

        if count <= 0:
            return
        gone = self.workers[len(self.workers) - count :]
        self.workers = self.workers[: len(self.workers) - count]
        for _, ref in gone:
            self._worker_born.pop(ref, None)
        for a, _ in gone:
            a.stop.remote()
        runs = [ref for _, ref in gone]
        done = self._wait(runs, STOP_TIMEOUT_S)
        produced = sum(ray.get(ref)["groups"] for ref in done)
        for a, _ in gone:
            ray.kill(a)
        log.info("removed %d rollout workers (they finished their groups: %d in all)", count, produced)

    def scale_generators(self, n: int) -> None:
        import ray

        have = len(self.engines)
        if n == have:
            return
        self.report("scaling", scaling=f"generators {have} -> {n}")
        per = workers_per_engine(self.spec)
        if n > have:
            new = []
            for _ in range(n - have):
                new.append(
                    launch_engine(self.spec, self.redis_url, self.api_key, self._next_engine, joining=True)
                )
                self._next_engine += 1
            self.engines += new
            urls = self._get([e.start.remote() for e in new])
            self.engine_urls += urls
            self.engine_watch += [e.watch.remote() for e in new]
            self.add_workers(per * (n - have))
            log.info(
                "generators %d -> %d: engines %s joined (rollouts reach them after the next weight update)",
                have,
                n,
                urls,
            )
        else:
            self.remove_workers(max(0, len(self.workers) - per * n))
            gone = self.engines[n:]
            self.engines = self.engines[:n]
            self.engine_watch = self.engine_watch[:n]
            self._starting = {i: u for i, u in self._starting.items() if i < n}
            gone_urls = self.engine_urls[n:]
            self.engine_urls = self.engine_urls[:n]
            self._get(
                [
                    e.stop.remote(DRAIN_S) if self.spec.generators.engine == "builtin" else e.stop.remote()
                    for e in gone
                ]
            )
            for e in gone:
                ray.kill(e)
            log.info("generators %d -> %d: engines %s stopped", have, n, gone_urls)
        self.report("running", scaling=None)

    def start_trainers(self, m: int, resume_from: str | None = None) -> None:
        from slipstream.job.actors import TrainerActor

        spec = self._spec_with(num_trainers=m, **({"resume_from": resume_from} if resume_from else {}))
        rank_cls = TrainerActor.options(num_gpus=1 if spec.trainer.device == "cuda" else 0)
        self.trainers = [
            rank_cls.remote(spec, self.redis_url, self.engine_urls, self.api_key, r, m) for r in range(m)
        ]
        master = self._get([self.trainers[0].rendezvous.remote()])[0] if m > 1 else None
        self._get([t.setup.remote(master) for t in self.trainers])
        self.train_runs = [t.run.remote() for t in self.trainers]
        log.info("trainer pool: %d ranks%s", m, f", resumed from {resume_from}" if resume_from else "")

    def scale_trainers(self, m: int) -> dict | None:
        """Checkpoint, stop the pool, start one of m ranks from that checkpoint. Returns the old pool's
        result if it had finished the job before it could be stopped (then nothing restarts)."""
        import ray

        have = len(self.trainers)
        self.report("scaling", scaling=f"trainers {have} -> {m}")
        self._get([self.trainers[0].stop.remote(True)])
        results = self._get(self.train_runs)
        for t in self.trainers:
            ray.kill(t)
        result = results[0]
        if not result["restart"] or not result["checkpoint"]:
            return result  # the job ended (last step) before the stop took effect
        self.start_trainers(m, resume_from=result["checkpoint"])
        log.info(
            "trainers %d -> %d at version %d (checkpoint %s)",
            have,
            m,
            result["version"],
            result["checkpoint"],
        )
        self.report("running", scaling=None)
        return None

    # --- supervision ----------------------------------------------------------------------------------
    def _count_restart(self, kind: str, why: str = "") -> None:
        self.restarts[kind] += 1
        if self.restarts[kind] > MAX_RESTARTS:
            raise RuntimeError(
                f"{kind}: more than {MAX_RESTARTS} replacements; giving up. The last one {why} (see the logs)"
            )

    def check_workers(self) -> None:
        """Replace rollout workers that died (or returned: they only do when told to stop)."""
        import ray

        runs = [ref for _, ref in self.workers]
        if not runs or self.closing:
            return
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for ref in done:
            i = next(i for i, (_, r) in enumerate(self.workers) if r == ref)
            actor, _ = self.workers.pop(i)
            why = _outcome(ref)
            lived = time.monotonic() - self._worker_born.pop(ref, 0.0)
            self._early_deaths = self._early_deaths + 1 if lived < EARLY_DEATH_S else 0
            if self._early_deaths >= CRASH_LOOP:
                raise RuntimeError(
                    f"rollout workers die right after they start ({self._early_deaths} in a row, each "
                    f"within {EARLY_DEATH_S:.0f} s); the last one: {why}"
                )
            self._count_restart("rollout_workers", f"rollout worker {why}")
            log.warning(
                "rollout worker %s; starting a replacement (its unfinished prompts are reissued once its "
                "lease expires, buffer.worker_lease_s)",
                why,
            )
            _kill(actor)
            self.add_workers(1)
        if done:
            self.report()

    def check_engines(self) -> None:
        """Replace engines whose process died, or that stayed out of the registry for LAPSED_S (hung)."""
        import ray

        if not self.engines or self.closing:
            return
        done, _ = ray.wait(self.engine_watch, num_returns=len(self.engine_watch), timeout=0)
        failed: dict[int, str] = {}
        for i, ref in enumerate(self.engine_watch):
            if ref not in done:
                continue
            if i in self._starting:  # a replacement's start() answered
                self._started(i, ref, failed)
            else:
                failed[i] = f"died ({_outcome(ref)})"
        now = time.monotonic()
        if now >= self._next_registry_check:
            self._next_registry_check = now + 1.0
            reg = EngineRegistry(self.r, self.job)
            present = set(reg.live()) | set(reg.joining())
            for i, url in enumerate(self.engine_urls):
                if url in present or i in self._starting:
                    self._lapsed_since.pop(url, None)
                elif now - self._lapsed_since.setdefault(url, now) >= LAPSED_S and i not in failed:
                    failed[i] = f"is hung (no registry lease for {now - self._lapsed_since[url]:.0f} s)"
        for i, why in sorted(failed.items()):
            self._replace_engine(i, why)
        if failed:
            self.report()

    def _replace_engine(self, i: int, why: str) -> None:
        """Kill engine i and start its replacement; the loop goes on meanwhile (a start takes seconds, more
        on a loaded host) and `_started` takes the new engine in when its start() answers."""
        old, url = self.engines[i], self.engine_urls[i]
        self._count_restart("engines", f"engine {url} {why}")
        log.warning("engine %s %s; replacing it (its requests are retried on the other engines)", url, why)
        _kill(old)
        for key in (engines_key(self.job), joining_key(self.job)):
            self.r.zrem(key, url)  # rollout workers stop routing to it at their next refresh
        self._lapsed_since.pop(url, None)
        new = launch_engine(self.spec, self.redis_url, self.api_key, self._next_engine, joining=True)
        self._next_engine += 1
        self.engines[i], self.engine_watch[i] = new, new.start.remote()
        self._starting[i] = url

    def replacing(self, i: int) -> bool:
        """Engine i is a replacement still starting."""
        return i in self._starting

    def _started(self, i: int, ref, failed: dict[int, str]) -> None:
        import ray

        old_url = self._starting.pop(i)
        try:
            new_url = ray.get(ref)
        except Exception as e:
            failed[i] = f"(a replacement) did not start: {type(e).__name__}: {str(e)[:200]}"
            return
        self.engine_urls[i], self.engine_watch[i] = new_url, self.engines[i].watch.remote()
        self.rollout_urls = [new_url if u == old_url else u for u in self.rollout_urls]
        log.info("engine %s replaced by %s (it takes traffic after the next weight update)", old_url, new_url)

    def check_trainers(self) -> dict | None:
        """The pool's result once every rank finished; restarts the pool when a rank died. None while
        it trains."""
        import ray

        done, _ = ray.wait(self.train_runs, num_returns=len(self.train_runs), timeout=0)
        failed = [why for ref in done if (why := _outcome(ref, failed_only=True))]
        if failed and self.closing:
            raise RuntimeError(f"trainer rank {failed[0]} while the job was closing")
        if failed:
            self.restart_trainers(failed[0])
            return None
        if len(done) == len(self.train_runs):
            return ray.get(self.train_runs[0])
        return None

    def restart_trainers(self, why: str) -> None:
        m = len(self.trainers)
        self._count_restart("trainer_pool", f"trainer rank {why}")
        for t in self.trainers:
            _kill(t)
        self._continue_engines()
        from trainer import checkpoint

        try:
            resume = str(checkpoint.resolve(checkpoint.LATEST, self._checkpoint_dir()))
        except FileNotFoundError:
            resume = None
        if resume and (theirs := _checkpoint_run(resume)) not in (None, self.run_info.get("run_id")):
            log.warning(
                "latest checkpoint %s belongs to run %s, not this one: not resumed from", resume, theirs
            )
            resume = self.spec.trainer.resume_from
        log.warning(
            "trainer rank %s; restarting the pool of %d ranks from %s",
            why,
            m,
            resume or "the initial model (no checkpoint was written yet: trainer.checkpoint_every)",
        )
        self.start_trainers(m, resume_from=resume)
        self.report()

    def _checkpoint_dir(self) -> Path:
        return Path(self.spec.trainer.checkpoint_dir or Path(self.spec.output_dir) / "checkpoints")

    def _continue_engines(self) -> None:
        """A trainer that died between pause and continue of a weight update left the engines paused."""
        import httpx

        for url in self.engine_urls:
            try:
                httpx.post(
                    f"{url}/continue_generation",
                    json={},
                    headers={"Authorization": f"Bearer {self.api_key}"},
                    timeout=10.0,
                ).raise_for_status()
            except httpx.HTTPError as e:
                log.warning("engine %s: continue after the trainer's death failed: %s", url, e)

    # --- the loop -------------------------------------------------------------------------------------
    def begin_run(self) -> None:
        """A new run of the job (fresh run_id; the previous run's Redis state and per-run output files
        deleted), or, when the spec resumes (trainer.resume_from), the next attempt of the same run."""
        self.run_info = self.buffer.begin_run(resume=self.spec.trainer.resume_from is not None)
        if self.run_info["attempt"] == 1:
            for name in RUN_FILES:
                (Path(self.spec.output_dir) / name).unlink(missing_ok=True)
            ckpts = self._checkpoint_dir()
            if self.spec.trainer.resume_from is None and any(ckpts.glob("step-*")):
                # an earlier run's checkpoints: kept, but apart (this run's `latest`, its restarts and
                # keep_checkpoints' pruning see only its own)
                aside = ckpts.with_name(f"{ckpts.name}.before-{self.run_info['run_id']}")
                ckpts.rename(aside)
                log.warning("an earlier run's checkpoints moved from %s to %s", ckpts, aside)
        log.info("job %s: run %s, attempt %d", self.job, self.run_info["run_id"], self.run_info["attempt"])

    def _this_attempt(self, rec: dict) -> bool:
        """A record of this attempt of the run (a resumed attempt first reads the records of the earlier
        ones, up to where they got, before its trainer drops those after the checkpoint it resumes from)."""
        return rec.get("attempt") in (None, self.run_info.get("attempt"))

    def read_progress(self, block_ms: int = 0) -> None:
        """Take the trainer's new progress records (waiting up to block_ms for one) into the status.
        With `on_progress` (`slipstream run` prints each record as its line) the per-step log line is
        DEBUG, so a step shows once on the terminal; the cluster's driver.log keeps it at INFO."""
        for rec in self.progress.read(block_ms=block_ms):
            if not self._this_attempt(rec):
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

    def _wait(self, refs: list, timeout_s: float | None = None) -> list:
        """ray.wait for all of `refs` (at most timeout_s), reading progress meanwhile: the trainer trains
        on while engines start or stop and while a trainer pool winds down, and `status` shows it."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=left)
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return done
            self.read_progress(block_ms=0)

    def _get(self, refs: list) -> list:
        """ray.get of `refs`, reading progress while they run (see _wait)."""
        import ray

        self._wait(refs)
        return ray.get(refs)

    def run(self) -> dict:
        desired = self.store.desired(self.job)
        self.begin_run()
        model, build = Path(self.spec.model.path), self.spec.model.build
        if build is not None and not (model / "config.json").exists():
            phase = f"building model {build} at {model} (once; jobs with this model.path reuse it)"
        else:
            phase = f"loading model {model}"
        log.info("job %s: %s", self.job, phase)
        self.report("starting", phase=phase)
        prepare_model(self.spec)
        self.buffer.ensure_group()
        if self.r.get(self.buffer.keys.version) is None:
            self.buffer.set_version(0)
        n = desired.get("generators", self.spec.generators.num_engines)
        self.report(phase=f"starting {n} generator(s) and their rollout workers")
        self.start_generators(n)
        m = desired.get("trainers", self.spec.trainer.num_trainers)
        self.report(phase=f"starting {m} trainer rank(s)")
        self.start_trainers(m)
        self.report("running", phase=None)
        stopping = stop_checkpoint = False
        while True:
            if (result := self.check_trainers()) is not None:
                break
            self.check_workers()
            self.check_engines()
            self.read_progress(block_ms=int(POLL_S * 1000))
            want = self.store.desired(self.job)
            if want["stop"] and not stopping:
                log.info(
                    "stop requested%s: the trainer ends after its current step, %s",
                    f" ({want['stop_reason']})" if want.get("stop_reason") else "",
                    "with a checkpoint there" if want["stop_checkpoint"] else "writing no checkpoint",
                )
                stopping, stop_checkpoint = True, want["stop_checkpoint"]
                self.report("stopping", phase="the trainer ends after its current step")
                self.trainers[0].stop.remote(False, stop_checkpoint)
            elif stopping and want["stop_checkpoint"] and not stop_checkpoint:
                log.info("stop: a checkpoint is asked for now (it is written where the trainer stops)")
                stop_checkpoint = True
                self.trainers[0].stop.remote(False, True)
            if stopping:
                continue
            for cmd in self.store.pop_commands(self.job):
                if cmd == "checkpoint":
                    log.info("checkpoint requested")
                    self.trainers[0].request_checkpoint.remote()
            if self.engines and want.get("generators", len(self.engines)) != len(self.engines):
                self.scale_generators(want["generators"])
            if want.get("trainers", len(self.trainers)) != len(self.trainers):
                ended = self.scale_trainers(want["trainers"])
                if ended is not None:
                    result = ended
                    break
        for rec in self.progress.read(block_ms=0):
            if self._this_attempt(rec):
                self.last, self.version = rec, rec["version"]
        self.version = result["version"]
        return result

    def close(self) -> None:
        import ray

        if self._closed:
            return
        self.closing = self._closed = True
        for a, _ in self.workers:
            a.stop.remote()
        ray.wait([ref for _, ref in self.workers], num_returns=len(self.workers), timeout=STOP_TIMEOUT_S)
        stop_actors(self.engines + self.attached, [a for a, _ in self.workers] + self.trainers)
        # every pool is gone: the final report shows 0, not the sizes the job had
        self.engines, self.attached, self.engine_urls, self.engine_watch = [], [], [], []
        self.workers, self.trainers, self.train_runs = [], [], []


def error_text(e: BaseException) -> str:
    """An error in one line for the job's status: its type and first line, and, where it carries a
    traceback (an actor's error through Ray), the line that ends it: the real cause."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Ray colours the actor's name
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or [""]
    cause = f" ... {lines[-1][:500]}" if len(lines) > 1 else ""
    return f"{type(e).__name__}: {lines[0][:300]}{cause}"


def _outcome(ref, failed_only: bool = False) -> str | None:
    """How a finished Ray call ended, in a few words (None with failed_only when it returned)."""
    import ray

    try:
        value = ray.get(ref)
    except Exception as e:  # RayActorError (killed, OOM), or the actor's own exception
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [""]
        cause = f" ... {lines[-1][:300]}" if len(lines) > 1 else ""  # a task error's traceback ends in it
        return f"died: {type(e).__name__}: {lines[0][:200]}{cause}"
    return None if failed_only else f"exited ({value})"


def _checkpoint_run(path: str) -> str | None:
    """The run_id a checkpoint was written by (None: unknown, e.g. written before runs had ids)."""
    from trainer import checkpoint

    try:
        return json.loads((Path(path) / checkpoint.STATE_FILE).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception as e:  # already gone
        log.debug("ray.kill: %s", e)


def _checkpoint_note(driver: JobDriver, result: dict | None, stopped: bool) -> dict:
    """The job's final status fields on its checkpoint: `checkpoint` (path, "" if none),
    `checkpoint_version`, and `note`, one line on what a resumption starts from."""
    from slipstream.cluster.job_store import latest_checkpoint

    if result is not None and result.get("checkpoint"):
        ck = {"path": result["checkpoint"], "version": result.get("checkpoint_version")}
        note = f"checkpoint at version {ck['version']}: {ck['path']}"
    else:
        ck = latest_checkpoint(driver._checkpoint_dir())
        if result is not None and stopped and result["version"] > 0:
            why = "no checkpoint written at the stop (stop --no-checkpoint)"
        elif result is not None:
            why = (
                "no checkpoint written (trainer.checkpoint_every is 0)"
                if result["version"]
                else "no step trained"
            )
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


def load_job_spec(store: JobStore, job: str) -> JobSpec:
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


def _raise_stop(signum, frame):
    raise _Stop(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    from slipstream.cluster import services as cluster

    p = argparse.ArgumentParser(prog="python -m slipstream.job.driver", description=__doc__.splitlines()[0])
    p.add_argument("--home", required=True, help="the cluster's state directory")
    p.add_argument("--job", required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The job's own Redis user (its keys only), not the control plane's: cluster.job_redis_url.
    if why := check_name(args.job):
        print(f"slipstream.job.driver: job name {args.job!r}: {why}", file=sys.stderr)
        return 1
    try:
        redis_url = cluster.job_redis_url(args.home, args.job)
    except OSError as e:
        print(f"slipstream.job.driver: job {args.job!r} has no Redis credentials: {e}", file=sys.stderr)
        return 1
    store = JobStore(connect(redis_url))
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

    import ray

    # The Ray job's runtime env (PYTHONPATH, HF_HUB_OFFLINE: slipstream/cluster/control.py) reaches every actor.
    ray.init(
        address="auto", namespace=f"slipstream-{args.job}", log_to_driver=True, logging_level=logging.WARNING
    )
    signal.signal(signal.SIGTERM, _raise_stop)
    driver = JobDriver(spec, redis_url, store)
    log.info("job %s: driver pid %d, output in %s", args.job, os.getpid(), out)
    code, final = 0, {}
    try:
        result = driver.run()
        stopped = store.desired(args.job)["stop"]
        final = {"state": "stopped" if stopped else "succeeded", "final_model": result.get("final_model", "")}
        final.update(_checkpoint_note(driver, result, stopped))
        log.info("job %s %s at version %d: %s", args.job, final["state"], result["version"], final["note"])
    except (_Stop, KeyboardInterrupt) as e:
        want = store.desired(args.job)
        final = {"state": "stopped" if want["stop"] else "interrupted"}
        final.update(_checkpoint_note(driver, None, want["stop"]))
        if not want["stop"]:
            final["error"] = f"the driver was terminated ({e or 'interrupt'}) without a stop request"
        log.info("job %s %s (%s): %s", args.job, final["state"], e or "interrupt", final["note"])
    except Exception as e:
        log.exception("job %s failed", args.job)
        final = {"state": "failed", "error": error_text(e)}
        code = 1
    finally:
        driver.close()  # the final state is reported once every actor is gone
        from slipstream.job.report import write_report_logged

        write_report_logged(driver.records, out)  # PNG plots; logs and swallows any failure
        driver.report(phase=None, **(final or {"state": "failed", "error": "the driver was interrupted"}))
        ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
