"""Engine registry in Redis: engines announce themselves with a lease they keep renewing; rollout workers
route only to engines whose lease is live, so an engine that dies stops receiving traffic within one
lease and an engine that joins mid-job starts receiving it at the workers' next refresh.

Leases are scored in Redis server time (the zset `slipstream:{job}:engines`, member = URL, score =
expiry in ms), so clocks of engine and worker hosts never matter.
"""

from __future__ import annotations

import logging
import threading

import redis

from replay_buffer import scripts
from replay_buffer.keys import JobKeys

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0

_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
"""


def engines_key(job: str) -> str:
    return JobKeys(job)._k("engines")


class EngineRegistration:
    """Engine side: register `url` and renew its lease from a daemon thread until `close()`."""

    def __init__(self, client: redis.Redis, job: str, url: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.r, self.key, self.url, self.lease_s = client, engines_key(job), url, lease_s
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._stop = threading.Event()
        self.renew()
        self._thread = threading.Thread(target=self._run, name="engine-registry", daemon=True)
        self._thread.start()
        log.info("engine %s registered (lease %.0fs)", url, lease_s)

    def renew(self) -> None:
        self._heartbeat(keys=[self.key], args=[self.url, int(self.lease_s * 1000)])

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
        log.info("engine %s deregistered", self.url)


async def live_engines(client, job: str) -> list[str]:
    """URLs of engines with a live lease (redis.asyncio client), sorted."""
    urls = await client.eval(_LIVE, 1, engines_key(job))
    return sorted(u.decode() if isinstance(u, bytes) else u for u in urls)
