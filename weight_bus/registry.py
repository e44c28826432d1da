"""Engine registry in Redis: engines announce themselves with a lease they keep renewing; rollout workers
route only to engines whose lease is live, so an engine that dies stops receiving traffic within one
lease and an engine that joins mid-job starts receiving it at the workers' next refresh.

Leases are scored in Redis server time (the zset `slipstream:{job}:engines`, member = URL, score =
expiry in ms), so clocks of engine and worker hosts never matter.

An engine that joins mid-job registers as *joining* (`slipstream:{job}:engines:joining`, same leases):
rollout workers do not see it until the weight bus has given it the current weights and promoted it
(`EngineRegistry.promote`). The bus demotes an engine it dropped from its update group (dead, timed
out) by removing it from the live set; if the engine is still alive, its next renewal lands it in the
joining set, and the bus re-syncs it at the next update.
"""

from __future__ import annotations

import logging
import threading

import redis

from replay_buffer.keys import JobKeys

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0

_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
"""


_RENEW = """
-- KEYS: live, joining   ARGV: url, lease_ms, force_live
-- Renew the lease where the engine is: live if it is there (or force_live: a registration at job
-- start, whose weights are the model's), else joining (new mid-job, or demoted by the weight bus).
redis.replicate_commands()
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
if ARGV[3] == '1' or redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return redis.call('ZADD', KEYS[1], expiry, ARGV[1])
end
return redis.call('ZADD', KEYS[2], expiry, ARGV[1])
"""

_PROMOTE = """
-- KEYS: live, joining   ARGV: url   Move a joining engine to the live set, keeping its lease.
local expiry = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not expiry then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], expiry, ARGV[1])
return 1
"""


def engines_key(job: str) -> str:
    return JobKeys(job).engines


def joining_key(job: str) -> str:
    return JobKeys(job).engines_joining


class EngineRegistration:
    """Engine side: register `url` and renew its lease from a daemon thread until `close()`.
    `joining`: the engine starts mid-job, so it waits in the joining set until the weight bus has given
    it the current weights (at job start, engines hold the model's weights and register live)."""

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        url: str,
        lease_s: float = DEFAULT_LEASE_S,
        joining: bool = False,
    ) -> None:
        self.r, self.key, self.url, self.lease_s = client, engines_key(job), url, lease_s
        self.joining_key = joining_key(job)
        self._renew = client.register_script(_RENEW)
        self._stop = threading.Event()
        self._force_live = not joining  # the first registration only
        self.renew()
        self._thread = threading.Thread(target=self._run, name="engine-registry", daemon=True)
        self._thread.start()
        log.info("engine %s registered (lease %.0fs)", url, lease_s)

    def renew(self) -> None:
        force = 1 if self._force_live else 0
        self._renew(keys=[self.key, self.joining_key], args=[self.url, int(self.lease_s * 1000), force])
        self._force_live = False

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.renew()
            except redis.RedisError as e:  # keep trying; the lease covers short outages
                log.warning("engine lease renewal failed: %s", e)

    def close(self) -> None:
        """Leave the registry now (clean shutdown) instead of waiting for the lease to run out."""
        self._stop.set()
        self.r.zrem(self.key, self.url)
        self.r.zrem(self.joining_key, self.url)
        log.info("engine %s deregistered", self.url)


async def live_engines(client, job: str) -> list[str]:
    """URLs of engines with a live lease (redis.asyncio client), sorted."""
    urls = await client.eval(_LIVE, 1, engines_key(job))
    return sorted(u.decode() if isinstance(u, bytes) else u for u in urls)


class EngineRegistry:
    """The weight bus's side of the registry (weight_bus.membership.Registry), over a sync client: engines
    waiting to join, promoting them once they hold the current weights, demoting dropped ones."""

    def __init__(self, client: redis.Redis, job: str) -> None:
        self.r, self.live_key, self.joining_key = client, engines_key(job), joining_key(job)
        self._promote = client.register_script(_PROMOTE)

    def live(self) -> list[str]:
        """URLs with a live lease in the live set, sorted."""
        urls = self.r.eval(_LIVE, 1, self.live_key)
        return sorted(u.decode() if isinstance(u, bytes) else u for u in urls)

    def joining(self) -> list[str]:
        """URLs with a live lease in the joining set, sorted."""
        urls = self.r.eval(_LIVE, 1, self.joining_key)
        return sorted(u.decode() if isinstance(u, bytes) else u for u in urls)

    def promote(self, url: str) -> bool:
        """Joining -> live (rollout workers route to it from their next refresh); False if not joining."""
        return bool(self._promote(keys=[self.live_key, self.joining_key], args=[url]))

    def demote(self, url: str) -> None:
        """Out of the live set now; a live engine's next renewal puts it in the joining set."""
        self.r.zrem(self.live_key, url)
