"""The trainer pool of one job: its ranks (one Ray actor each, FSDP2 across them), rescaled through a
checkpoint, and restarted from the latest one when a rank dies.

- Rescale to M ranks: the pool stops after its current step with a checkpoint, and a pool of M ranks
  resumes from it (FSDP2 reshards); generators keep filling the buffer meanwhile.
- A rank that dies takes the pool down: every rank is killed, `before_restart` runs (the driver tells the
  engines to continue: a rank 0 that died mid-update leaves them paused), and a pool of the same size
  resumes from the latest checkpoint of this run (or the initial model if none was written); the groups
  it had read but not committed are redelivered to the new rank 0, and the commit ledger never trains a
  group twice. The job's restart budget (slipstream/job/supervise.py) decides whether it is restarted: a
  rank that runs out of memory again on the same batch, or finds its disk full, fails the job instead,
  with the cause and the keys to change.

`trainer_only` runs one rank alone on a job's existing (recorded or pre-filled) stream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec

from jobspec import JobSpec
from slipstream.job.placement import Colocation, require_resources
from slipstream.job.store import job_checkpoint_dir
from slipstream.job.supervise import OTHER, Failure, Restarts, classify, died, error_of, kill, wait_all
from trainer.result import TrainerResult

log = logging.getLogger("slipstream.job.trainers")


def _checkpoint_state(path: str) -> dict:
    """A checkpoint's trainer_state ({} when unreadable): its `version`, and the `run_id` that wrote it
    (absent: written before runs had ids)."""
    from trainer import checkpoint

    try:
        return json.loads((Path(path) / checkpoint.STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _checkpoint_version(path: str, spec: JobSpec) -> int | None:
    """The version of the checkpoint `path` (or `latest`) names; None when there is none."""
    from trainer import checkpoint

    try:
        return _checkpoint_state(str(checkpoint.resolve(path, job_checkpoint_dir(spec)))).get("version")
    except FileNotFoundError:
        return None


class TrainerPool:
    """A job's trainer ranks on Ray. `endpoints()` gives the engines to publish to and their key, now (a
    restarted pool publishes to the engines of the moment); `before_restart` runs between a dead pool and
    its replacement; `between` is called while the pool waits on its ranks (the driver reads progress
    there); `restarts` is the job's replacement budget. `run_id` is the job's run: a checkpoint of another
    run is never resumed from. Nothing starts before `start`."""

    def __init__(
        self,
        spec: JobSpec,
        redis_url: str,
        endpoints: Callable[[], tuple[list[str], str | None]] = lambda: ([], None),
        restarts: Restarts | None = None,
        between: Callable[[], None] | None = None,
        before_restart: Callable[[], None] | None = None,
        placement: Colocation | None = None,
    ) -> None:
        self.spec, self.redis_url = spec, redis_url
        self.placement = placement
        """Colocated: rank i shares device slot i with engine i (slipstream/job/placement.py)."""
        self.endpoints, self.between, self.before_restart = endpoints, between, before_restart
        self.restarts = restarts if restarts is not None else Restarts()
        self.run_id: str | None = None
        self.ranks: list = []
        self._spawned: int | None = None
        """`spawn(m)` created m ranks that `start(m)` sets up."""
        self.runs: list = []  # each rank's run() call, once the pool is set up and training
        self.closing = False

    @property
    def size(self) -> int:
        """Ranks set up and training (not those still starting)."""
        return len(self.runs)

    def _get(self, refs: list) -> list:
        import ray

        wait_all(refs, None, self.between)
        return ray.get(refs)

    def spawn(self, m: int) -> None:
        """Create m ranks' processes now, for `start(m)` to set up: their imports and the model check run
        while the engines start (the engines' endpoints are not needed before `start`)."""
        self.ranks = self._create(m)
        self._spawned = m

    def start(self, m: int, resume_from: str | None = None) -> None:
        """m ranks (from `resume_from`, a checkpoint, if given), set up and training."""
        if not (self._spawned == m and resume_from is None):
            self.ranks = self._create(m, resume_from)
        self._spawned = None
        engine_urls, api_key = self.endpoints()
        master = self._get([self.ranks[0].rendezvous.remote(self._master_host())])[0] if m > 1 else None
        self._get([t.setup.remote(engine_urls, api_key, master) for t in self.ranks])
        self.runs = [t.run.remote() for t in self.ranks]
        log.info("trainer pool: %d ranks%s", m, f", resumed from {resume_from}" if resume_from else "")

    def _create(self, m: int, resume_from: str | None = None) -> list:
        """m rank actors (not set up yet)."""
        from slipstream.job.actors import TrainerActor

        trainer = {"num_trainers": m, **({"resume_from": resume_from} if resume_from else {})}
        spec = msgspec.structs.replace(
            self.spec, trainer=msgspec.structs.replace(self.spec.trainer, **trainer)
        )
        require_resources("trainer.resources", spec.trainer.resources)
        config = spec.trainer_config()
        opts = [self._resources(r) for r in range(m)]
        return [TrainerActor.options(**opts[r]).remote(config, self.redis_url, r, m) for r in range(m)]

    @staticmethod
    def _master_host() -> str | None:
        """127.0.0.1 while the Ray cluster is one node (every rank is on it), so that the group's store and
        transports listen on loopback only: Ray reports the host's external IP as the node's address even
        for a cluster on 127.0.0.1. None (rank 0's node IP) across nodes."""
        import ray

        return "127.0.0.1" if len([n for n in ray.nodes() if n.get("Alive")]) == 1 else None

    def _resources(self, rank: int) -> dict:
        """Ray options of rank `rank`: a whole GPU each on cuda, or its colocated device slot's share."""
        if self.placement is not None:
            return self.placement.trainer(rank)
        gpus = 1 if self.spec.trainer.device == "cuda" else 0
        return {"num_gpus": gpus, "resources": dict(self.spec.trainer.resources)}

    def stop(self, checkpoint: bool) -> None:
        """The pool ends after its current step (with a checkpoint there if `checkpoint`)."""
        self.ranks[0].stop.remote(False, checkpoint)

    def request_checkpoint(self) -> None:
        self.ranks[0].request_checkpoint.remote()

    def rescale(self, m: int) -> TrainerResult | None:
        """Checkpoint, stop the pool, start one of m ranks from that checkpoint. Returns the old pool's
        result if it had finished the job before it could be stopped (then nothing restarts)."""
        import ray

        have = len(self.ranks)
        self._get([self.ranks[0].stop.remote(True)])
        results = self._get(self.runs)
        for t in self.ranks:
            ray.kill(t)
        result = results[0]
        if not result.restart or not result.checkpoint:
            return result  # the job ended (last step) before the stop took effect
        self.start(m, resume_from=result.checkpoint)
        log.info(
            "trainers %d -> %d at version %d (checkpoint %s)",
            have,
            m,
            result.version,
            result.checkpoint,
        )
        return None

    def check(self) -> tuple[TrainerResult | None, bool]:
        """(the pool's result once every rank finished, else None; whether the pool was restarted because
        a rank died)."""
        import ray

        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        failed = [(self.runs.index(ref), e) for ref in done if (e := error_of(ref)) is not None]
        if failed and self.closing:
            rank, error = failed[0]
            raise RuntimeError(f"trainer rank {rank} {died(error)} while the job was closing")
        if failed:
            # the rank whose error has a class is the cause; the others' (a peer gone from a collective)
            # follow from it
            rank, error = min(failed, key=lambda f: (classify(f[1])[0] == OTHER, f[0]))
            self.restart(f"trainer rank {rank}", error)
            return None, True
        if len(done) == len(self.runs):
            return ray.get(self.runs[0]), False
        return None, False

    def restart(self, who: str, error: BaseException) -> Failure:
        """Kill every rank and start a pool of the same size from this run's latest checkpoint, `who`
        having failed with `error`, unless the job's restart budget is spent (GiveUp: every rank is
        killed). Returns the failure, with the version the new pool resumed at."""
        from trainer import checkpoint

        m = len(self.ranks)
        try:
            failure = self.restarts.count("trainer_pool", died(error), error, who)
        except Exception:
            for t in self.ranks:
                kill(t)  # the other ranks may wait in a collective for the one that failed
            raise
        for t in self.ranks:
            kill(t)
        if self.before_restart is not None:
            self.before_restart()
        try:
            resume = str(checkpoint.resolve(checkpoint.LATEST, job_checkpoint_dir(self.spec)))
        except FileNotFoundError:
            resume = None
        if resume and (theirs := _checkpoint_state(resume).get("run_id")) not in (None, self.run_id):
            log.warning(
                "latest checkpoint %s belongs to run %s, not this one: not resumed from", resume, theirs
            )
            resume = self.spec.trainer.resume_from
        failure.resumed_at = _checkpoint_version(resume, self.spec) if resume else None
        log.warning(
            "%s failed (%s); restarting the pool of %d ranks from %s",
            who,
            failure.cause or failure.error_class,
            m,
            f"{resume} (version {failure.resumed_at}: the steps after it are trained again)"
            if resume
            else "the initial model (no checkpoint was written yet: trainer.checkpoint_every)",
        )
        self.start(m, resume_from=resume)
        return failure

    def close(self) -> None:
        """Kill every rank."""
        self.closing = True
        for t in self.ranks:
            kill(t)
        self.ranks, self.runs = [], []


def trainer_only(
    spec: JobSpec,
    redis_url: str,
    engine_urls: list[str] | None = None,
    api_key: str | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> tuple[TrainerResult, list[dict]]:
    """The trainer alone (on a running Ray): one rank of `spec` trains on the job's existing stream (a
    recorded one, or one generators filled) until algorithm.total_steps, publishing to `engine_urls` if
    any. Calls on_record with each progress record as it arrives. Returns (the rank's result, every
    progress record of the run)."""
    import ray

    from replay_buffer.client import connect
    from slipstream.job.progress import ProgressReader

    pool = TrainerPool(spec, redis_url, endpoints=lambda: (list(engine_urls or []), api_key))
    r = connect(redis_url)
    reader = ProgressReader(r, spec.name)
    try:
        pool.start(1)
        run = pool.runs[0]
        while True:
            done, _ = ray.wait([run], timeout=0)
            recs = reader.read(block_ms=0 if done else 500)
            for rec in recs:
                if on_record is not None:
                    on_record(rec)
            if done and not recs:
                return ray.get(run), reader.records
    finally:
        pool.close()
        r.close()
