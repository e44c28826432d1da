"""What a trainer pool's run ends with (`Trainer.run`, every rank alike): the job driver reads it to
restart the pool from its checkpoint (a rescale) or to write the job's final status
(slipstream/job/driver.py `final_status`)."""

from __future__ import annotations

import msgspec


class TrainerResult(msgspec.Struct, kw_only=True):
    """The end of one trainer pool's run."""

    version: int
    """Policy version the pool ended at (optimizer batches trained in the run)."""
    elapsed_s: float = 0.0
    """Seconds the pool's run took on this rank (monotonic clock)."""
    final_model: str = ""
    """The HF export of the final policy (<output_dir>/final_model); "" when none was written (export_hf
    off, or a pool that stopped to be restarted)."""
    checkpoint: str = ""
    """The pool's last checkpoint (written at its end when one was due, else its newest); "" if none."""
    checkpoint_version: int | None = None
    """That checkpoint's version; None when there is none."""
    restart: bool = False
    """The pool stopped to be restarted (a rescale, a replacement): its checkpoint is where the next pool
    resumes, and no final export was written."""
