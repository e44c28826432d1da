"""The run lease: one driver per job name, ever. A driver takes its job's lease in Redis (SET NX with a
TTL it renews) before it touches any of the job's keys, and only for the job's current submission; a
second driver for the name finds it held (or its submission superseded) and exits without touching
anything. The control plane frees a lease only once Ray says its holder's submission ended.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import redis

from replay_buffer.keys import JobKeys

log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0
"""How long a lease outlives its holder's last renewal: the time a killed driver keeps its name taken
when Ray cannot say it ended (the control plane frees it at once when Ray can)."""
RENEW_S = 5.0
"""How often the holder renews it (well within the TTL: a loaded host or a short Redis stall loses
no lease)."""

# KEYS: submission, lease; ARGV: submission id ('' = the job's current one), holder JSON, ttl ms.
_TAKE = """
local current = redis.call('GET', KEYS[1])
if not current then return {'superseded', ''} end
if ARGV[1] ~= '' and current ~= ARGV[1] then return {'superseded', current} end
local holder = string.gsub(ARGV[2], '@SUBMISSION@', current)
if redis.call('SET', KEYS[2], holder, 'NX', 'PX', ARGV[3]) then return {'ok', holder} end
return {'held', redis.call('GET', KEYS[2])}
"""
# KEYS: lease, submission; ARGV: holder JSON, ttl ms, its submission. Renews the holder's own lease, or
# takes it back once it lapsed (a Redis stall past the TTL) while its submission is still the job's
# current one: the control plane ends a submission (and frees its lease) only once Ray says it ended.
_RENEW = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then return 0 end
if not current and redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: lease; ARGV: the holder JSON as read. Deletes the lease only if that holder still has it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseRefused(Exception):
    """This driver is not the job's one driver: another holds the lease, or its submission is not the
    job's current one. Its message says which."""


def holder(r: redis.Redis, job: str) -> tuple[bytes, dict] | None:
    """(raw value, identity) of the driver holding `job`'s lease, or None."""
    raw = r.get(JobKeys(job).lease)
    if raw is None:
        return None
    try:
        return raw, json.loads(raw)
    except ValueError:
        return raw, {"submission": None}


def release(r: redis.Redis, job: str, raw: bytes | str) -> bool:
    """Delete `job`'s lease if it is still `raw` (the holder as read): the control plane does it once Ray
    says that holder's submission ended, the driver at its end."""
    return bool(r.eval(_RELEASE, 1, JobKeys(job).lease, raw))


def describe(h: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(h["since"])) if h.get("since") else "?"
    return f"submission {h.get('submission')} (pid {h.get('pid')} on {h.get('host')}, since {since} UTC)"


def exit_now(message: str) -> None:
    """A driver whose lease another driver holds now (its own lapsed): it exits at once, writing nothing
    more; Ray ends its actors with it."""
    log.critical("%s: the driver exits now", message)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(3)


class RunLease:
    """The lease of one driver of `job` started for `submission` (None: the job's current one)."""

    def __init__(self, r: redis.Redis, job: str, submission: str | None, ttl_s: float = LEASE_TTL_S) -> None:
        self.r, self.job, self.keys, self.ttl_ms = r, job, JobKeys(job), int(ttl_s * 1000)
        self.identity = {
            "submission": submission or "@SUBMISSION@",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": round(time.time(), 3),
            "token": secrets.token_hex(4),  # no two drivers' leases are equal, whatever their pid
        }
        self.value = json.dumps(self.identity, sort_keys=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> dict:
        """Take the lease; the driver's identity. LeaseRefused when another driver holds it or this
        submission is not the job's current one (a resubmission replaced it, or it was marked as never
        started): nothing of the job's was read or written then."""
        asked = "" if self.identity["submission"] == "@SUBMISSION@" else self.identity["submission"]
        what, other = (
            x.decode() if isinstance(x, bytes) else x
            for x in self.r.eval(
                _TAKE, 2, self.keys.submission, self.keys.lease, asked, self.value, self.ttl_ms
            )
        )
        me = f"submission {asked or '(current)'} of job {self.job!r}"
        if what == "superseded":
            if not other:
                raise LeaseRefused(
                    f"job {self.job!r} has no current submission (not submitted: no spec stored for it, or "
                    "marked as never started); this driver exits without touching the job's keys"
                )
            raise LeaseRefused(
                f"{me} is not the job's current submission ({other}: it was resubmitted); this driver "
                "exits without touching the job's keys"
            )
        if what == "held":
            try:
                who = describe(json.loads(other))
            except ValueError:
                who = other
            raise LeaseRefused(
                f"job {self.job!r} already has a driver: {who} holds its run lease ({self.keys.lease}); "
                f"this driver ({me}, pid {os.getpid()}) exits without touching the job's keys"
            )
        self.value = other
        self.identity = json.loads(other)
        return self.identity

    def renew(self) -> bool:
        """Renew it; False when another driver holds it now, or it lapsed and its submission ended."""
        keys = (self.keys.lease, self.keys.submission)
        return bool(self.r.eval(_RENEW, 2, *keys, self.value, self.ttl_ms, self.identity["submission"]))

    def keep(self, on_lost: Callable[[str], None], every_s: float = RENEW_S) -> None:
        """Renew it every `every_s` in a daemon thread until `release`; `on_lost(message)` when another
        driver holds it (a Redis error is retried at the next renewal)."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    if not self.renew():
                        held = holder(self.r, self.job)
                        who = describe(held[1]) if held else "nobody (its submission ended)"
                        on_lost(f"job {self.job!r}: its run lease is held by {who}, not by this driver")
                        return
                except redis.RedisError as e:
                    log.warning("job %s: the run lease could not be renewed (retrying): %s", self.job, e)

        self._thread = threading.Thread(target=loop, name="run-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and give the lease up (if still held): the name is free for the next driver."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            release(self.r, self.job, self.value)
        except redis.RedisError as e:  # it lapses after its TTL, or the control plane frees it
            log.warning("job %s: the run lease could not be released: %s", self.job, e)
