"""Redis key layout of one job; every key lives under `slipstream:{job}:` so jobs never collide."""

from __future__ import annotations

import msgspec

TRAINER_GROUP = "trainers"
"""The one consumer group of the trainer pool on a job's stream."""
KEY_PREFIX = "slipstream:"
"""Every Slipstream key starts with this; a job's keys with `slipstream:{job}:`."""
ALL_KEYS = f"{KEY_PREFIX}*"
"""Key pattern of every Slipstream key (the control plane's ACL user)."""
JOBS_INDEX = f"{KEY_PREFIX}control:jobs"
"""Hash job name -> submission time: every job the cluster knows (`control` is not a job name)."""
METRICS_TARGETS = "metrics_targets"
METRICS_TARGETS_PATTERN = f"{KEY_PREFIX}*:{METRICS_TARGETS}"
"""SCAN pattern of every job's `metrics_targets` hash."""


def jobs_pattern(name_prefix: str) -> str:
    """SCAN pattern of the keys of every job whose name starts with `name_prefix`."""
    return f"{KEY_PREFIX}{name_prefix}*"


def job_of_metrics_targets(key: str) -> str:
    """The job name in a `slipstream:{job}:metrics_targets` key."""
    return key[len(KEY_PREFIX) : -len(METRICS_TARGETS) - 1]


