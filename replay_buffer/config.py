"""The replay buffer's config: staleness, redelivery and worker leases (`BufferSpec`), and the Redis
server that holds it (`RedisSpec`)."""

from __future__ import annotations

from typing import Literal

from common.config import NonNeg, Pos, Seconds, Spec

STALE_POLICIES = ("drop", "recycle", "keep")
"""What happens to a group too stale to train on (`buffer.stale_policy`)."""
ADMISSIONS = ("oldest", "version")
"""What the admission cap counts from (`buffer.admission`)."""


class BufferSpec(Spec):
    max_staleness: NonNeg = 1
    """A group is usable at version v if v - min_version <= max_staleness (versions); 0 = on-policy."""
    stale_policy: Literal[STALE_POLICIES] = "drop"
    """Too-stale groups are dropped; `recycle` also queues their prompt to be generated again first; `keep`
    trains them anyway (with `admission: version`, AReaL's rule: staleness bounded where a group starts,
    not where it is trained; no length bias, and the engines are never held back by a long group; the
    loss's importance weights correct what a long group's staleness adds)."""
    admission: Literal[ADMISSIONS] = "oldest"
    """Rollout workers may have started (base + max_staleness + 1) * groups_per_step groups. `oldest`: base
    is the admission version of the oldest group still being generated (or the published version, if
    smaller), so groups started later cannot overtake a long one until it is stale: with
    bus.update_every 1, no group is dropped as stale and long responses are trained as often as they are
    generated. `version`: base is the published version (AReaL's rule); a long group can be overtaken and
    dropped, which biases training towards short responses."""
    read_block_ms: Pos = 1000
    """How long one XREADGROUP waits for new groups (milliseconds)."""
    reclaim_idle_ms: Pos = 30_000
    """Entries a trainer read but did not commit for this long are claimed by another (milliseconds)."""
    worker_lease_s: Seconds = 30.0
    """A rollout worker silent for this long is presumed dead; its admission reservations are released
    and the prompts it had in flight are generated again by the others."""
    ledger: bool = False
    """Also record every trained group_id, in order, in the list `slipstream:{job}:ledger` (one entry
    per group: audits, fault-injection tests); off by default (it grows with the job)."""


class RedisSpec(Spec):
    url: str | None = None
    """redis:// URL of an existing server; null = start a private managed instance for the job."""
    appendfsync: Literal["everysec", "always"] = "everysec"
