"""The `tracking` section: where a job's per-step metrics, eval results and config go besides Redis and the
end-of-job report: TensorBoard event files and W&B (slipstream/job/tracking.py writes them, in the job's
driver process)."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from common.config import Spec, bad

WANDB_MODES = ("offline", "online", "disabled")
"""W&B's own modes (`WANDB_MODE`): offline writes the run under the job's output_dir only; online also
uploads (it needs credentials in the driver's environment, e.g. WANDB_API_KEY); disabled writes nothing."""
_WANDB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class WandbSpec(Spec):
    enabled: bool = False
    """Log to W&B too (the `wandb` package must be installed where the job's driver runs; without it the
    job runs and one warning says so)."""
    project: str = "slipstream"
    """W&B project."""
    run_name: str | None = None
    """W&B run name; null = the job's name."""
    mode: Literal[WANDB_MODES] = "offline"
    """offline (default: files under `<output_dir>/wandb/`, upload later with `wandb sync`), online, or
    disabled."""
    entity: str | None = None
    """W&B entity (team or user); null = the default of the credentials."""

    def __post_init__(self) -> None:
        if not _WANDB_NAME.fullmatch(self.project):
            raise bad("project", f"{self.project!r}: letters, digits, `_`, `.`, `-`, at most 128 characters")


class TrackingSpec(Spec):
    tensorboard: bool = True
    """Write TensorBoard event files to `<output_dir>/tensorboard/` (`tensorboard --logdir` on it)."""
    wandb: WandbSpec = msgspec.field(default_factory=WandbSpec)
    """W&B (off by default)."""
