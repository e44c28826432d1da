"""How the control plane knows whether a job's driver runs: it asks Ray about the job's submission id
(derived and recorded before Ray is called), never goes by a timer. A job Ray runs or has queued stays as
it is; one whose submission Ray says ended, never got or no longer knows, without its driver's report, is
marked ended, and that ends the submission for good (its run lease freed, no driver can start for it
later: slipstream/job/lease.py). A mixin of JobControl (slipstream/cluster/control.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from slipstream.job import lease
from slipstream.job.records import Status, known, merged
from slipstream.job.store import ACTIVE_STATES, NO_POOLS, resume_fields

log = logging.getLogger("slipstream.cluster.control")

RAY_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
RAY_ENDED = RAY_TERMINAL + ("GONE",)
"""Ray's word that a submission has no driver running: ended, or unknown to Ray (never got it, or its
head was restarted since)."""


class DriverReconciler:
    """Needs `ray` (Ray's JobSubmissionClient), `store` (JobStore), `r` (Redis), `_submitting` (the
    names this process is submitting now)."""

    def _ray_status(self, ray_id: str) -> tuple[str, str]:
        """(status, message) of a Ray job: Ray's status, `GONE` if Ray does not know the job (its head
        was restarted: job records do not survive it), `UNKNOWN` if Ray cannot be asked."""
        try:
            info = self.ray.get_job_info(ray_id)
        except RuntimeError as e:  # the SDK's answer to an HTTP error status
            if "status code 404" in str(e):
                return "GONE", f"Ray has no job {ray_id} (the cluster was restarted since it started)"
            return "UNKNOWN", str(e)
        except Exception as e:  # Ray down or unreachable
            return "UNKNOWN", f"{type(e).__name__}: {e}"
        return str(getattr(info.status, "value", info.status)), info.message or ""

    def _reconcile(self, name: str, st: Status) -> Status:
        """An active job whose submission Ray says ended (or Ray never got it, or no longer knows it)
        without its driver having reported an end is marked `interrupted` (`failed` if Ray says the
        driver failed) with the reason and its latest checkpoint, so that it can be resubmitted (resumed
        with `trainer.resume_from: latest`) and no command finds it stuck. Decided by asking Ray about
        the job's submission id, never by a timer: a job Ray runs (or has queued) stays as it is, and
        so does one Ray cannot be asked about. Marking it ends its submission (JobStore.settle): its run
        lease is freed and no driver can start for it later. Adds `ray_status` to the status."""
        if name in self._submitting:  # this process is submitting it: Ray may not have it yet
            return merged(st, ray_status="submitting")
        seen: dict[str, str] = {}

        def decide(cur: Status, held: bytes | None) -> dict | None:
            sid = cur.ray_job_id
            if sid:
                ray_status, message = self._ray_status(sid)
                seen["ray_status"] = ray_status if ray_status != "UNKNOWN" else f"unknown ({message})"
            elif cur.state in ACTIVE_STATES and not held:  # a record from before submission ids
                ray_status, message = "GONE", ""
            else:
                return None
            if cur.state not in ACTIVE_STATES or ray_status not in RAY_ENDED:
                return None
            return self._ended(name, cur, ray_status, message)

        if st.state in ACTIVE_STATES:
            st = self.store.settle(name, decide)
        else:
            decide(st, None)  # only Ray's word on it, for `status`
        return merged(st, **seen)

    def _ended(self, name: str, st: Status, ray_status: str, message: str) -> dict[str, Any]:
        """The status fields of a job whose submission ended without its driver's report."""
        sid = st.ray_job_id or None
        if ray_status == "FAILED":
            new, why = "failed", f"the driver failed: {message}"
        elif ray_status == "STOPPED" and self.store.desired(name).stop:
            new, why = "stopped", f"stopped by Ray before the driver could report: {message}"
        elif ray_status == "GONE" and not st.driver:
            new, why = (
                "interrupted",
                (
                    f"the job never started: Ray has no submission {sid} (the control API stopped while "
                    "submitting it); no driver ran it, and none will"
                    if sid
                    else "the job never started: its submission never reached Ray"
                ),
            )
        elif ray_status == "GONE":
            new, why = (
                "interrupted",
                f"the driver is gone: Ray no longer knows submission {sid} (the cluster restarted)",
            )
        else:
            new, why = "interrupted", f"the driver is gone without reporting an end: {message or ray_status}"
        resume = resume_fields(json.loads(self.store.spec_json(name) or "{}"))
        error = f"{why}; last reported version {known(st.version, 0)}; {resume['note']}"
        log.warning("job %s: %s -> %s: %s", name, known(st.state), new, error)
        return {"state": new, "error": error, "phase": None, "pools": NO_POOLS, **resume}

    def reconcile(self) -> list[str]:
        """Mark every active job whose driver is gone (the control API does it at start-up: after a
        cluster restart no job is left `running` with nothing running it). The jobs marked."""
        marked = []
        for name in self.store.names():
            st = self.store.status(name)
            if st.state in ACTIVE_STATES and self._reconcile(name, st).state not in ACTIVE_STATES:
                marked.append(name)
        return marked

    def _free_lease(self, name: str) -> str | None:
        """Free `name`'s run lease if Ray says its holder's submission ended (or does not know it);
        else why the name is still taken (the driver that may still run)."""
        held = lease.holder(self.r, name)
        if held is None:
            return None
        raw, who = held
        ray_status, message = self._ray_status(str(who.get("submission")))
        if ray_status not in RAY_ENDED:
            return (
                f"job {name!r} still has a driver: {lease.describe(who)}, Ray: {ray_status.lower()} "
                f"{message}; stop it first (slipstream stop {name} --force)"
            )
        if lease.release(self.r, name, raw):
            log.warning("job %s: freed the run lease of %s (Ray: %s)", name, lease.describe(who), ray_status)
        return None

    def _abandon(self, name: str, sid: str, error: str) -> None:
        """End submission `sid` that Ray never got: `failed`, and no driver can start for it later."""
        self.store.settle(
            name,
            lambda st, held: (
                None
                if st.ray_job_id != sid or held
                else {"state": "failed", "error": error, "phase": None, "pools": NO_POOLS}
            ),
        )
