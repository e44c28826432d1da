"""Redis clients that ride out a Redis restart: every command is retried on a connection error or
timeout with capped exponential backoff for up to ~OUTAGE_S, so a restart of redis-server (its AOF
replays in a second or two) pauses a job instead of killing its processes.

A command whose reply was lost may have been applied, and is then applied again by the retry (Redis
stalled past the socket timeout runs both copies once it continues). The buffer tolerates that: the
trainer's commit and its drops count once however often they arrive (replay_buffer/scripts.py: COMMIT,
SETTLE); a rollout loop's admission call is granted once (ADMIT remembers each loop's last granted call),
and the loop's put or release of that slot ends it once (END_SLOT marks the same entry with its answer),
so a retry never stores a group twice or takes or frees a slot twice. A group stored twice all the same
(a producer that names no loop) is skipped by the trainer's trained-id check and counted in `duplicates`.

A `rediss://` URL (an operator-run Redis with TLS) trusts `$SLIPSTREAM_CA_CERT`'s CA unless the URL names
its own (`?ssl_ca_certs=/path/ca.pem`): common/tls.py.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from common import tls

OUTAGE_S = 60.0
"""How long a client keeps retrying one command (backoff 0.05 s doubling to 1 s, then 1 s apart)."""
_RETRIES = int(OUTAGE_S)
ASYNC_MAX_CONNECTIONS = 64
"""Connections an asyncio client opens at most; more concurrent commands wait (up to OUTAGE_S) for a free
one instead of failing with `Too many connections` (a rollout worker runs one coroutine per group in
flight, `rollout.concurrency` of them, and every command is a short round trip)."""
_ERRORS = [ConnectionError, TimeoutError]


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=1.0, base=0.05)


def connect(url: str, **kw) -> redis.Redis:
    """A sync client for `url` that retries through an outage of up to ~OUTAGE_S."""
    kw.setdefault("retry", Retry(_backoff(), _RETRIES))
    kw.setdefault("retry_on_error", _ERRORS)
    return redis.Redis.from_url(url, **{**tls.redis_kwargs(url), **kw})


def connect_async(url: str, max_connections: int = ASYNC_MAX_CONNECTIONS, **kw) -> aioredis.Redis:
    """The asyncio counterpart of `connect`, on a pool of at most `max_connections` that makes a command
    wait for a free connection rather than fail."""
    kw.setdefault("retry", AsyncRetry(_backoff(), _RETRIES))
    kw.setdefault("retry_on_error", _ERRORS)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=OUTAGE_S, **{**tls.redis_kwargs(url), **kw}
    )
    return aioredis.Redis.from_pool(pool)
