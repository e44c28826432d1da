"""The `supervision` section: how many times the job driver replaces a failed process before it fails the
job instead (slipstream/job/supervise.py applies it). A failure that will happen again however often it is
retried (out of memory on the same batch, a full disk) ends the job with its cause and the setting to
change after a few restarts, instead of looping on restarts that each lose the steps since the last
checkpoint."""

from __future__ import annotations

from common.config import NonNeg, Spec, bad


class SupervisionSpec(Spec):
    max_restarts: NonNeg = 20
    """Replacements of one kind (rollout workers, engines, the trainer pool) a job survives, whatever their
    cause; one more fails the job (a crash loop is a bug to report, not bad luck to retry forever)."""
    out_of_memory_restarts: NonNeg = 2
    """Restarts after an out-of-memory failure (torch.OutOfMemoryError, "CUDA out of memory", Ray's memory
    monitor) that repeats: the same kind of process ran out of memory again, with no version trained past
    the one the previous failure happened at (the restarted trainer is handed the same uncommitted batch
    and runs out again). One more fails the job with the cause and the keys that lower memory use."""
    disk_full_restarts: NonNeg = 0
    """Restarts after a full disk (ENOSPC, errno 28; or a disk quota, errno 122) that repeats as above;
    0 = the first one fails the job, with the path and the free space there (a restart would write the same
    checkpoint to the same disk)."""

    def __post_init__(self) -> None:
        for key in ("out_of_memory_restarts", "disk_full_restarts"):
            if getattr(self, key) > self.max_restarts:
                raise bad(
                    key,
                    f"{getattr(self, key)} exceeds max_restarts {self.max_restarts}, which would end the job "
                    "first: raise max_restarts too",
                )
