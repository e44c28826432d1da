"""The generator pool of one job: its engines (built-in, SGLang, or attached external ones), their rollout
workers, and their supervision.

- Scaling: a scale up starts its engines in the background (the driver's loop goes on: a Ray cluster
  without room for them keeps them queued, and after PLACEMENT_WAIT_S the status' `waiting` says what
  they need); each joins the pool, with its rollout workers, once started. A scale down cancels engines
  still waiting first. A new engine registers as *joining*: it takes rollout traffic only once the
  weight bus gave it the current weights at the next update. A removed engine leaves the registry
  first, so workers stop routing to it; requests still running there are retried on the others.
  Removed rollout workers finish their groups.
- Supervision (the job's restart budget, slipstream/job/supervise.py: at most supervision.max_restarts
  replacements per kind, fewer for an out-of-memory or disk-full failure that repeats with no version
  trained meanwhile): a rollout worker that dies is replaced; the
  prompts it had in flight are reissued to the others once its buffer lease expires (replay_buffer
  admission). An engine whose process dies, or whose registry lease stays lapsed for LAPSED_S (hung, e.g.
  stuck in a weight update that the bus gave up on), is killed and replaced by a new one that joins
  through the weight bus before it takes traffic; its requests are retried on the other engines meanwhile.

- Evaluation (a job spec's `eval`): one evaluator actor beside the rollout workers
  (generator_fleet/evaluation.py) scores the engines at the versions due; one that dies is replaced (at
  most MAX_EVAL_RESTARTS times, then evaluation stops with an error in the log: it never fails the job).

`generators_only` runs the pool alone, filling a job's buffer with no trainer consuming it. How one
engine is launched, started and stopped: slipstream/job/engines.py.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from jobspec import JobSpec
from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from slipstream.job import supervise
from slipstream.job.engines import launch_engine, start_engines, stop_actors
from slipstream.job.placement import Colocation
from slipstream.job.supervise import STOP_TIMEOUT_S, Restarts, died, error_of, kill, outcome, wait_all
from weight_bus.registry import EngineRegistry, engines_key, joining_key

log = logging.getLogger("slipstream.job.generators")

DRAIN_S = 2.5
"""A removed engine's grace between leaving the registry and stopping (rollout workers refresh the
registry every generator_fleet.rollout.ENGINE_REFRESH_S = 0.5 s; the rest lets requests in flight there end)."""
LAPSED_S = 10.0
"""An engine of ours absent from the registry (neither live nor joining: its lease ran out) for this long
is presumed hung and replaced. A dropped engine is briefly in neither set, until its next renewal."""
PLACEMENT_WAIT_S = 15.0
"""How long an engine's replacement, or one a scale up added, may take to start before the status
(`waiting`, a replacement's `failure.action`) and the log say it waits for a node with room for it."""
EARLY_DEATH_S = 20.0
CRASH_LOOP = 3
"""CRASH_LOOP rollout workers in a row that die within EARLY_DEATH_S of their start (a missing package, a
reward that cannot load) fail the job at once with the last one's error, instead of after
supervision.max_restarts."""
MAX_EVAL_RESTARTS = 5
"""Evaluator replacements before evaluation is given up for the job (logged; training goes on)."""


def workers_per_engine(spec: JobSpec) -> int:
    g = spec.generators
    return max(1, math.ceil(g.num_workers / g.num_engines))


class Pending(NamedTuple):
    """An engine a scale up launched that has not started yet (Ray may keep it queued for room)."""

    index: int
    actor: Any
    start: Any
    """Its start() call: the engine's URL once it runs."""
    since: float
    """When it was launched (monotonic)."""


# Long: engines, rollout workers and the evaluator scaled and supervised as one pool; each step is a method
class GeneratorPool:
    """A job's engines and rollout workers on Ray. `between` is called while the pool waits on its actors
    (the driver reads progress there); `restarts` is the job's replacement budget, shared with its other
    pool. Nothing starts before `start`."""

    def __init__(
        self,
        spec: JobSpec,
        redis_url: str,
        restarts: Restarts | None = None,
        between: Callable[[], None] | None = None,
        placement: Colocation | None = None,
    ) -> None:
        self.spec, self.redis_url, self.job = spec, redis_url, spec.name
        self.placement = placement
        self.r = connect(redis_url)
        self.restarts = restarts if restarts is not None else Restarts()
        self.between = between
        self.api_key = secrets.token_hex(16)
        self.engines: list = []  # launched engine actors, in order (the last ones go first)
        self.engine_urls: list[str] = []
        self.rollout_urls: list[str] = []
        self.attached: list = []  # external/router attachments (not scaled)
        self.workers: list[tuple] = []  # (actor, run ref)
        self.engine_watch: list = []  # per engine in self.engines: its watch() call, which fails on death
        self.closing = False  # close() began: what stops now is not a failure to repair
        self._next_engine = 0
        self._next_worker = 0
        self._lapsed_since: dict[str, float] = {}
        self._starting: dict[int, str] = {}  # engine index -> the URL of the engine it replaces
        self._starting_since: dict[int, float] = {}  # engine index -> when its replacement was launched
        self._failures: dict[int, supervise.Failure] = {}  # engine index -> the failure it replaces
        self._waiting: dict[int, str] = {}  # replacements said to wait for room on a node -> that note
        self._pending: list[Pending] = []  # engines a scale up launched, not started yet (oldest first)
        self._pending_notes: dict[int, str] = {}  # their engine index -> the note, once said to wait
        self._next_registry_check = 0.0
        self._worker_born: dict = {}  # run ref -> monotonic start
        self._early_deaths = 0  # rollout workers in a row that died within EARLY_DEATH_S of their start
        self.evaluator = None  # the EvalActor (a spec with `eval`), and its run() call
        self.eval_run = None
        self.eval_restarts = 0

    @property
    def size(self) -> int:
        """Generators now: launched engines, else the attached ones."""
        return len(self.engines) if self.engines else len(self.engine_urls)

    @property
    def target(self) -> int:
        """Launched engines the pool is scaled to: those running (or being replaced) and those a scale up
        added that have not started yet."""
        return len(self.engines) + len(self._pending)

    @property
    def starting(self) -> int:
        """Engines a scale up added that have not started yet."""
        return len(self._pending)

    @property
    def scalable(self) -> bool:
        """Launched engines (attached external ones are not scaled), not colocated (one engine per
        trainer rank's device)."""
        return bool(self.engines) and self.placement is None

    def _wait(self, refs: list, timeout_s: float | None = None) -> list:
        return wait_all(refs, timeout_s, self.between)

    def _get(self, refs: list) -> list:
        import ray

        self._wait(refs)
        return ray.get(refs)

    # --- pool -----------------------------------------------------------------------------------------
    def start(self, n: int) -> None:
        """The first n engines (builtin, sglang or external: start_engines) and their rollout workers."""
        import msgspec

        g = msgspec.structs.replace(self.spec.generators, num_engines=n)
        spec = msgspec.structs.replace(self.spec, generators=g)
        started: list = []
        try:
            urls = start_engines(spec, self.redis_url, self.api_key, started, self.placement)
        finally:  # teardown reaches what started, even when a start failed
            self.attached = started
        self.engine_urls, self.rollout_urls = urls.workers, urls.rollout
        self.api_key = urls.api_key
        if not (self.spec.generators.engine == "external" or self.spec.generators.router_url):
            self.attached, self.engines = [], started
            self.engine_watch = [e.watch.remote() for e in started]
        self._next_engine = n
        g = self.spec.generators  # the spec's own worker count at its own engine count
        self.add_workers(g.num_workers if n == g.num_engines else workers_per_engine(self.spec) * n)

    def _start_worker(self, index: int) -> tuple:
        """(actor, its run() call) of rollout worker `index`."""
        from slipstream.job.actors import RolloutActor

        a = RolloutActor.options(resources=dict(self.spec.generators.resources)).remote(
            self.spec.rollout_config(), self.redis_url, self.rollout_urls, self.api_key, index
        )
        return a, a.run.remote()

    def add_workers(self, count: int) -> None:
        for _ in range(count):
            a, ref = self._start_worker(self._next_worker)
            self._next_worker += 1
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

    def scale(self, n: int) -> None:
        """Scale to n engines (and workers_per_engine rollout workers each). Up: the new engines start in
        the background (check_engines takes each in, with its workers, once started); down: engines still
        waiting to start are cancelled first (newest first), then running ones stopped, newest first."""
        import ray

        have = self.target
        if n == have:
            return
        if n > have:
            for _ in range(n - have):  # a built-in engine joins once the bus gave it the weights
                i = self._next_engine
                actor = launch_engine(self.spec, self.redis_url, self.api_key, i, joining=True)
                self._pending.append(Pending(i, actor, actor.start.remote(), time.monotonic()))
                self._next_engine += 1
            log.info(
                "generators %d -> %d: starting engines %s in the background (each joins once started)",
                have,
                n,
                [f"engine-{p.index}" for p in self._pending[len(self._pending) - (n - have) :]],
            )
            return
        while self._pending and self.target > n:
            p = self._pending.pop()
            kill(p.actor)
            self._pending_notes.pop(p.index, None)
            log.info(
                "generators %d -> %d: engine-%d cancelled before it started (launched %.0f s ago)",
                have,
                n,
                p.index,
                time.monotonic() - p.since,
            )
        if n >= len(self.engines):
            return
        running = len(self.engines)
        self.remove_workers(max(0, len(self.workers) - workers_per_engine(self.spec) * n))
        gone = self.engines[n:]
        self.engines = self.engines[:n]
        self.engine_watch = self.engine_watch[:n]
        self._starting = {i: u for i, u in self._starting.items() if i < n}
        self._failures = {i: f for i, f in self._failures.items() if i < n}
        self._waiting = {i: w for i, w in self._waiting.items() if i < n}
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
        log.info("generators %d -> %d: engines %s stopped", running, n, gone_urls)

    def check_pending(self) -> bool:
        """Take in the engines a scale up added that started (each with its rollout workers), say of
        those waiting PLACEMENT_WAIT_S that they wait for room, and relaunch one whose start failed
        (counted against the restart budget). True when something changed for the status."""
        import ray

        if not self._pending or self.closing:
            return False
        changed = False
        done, _ = ray.wait([p.start for p in self._pending], num_returns=len(self._pending), timeout=0)
        now = time.monotonic()
        for p in list(self._pending):
            waited = now - p.since
            if p.start not in done:
                if p.index not in self._pending_notes and waited >= PLACEMENT_WAIT_S:
                    running = len(self.engines)
                    note = supervise.waiting_for_room(self.spec.generators, waited, running, scaled=True)
                    self._pending_notes[p.index] = note
                    log.warning("engine-%d: %s", p.index, note)
                    changed = True
                continue
            changed = True
            self._pending.remove(p)
            waiting = self._pending_notes.pop(p.index, None) is not None
            try:
                url = ray.get(p.start)
            except Exception as e:
                kill(p.actor)
                self.restarts.count("engines", f"did not start: {died(e)}", e, f"engine-{p.index}")
                log.warning(
                    "engine-%d (added by a scale) did not start: %s; launching another", p.index, died(e)
                )
                self.scale(self.target + 1)
                continue
            self.engines.append(p.actor)
            self.engine_urls.append(url)
            self.engine_watch.append(p.actor.watch.remote())
            self.add_workers(workers_per_engine(self.spec))
            log.info(
                "engine-%d started%s: %s joined (rollouts reach it after the next weight update); %d engines",
                p.index,
                f" after waiting {waited:.0f} s for room" if waiting else "",
                url,
                len(self.engines),
            )
        return changed

    # --- supervision ----------------------------------------------------------------------------------
    def check_workers(self) -> bool:
        """Replace rollout workers that died (or returned: they only do when told to stop). True when
        one was replaced."""
        import ray

        runs = [ref for _, ref in self.workers]
        if not runs or self.closing:
            return False
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for ref in done:
            i = next(i for i, (_, r) in enumerate(self.workers) if r == ref)
            actor, _ = self.workers.pop(i)
            why = outcome(ref)
            lived = time.monotonic() - self._worker_born.pop(ref, 0.0)
            self._early_deaths = self._early_deaths + 1 if lived < EARLY_DEATH_S else 0
            if self._early_deaths >= CRASH_LOOP:
                raise RuntimeError(
                    f"rollout workers die right after they start ({self._early_deaths} in a row, each "
                    f"within {EARLY_DEATH_S:.0f} s); the last one: {why}"
                )
            self.restarts.count("rollout_workers", why, error_of(ref), "rollout worker")
            log.warning(
                "rollout worker %s; starting a replacement (its unfinished prompts are reissued once its "
                "lease expires, buffer.worker_lease_s)",
                why,
            )
            kill(actor)
            self.add_workers(1)
        return bool(done)

    def check_engines(self) -> bool:
        """Replace engines whose process died, or that stayed out of the registry for LAPSED_S (hung).
        True when one was replaced."""
        import ray

        if not self.engines or self.closing:
            return self.check_pending()
        done, _ = ray.wait(self.engine_watch, num_returns=len(self.engine_watch), timeout=0)
        failed: dict[int, tuple[str, BaseException | None]] = {}  # index -> (why, its error)
        for i, ref in enumerate(self.engine_watch):
            if ref not in done:
                continue
            if i in self._starting:  # a replacement's start() answered
                self._started(i, ref, failed)
            else:
                failed[i] = (f"died ({outcome(ref)})", error_of(ref))
        now = time.monotonic()
        for i in sorted(self._starting):  # Ray keeps a replacement no node has room for queued: say so
            if i not in self._waiting and (waited := now - self._starting_since[i]) >= PLACEMENT_WAIT_S:
                running = len(self.engines) - len(self._starting)
                note = supervise.waiting_for_room(self.spec.generators, waited, running)
                self._waiting[i] = note
                self._note(note, self._starting[i], i)
        if now >= self._next_registry_check:
            self._next_registry_check = now + 1.0
            reg = EngineRegistry(self.r, self.job)
            present = set(reg.live()) | set(reg.joining())
            for i, url in enumerate(self.engine_urls):
                if url in present or i in self._starting:
                    self._lapsed_since.pop(url, None)
                elif now - self._lapsed_since.setdefault(url, now) >= LAPSED_S and i not in failed:
                    hung = f"is hung (no registry lease for {now - self._lapsed_since[url]:.0f} s)"
                    failed[i] = (hung, None)
        for i, (why, error) in sorted(failed.items()):
            self._replace_engine(i, why, error)
        return self.check_pending() | bool(failed)

    def _replace_engine(self, i: int, why: str, error: BaseException | None = None) -> None:
        """Kill engine i (`why`: how it failed, `error`: its exception if any) and start its replacement;
        the loop goes on meanwhile (a start takes seconds, more on a loaded host) and `_started` takes the
        new engine in when its start() answers."""
        old, url = self.engines[i], self.engine_urls[i]
        self._failures[i] = self.restarts.count("engines", why, error, f"engine {url}")
        log.warning("engine %s %s; replacing it (its requests are retried on the other engines)", url, why)
        kill(old)
        for key in (engines_key(self.job), joining_key(self.job)):
            self.r.zrem(key, url)  # rollout workers stop routing to it at their next refresh
        self._lapsed_since.pop(url, None)
        new = launch_engine(
            self.spec,
            self.redis_url,
            self.api_key,
            self._next_engine,
            joining=True,
            placement=self.placement,
            slot=i,
        )
        self._next_engine += 1
        self.engines[i], self.engine_watch[i] = new, new.start.remote()
        self._starting[i] = url
        self._starting_since[i] = time.monotonic()
        self._waiting.pop(i, None)

    def _note(self, action: str, url: str, i: int) -> None:
        """Engine i's failure gets `action` (what became of its replacement) and is shown in the status
        again, whatever failed since (a node's rollout workers die with its engine)."""
        log.warning("engine %s: %s", url, action)
        if (failure := self._failures.get(i)) is not None:
            failure.action = action
            self.restarts.latest = failure
            self.restarts.report(failure)

    @property
    def engine_states(self) -> tuple[int, int, int]:
        """(running, starting, waiting) launched engines: started; a scale up's or a replacement not
        started yet; of those, the ones waiting for a node with room (slipstream_job_engines)."""
        replacing = len(self._starting)
        return len(self.engines) - replacing, len(self._pending) + replacing, len(self.waiting_notes)

    @property
    def waiting_notes(self) -> dict[str, str]:
        """Replaced engine's URL, or `engine-N` for one a scale up added -> what the replacement or the new
        engine waits for (a node with room), while it waits."""
        notes = {self._starting[i]: note for i, note in self._waiting.items() if i in self._starting}
        return notes | {f"engine-{i}": note for i, note in self._pending_notes.items()}

    def replacing(self, i: int) -> bool:
        """Engine i is a replacement still starting."""
        return i in self._starting

    def _started(self, i: int, ref, failed: dict[int, tuple[str, BaseException | None]]) -> None:
        import ray

        # engine i counts as replacing until its new URL is in place: a reader (status, a test's thread)
        # never sees the new engine without its URL
        old_url = self._starting[i]
        waited, waiting = time.monotonic() - self._starting_since.pop(i, time.monotonic()), i in self._waiting
        self._waiting.pop(i, None)
        try:
            new_url = ray.get(ref)
        except Exception as e:
            self._starting.pop(i)
            failed[i] = (f"(a replacement) did not start: {died(e)}", e)
            return
        if waiting:
            self._note(
                f"restarted; the replacement started after waiting {waited:.0f} s for room", old_url, i
            )
        self._failures.pop(i, None)
        self.engine_urls[i], self.engine_watch[i] = new_url, self.engines[i].watch.remote()
        self.rollout_urls = [new_url if u == old_url else u for u in self.rollout_urls]
        self._starting.pop(i)
        log.info("engine %s replaced by %s (it takes traffic after the next weight update)", old_url, new_url)

    # --- evaluation -----------------------------------------------------------------------------------
    def start_evaluator(self) -> None:
        """The evaluator of a spec with `eval` (none otherwise), on the rollout URLs. Built-in engines
        schedule its requests after the rollouts' (SGLang `priority`); other engines get no priority field
        (SGLang takes it only with --enable-priority-scheduling) and serve both alike."""
        from generator_fleet.evaluation import EVAL_PRIORITY
        from slipstream.job.actors import EvalActor

        cfg = self.spec.eval_config()
        if cfg is None:
            return
        priority = EVAL_PRIORITY if self.spec.generators.engine == "builtin" else None
        self.evaluator = EvalActor.options(resources=dict(self.spec.generators.resources)).remote(
            cfg, self.redis_url, self.rollout_urls, self.api_key, priority, self.eval_restarts
        )
        self.eval_run = self.evaluator.run.remote()

    def check_evaluator(self) -> bool:
        """Replace an evaluator that died (at most MAX_EVAL_RESTARTS times). True when one was."""
        import ray

        if self.eval_run is None or self.closing:
            return False
        done, _ = ray.wait([self.eval_run], timeout=0)
        if not done:
            return False
        why = outcome(self.eval_run)
        kill(self.evaluator)
        self.evaluator = self.eval_run = None
        self.eval_restarts += 1
        if self.eval_restarts > MAX_EVAL_RESTARTS:
            log.error("evaluator %s; %d replacements already: no more evaluation in this job", why,
                      MAX_EVAL_RESTARTS)  # fmt: skip
            return False
        log.warning("evaluator %s; starting a new one (evaluation never fails the job)", why)
        self.start_evaluator()
        return True

    def evaluate_now(self) -> dict | None:
        """Evaluate the engines' current version now (unless it was), waiting at most eval.timeout_s; its
        eval record, or None when there is no evaluator or the evaluation failed (logged)."""
        import ray

        if self.evaluator is None:
            return None
        timeout = self.spec.eval.timeout_s
        ref = self.evaluator.evaluate_now.remote(timeout)
        if not self._wait([ref], timeout + STOP_TIMEOUT_S):
            log.error("evaluation asked for gave no answer within %.0f s; going on without it", timeout)
            return None
        try:
            return ray.get(ref)
        except Exception as e:  # the evaluator died: check_evaluator replaces it
            log.error("evaluation asked for failed: %s", outcome(ref) or e)
            return None

    def continue_engines(self) -> None:
        """A trainer that died between pause and continue of a weight update left the engines paused; one
        that died mid-step on the colocated sync schedule left them released (their memory is resumed,
        and the new pool publishes its weights to them at its start)."""
        from weight_bus.colocation import resume_engines
        from weight_bus.engine_client import continue_engines

        if self.spec.schedule == "sync":
            for url, e in resume_engines(self.engine_urls, self.api_key, timeout_s=10.0).items():
                log.info("engine %s: resume after the trainer's death: %s (it was not released)", url, e)
        for url, e in continue_engines(self.engine_urls, self.api_key, timeout_s=10.0).items():
            log.warning("engine %s: continue after the trainer's death failed: %s", url, e)

    # --- alone ----------------------------------------------------------------------------------------
    def fill(self, groups: int, timeout_s: float, poll_s: float = 0.05) -> list[tuple[float, int]]:
        """Wait until the job's buffer has had `groups` groups produced (no trainer needed: nothing waits
        on one when buffer.max_staleness admits them). Returns (monotonic time, groups produced) every
        poll_s. RuntimeError when a rollout worker exits, TimeoutError after timeout_s."""
        import ray

        key = ReplayBuffer(self.r, self.job).keys.stats
        runs = [ref for _, ref in self.workers]
        marks: list[tuple[float, int]] = []
        t_begin = time.monotonic()
        while True:
            produced = int(self.r.hget(key, "produced") or 0)
            marks.append((time.monotonic(), produced))
            if produced >= groups:
                return marks
            done, _ = ray.wait(runs, timeout=0)
            if done:
                ray.get(done)
                raise RuntimeError("a rollout worker exited while the generators filled the buffer")
            if time.monotonic() - t_begin > timeout_s:
                raise TimeoutError(f"generators: {produced}/{groups} groups after {timeout_s} s")
            time.sleep(poll_s)

    def stop_workers(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Tell every rollout worker to stop after its groups, and wait for them (at most timeout_s)."""
        import ray

        for a, _ in self.workers:
            a.stop.remote()
        ray.wait([ref for _, ref in self.workers], num_returns=len(self.workers), timeout=timeout_s)

    def close(self, others: list | None = None) -> None:
        """Stop the workers, then the engines (politely), then kill all, `others` too (stop_actors)."""
        self.closing = True
        if self.evaluator is not None:
            self.evaluator.stop.remote()
        self.stop_workers()
        evaluator = [self.evaluator] if self.evaluator is not None else []
        pending = [p.actor for p in self._pending]  # not started: killed (a stop() would wait for a node)
        self._pending, self._pending_notes = [], {}
        stop_actors(
            self.engines + self.attached, [a for a, _ in self.workers] + evaluator + pending + (others or [])
        )
        self.evaluator = self.eval_run = None
        self.engines, self.attached, self.engine_urls, self.engine_watch = [], [], [], []
        self.workers = []


def generators_only(spec: JobSpec, redis_url: str, groups: int, timeout_s: float) -> tuple:
    """The generators alone (on a running Ray): the spec's engines and rollout workers fill the job's
    buffer with `groups` groups, no trainer consuming them (buffer.max_staleness must admit that many
    versions ahead of version 0). Returns (the pool, its engines still up and its workers stopped, for a
    trainer to publish to or for `close`; the fill's (time, groups produced) marks)."""
    buffer = ReplayBuffer(connect(redis_url), spec.name)
    buffer.ensure_group()
    buffer.set_version(0)
    pool = GeneratorPool(spec, redis_url)
    try:
        pool.start(spec.generators.num_engines)
        marks = pool.fill(groups, timeout_s)
        pool.stop_workers()
    except BaseException:
        pool.close()
        raise
    return pool, marks
