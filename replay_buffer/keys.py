"""Redis key layout of one job; every key lives under `slipstream:{job}:` so jobs never collide."""

from __future__ import annotations

import msgspec

TRAINER_GROUP = "trainers"
"""The one consumer group of the trainer pool on a job's stream."""


class JobKeys(msgspec.Struct, frozen=True):
    job: str

    def _k(self, name: str) -> str:
        return f"slipstream:{self.job}:{name}"

    @property
    def groups(self) -> str:
        """Stream of msgpack GroupRecords."""
        return self._k("groups")

    @property
    def dead_letter(self) -> str:
        """Stream of records that failed to decode/validate, with the reason."""
        return self._k("dead")

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
        """Stream of per-step trainer progress records (JSON), read by the driver and the CLI."""
        return self._k("progress")

    @property
    def run(self) -> str:
        """Hash of the current run: run_id, attempt (1, +1 per resume), started_at (Redis time, seconds, of
        the run's clock origin: elapsed_s = now - started_at, one clock for every trainer pool of the run),
        trims (times progress records of lost steps were dropped)."""
        return self._k("run")

    def per_run(self) -> list[str]:
        """Every key a run writes (not the control records of slipstream/cluster/job_store.py): a new run of the same
        job name deletes them all. `inflight:<worker>` lists are found through the `workers` zset."""
        names = (
            "groups", "dead", "version", "started", "trained", "reservations", "workers", "recycle",
            "reissue", "ledger", "stats", "staleness", "progress", "run",
            "engines", "engines:joining", "metrics_targets",
        )  # fmt: skip
        return [self._k(n) for n in names]