class JobKeys(msgspec.Struct, frozen=True):
    job: str

    def _k(self, name: str) -> str:
        return f"{KEY_PREFIX}{self.job}:{name}"

    @property
    def prefix(self) -> str:
        """`slipstream:{job}:`, the start of every key of the job."""
        return self._k("")

    @property
    def pattern(self) -> str:
        """Pattern of every key of the job (SCAN match, ACL key rule)."""
        return self._k("*")

    @property
    def groups(self) -> str:
        """Stream of msgpack GroupRecords."""
        return self._k("groups")

    @property
    def dead_letter(self) -> str:
        """Stream of records that failed to decode/validate, with the reason."""
        return self._k("dead")

    @property
    def model_files(self) -> str:
        """Hash relative path -> bytes: the model directory's files other than weights (config,
        tokenizer), for nodes without model.path (slipstream/job/model_files.py)."""
        return self._k("model_files")

    @property
    def version(self) -> str:
        """Published policy version (int): optimizer steps whose weights every engine holds."""
        return self._k("version")

    @property
    def started(self) -> str:
        """Groups admitted so far (admission control counter)."""
        return self._k("started")

    @property
    def trained(self) -> str:
        """Zset group_id -> min_version of groups used by a committed optimizer step (idempotency).
        Pruned below version - max_staleness: a redelivery that old is stale and never trained anyway."""
        return self._k("trained")

    @property
    def commits(self) -> str:
        """Zset commit id -> version of the trainer's recent commits (scripts.COMMIT): a commit sent again
        by a client's retry after its reply was lost finds its id here and changes nothing. Pruned to the
        last COMMITS_KEPT versions: a retry only ever re-sends the commit its trainer is waiting on."""
        return self._k("commits")

    @property
    def reservations(self) -> str:
        """Hash worker -> admitted groups not yet produced."""
        return self._k("reservations")

    @property
    def workers(self) -> str:
        """Zset worker -> lease expiry (Redis time, ms); expired workers' reservations are released."""
        return self._k("workers")

    @property
    def recycle(self) -> str:
        """List of prompt_ids whose groups were too stale (stale_policy: recycle); generated again first."""
        return self._k("recycle")

    def inflight(self, worker: str) -> str:
        """List of the prompt_ids `worker` is generating groups for right now (admitted, not yet put or
        released). When the worker's lease expires (it died), they move to `reissue`."""
        return self._k(f"inflight:{worker}")

    @property
    def inflight_prefix(self) -> str:
        return self._k("inflight:")

    @property
    def admitted(self) -> str:
        """Hash version -> groups admitted at that version and still in flight (not yet put or released)."""
        return self._k("admitted")

    def admitted_by(self, worker: str) -> str:
        """Hash version -> `worker`'s in-flight groups admitted at that version (released with the worker)."""
        return self._k(f"admitted:{worker}")

    @property
    def admitted_prefix(self) -> str:
        return self._k("admitted:")

    @property
    def lease_keys(self) -> list[str]:
        """KEYS of the scripts that release workers' reservations (scripts.REAP, LEAVE; ADMIT adds `version`
        fourth): started, reservations, workers, reissue, stats, admitted, admit_calls."""
        return [
            self.started, self.reservations, self.workers, self.reissue, self.stats, self.admitted,
            self.admit_calls,
        ]  # fmt: skip

    @property
    def admit_calls(self) -> str:
        """Hash `<worker>:<caller>` -> `<call>:<version>`: the last admission each of a worker's callers
        (its rollout loops) was granted, `:<entry id>` or `:released` appended once its put or release
        ended the slot. A retried call whose first reply was lost (Redis applied it, then the connection
        dropped: replay_buffer/client.py) gets the same answer instead of a second slot, a second copy of
        its group or a slot given back twice."""
        return self._k("admit_calls")

    @property
    def lengths(self) -> str:
        """Hash `trained:<tokens>` / `stale:<tokens>` -> samples of that response length trained, or in
        groups dropped (or recycled) as too stale."""
        return self._k("lengths")

    @property
    def reissue(self) -> str:
        """List of prompt_ids a dead worker had in flight; any worker generates them first."""
        return self._k("reissue")

    @property
    def ledger(self) -> str:
        """List of every trained group_id, in commit order (buffer.ledger: on; audits and fault tests)."""
        return self._k("ledger")

    @property
    def stats(self) -> str:
        """Hash of counters: produced, consumed, dropped_stale, recycled, dead_letter, duplicates, ..."""
        return self._k("stats")

    @property
    def staleness(self) -> str:
        """Hash staleness(versions) -> groups consumed with it."""
        return self._k("staleness")

    @property
    def progress(self) -> str:
        """Stream of progress records: one JSON StepRecord per trainer step and EvalRecord per evaluation
        (replay_buffer/progress.py, the only writer and reader), read by the driver and the CLI."""
        return self._k("progress")

    @property
    def run(self) -> str:
        """Hash of the current run: run_id, attempt (1, +1 per resume), started_at (Redis time, seconds, of
        the run's clock origin: elapsed_s = now - started_at, one clock for every trainer pool of the run),
        trims (times progress records of lost steps were dropped)."""
        return self._k("run")

    @property
    def engines(self) -> str:
        """Zset engine URL -> lease expiry (Redis time, ms) of the engines rollout workers route to."""
        return self._k("engines")

    @property
    def engines_joining(self) -> str:
        """Zset like `engines` of engines that joined mid-job and wait for the current weights."""
        return self._k("engines:joining")

    @property
    def metrics_targets(self) -> str:
        """Hash replica -> host:port where that process serves its Prometheus metrics."""
        return self._k(METRICS_TARGETS)

    # Control records (slipstream/job/store.py): they outlive runs.
    @property
    def spec(self) -> str:
        """The resolved job spec as submitted (JSON)."""
        return self._k("spec")

    @property
    def desired(self) -> str:
        """Hash of what the user wants: pool sizes, stop."""
        return self._k("desired")

    @property
    def status(self) -> str:
        """What the job driver reports (JSON): state, progress."""
        return self._k("status")

    @property
    def commands(self) -> str:
        """List of commands waiting for the job driver."""
        return self._k("commands")

    @property
    def submission(self) -> str:
        """The job's current Ray submission id (slipstream/job/store.py `submission_id`): written
        with the record before Ray is called; only a driver started for it may take the run lease."""
        return self._k("submission")

    @property
    def lease(self) -> str:
        """The run lease (slipstream/job/lease.py): JSON identity of the one driver running the job, set
        NX with a TTL the driver renews; a second driver for the name finds it held and exits."""
        return self._k("lease")

    def per_run(self) -> list[str]:
        """Every key a run writes (not the control records of slipstream/job/store.py): a new run of the same
        job name deletes them all. `inflight:<worker>` lists are found through the `workers` zset."""
        return [
            self.groups, self.dead_letter, self.version, self.started, self.trained, self.commits,
            self.reservations,
            self.workers, self.recycle, self.reissue, self.ledger, self.stats, self.staleness, self.admitted,
            self.admit_calls,
            self.lengths,
            self.progress, self.run, self.engines, self.engines_joining, self.metrics_targets,
        ]  # fmt: skip
