"""What the job's pools share to supervise their Ray actors: the restart budget, how a finished call
ended, a kill that tolerates the dead, and a wait that keeps the caller's progress flowing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("slipstream.job.supervise")

STOP_TIMEOUT_S = 30.0
"""How long actors told to stop get before they are killed."""
POLL_S = 0.5
"""How often a waiting pool lets its caller read progress (and the driver reads desired state)."""
MAX_RESTARTS = 20
"""Replacements of one kind (rollout worker, engine, trainer pool) a job survives; one more fails it: a
crash loop is a bug to report, not bad luck to retry forever."""


class Restarts(dict):
    """Replacements so far, by kind: {"rollout_workers", "engines", "trainer_pool"}; shared by the pools
    of one job and reported in its status."""

    def __init__(self) -> None:
        super().__init__(rollout_workers=0, engines=0, trainer_pool=0)

    def count(self, kind: str, why: str = "") -> None:
        """One more replacement of `kind`; RuntimeError past MAX_RESTARTS."""
        self[kind] += 1
        if self[kind] > MAX_RESTARTS:
            raise RuntimeError(
                f"{kind}: more than {MAX_RESTARTS} replacements; giving up. The last one {why} (see the logs)"
            )


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


def outcome(ref, failed_only: bool = False) -> str | None:
    """How a finished Ray call ended, in a few words (None with failed_only when it returned)."""
    import ray

    try:
        value = ray.get(ref)
    except Exception as e:  # RayActorError (killed, OOM), or the actor's own exception
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [""]
        cause = f" ... {lines[-1][:300]}" if len(lines) > 1 else ""  # a task error's traceback ends in it
        return f"died: {type(e).__name__}: {lines[0][:200]}{cause}"
    return None if failed_only else f"exited ({value})"


def kill(actor) -> None:
    """ray.kill, for an actor that may be gone already."""
    import ray

    try:
        ray.kill(actor)
    except Exception as e:  # already gone
        log.debug("ray.kill: %s", e)
