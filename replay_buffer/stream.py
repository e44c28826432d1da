"""Replay buffer on a Redis Stream: producers XADD groups; the trainer reads them through one consumer group,
drops too-stale groups, and XACKs a batch only when the optimizer step that used it has committed.

Invariants:
- A group is acknowledged only in `commit` (trained) or when it is dropped/dead-lettered, so a trainer
  that dies between read and commit leaves its groups pending for redelivery.
- `commit` records the group_ids in the `trained` set in the same MULTI as the XACK, so a redelivered
  group that was already trained is recognised and skipped, never trained twice.
- Admission: a producer may start group number `started + 1` only while it is
  <= (version + max_staleness + 1) * groups_per_step. A dropped stale group gives its slot back,
  otherwise at max_staleness = 0 one drop would starve the step that needs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import redis
import redis.asyncio as aioredis

from replay_buffer import metrics
from replay_buffer.keys import TRAINER_GROUP, JobKeys
from replay_buffer.schema import GroupRecord, RecordError, decode, encode
from replay_buffer.staleness import is_usable, staleness

log = logging.getLogger(__name__)

_ADMIT_LUA = """
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local cap = (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1])
if started + 1 <= cap then return redis.call('INCR', KEYS[1]) end
return 0
"""


class Entry(msgspec.Struct):
    """One stream entry as handed to the trainer."""

    entry_id: str
    group: GroupRecord


class BufferProducer:
    """Producer side (asyncio): admission, version reads, XADD. Used by rollout workers."""

    def __init__(self, client: aioredis.Redis, job: str) -> None:
        self.r = client
        self.keys = JobKeys(job)
        self._admit = client.register_script(_ADMIT_LUA)

    async def version(self) -> int:
        return int(await self.r.get(self.keys.version) or 0)

    async def try_admit(self, groups_per_step: int, max_staleness: int) -> bool:
        """Atomically reserve one group slot; False when the fleet is max_staleness versions ahead."""
        n = await self._admit(
            keys=[self.keys.started, self.keys.version], args=[groups_per_step, max_staleness]
        )
        return int(n) > 0

    async def release(self) -> None:
        """Give back a reserved slot whose group will not be produced (e.g. the rollout failed)."""
        await self.r.decr(self.keys.started)

    async def put(self, group: GroupRecord) -> str:
        data = encode(group)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.groups, {"d": data})
        pipe.hincrby(self.keys.stats, "produced", 1)
        entry_id, _ = await pipe.execute()
        metrics.GROUPS_PRODUCED.inc()
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


class ReplayBuffer:
    """Consumer side (sync, trainer rank 0) plus job-state helpers shared by the driver and tests."""

    def __init__(self, client: redis.Redis, job: str, consumer: str = "trainer-0") -> None:
        self.r = client
        self.keys = JobKeys(job)
        self.consumer = consumer
        self._admit = client.register_script(_ADMIT_LUA)

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.keys.groups, TRAINER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # --- job state ---------------------------------------------------------------------------------
    def version(self) -> int:
        return int(self.r.get(self.keys.version) or 0)

    def set_version(self, version: int) -> None:
        self.r.set(self.keys.version, version)

    def try_admit(self, groups_per_step: int, max_staleness: int) -> bool:
        n = self._admit(keys=[self.keys.started, self.keys.version], args=[groups_per_step, max_staleness])
        return int(n) > 0

    def put(self, group: GroupRecord) -> str:
        """Synchronous XADD (tests, tools); rollout workers use BufferProducer."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.groups, {"d": encode(group)})
        pipe.hincrby(self.keys.stats, "produced", 1)
        entry_id, _ = pipe.execute()
        return entry_id.decode()

    # --- consumption -------------------------------------------------------------------------------
    def _read(self, count: int, block_ms: int) -> list[tuple[str, dict]]:
        resp = self.r.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=count, block=block_ms
        )
        if not resp:
            return []
        return [(eid.decode(), fields) for eid, fields in resp[0][1]]

    def _dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(
            self.keys.dead_letter,
            {"entry_id": entry_id, "reason": reason, "d": fields.get(b"d", b"")},
        )
        pipe.xack(self.keys.groups, TRAINER_GROUP, entry_id)
        pipe.hincrby(self.keys.stats, "dead_letter", 1)
        pipe.execute()
        metrics.DEAD_LETTER.inc()
        log.warning("dead-lettered entry %s: %s", entry_id, reason)

    def _drop_stale(self, entry: Entry, version: int) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.groups, TRAINER_GROUP, entry.entry_id)
        pipe.hincrby(self.keys.stats, "dropped_stale", 1)
        pipe.decr(self.keys.started)  # give the admission slot back (see module docstring)
        pipe.execute()
        metrics.GROUPS_DROPPED.inc()
        log.info(
            "dropped stale group %s: version %d, min_version %d",
            entry.group.group_id,
            version,
            entry.group.min_version,
        )

    def take_batch(
        self,
        n: int,
        version: int,
        max_staleness: int,
        block_ms: int = 1000,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[Entry]:
        """Block until `n` usable groups are read (or should_stop()); stale, bad and duplicate ones are
        acknowledged and never returned. The returned entries stay pending until `commit`."""
        batch: list[Entry] = []
        seen: set[str] = set()
        while len(batch) < n and not should_stop():
            for entry_id, fields in self._read(n - len(batch), block_ms):
                try:
                    group = decode(fields[b"d"])
                except (RecordError, KeyError) as e:
                    self._dead_letter(entry_id, fields, str(e))
                    continue
                entry = Entry(entry_id, group)
                if group.group_id in seen or self.r.sismember(self.keys.trained, group.group_id):
                    self.r.xack(self.keys.groups, TRAINER_GROUP, entry_id)
                    self.r.hincrby(self.keys.stats, "duplicates", 1)
                    log.info("skipped already-trained group %s", group.group_id)
                    continue
                if not is_usable(version, group.min_version, max_staleness):
                    self._drop_stale(entry, version)
                    continue
                seen.add(group.group_id)
                batch.append(entry)
        return batch

    def commit(self, entries: list[Entry], version: int) -> None:
        """After the optimizer step that used `entries` (trained at `version`): mark trained, ack, count."""
        if not entries:
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(self.keys.trained, *[e.group.group_id for e in entries])
        pipe.xack(self.keys.groups, TRAINER_GROUP, *[e.entry_id for e in entries])
        pipe.hincrby(self.keys.stats, "consumed", len(entries))
        pipe.hincrby(self.keys.stats, "steps", 1)
        for e in entries:
            s = staleness(version, e.group.min_version)
            pipe.hincrby(self.keys.staleness, str(s), 1)
            metrics.STALENESS.observe(s)
        pipe.execute()
        metrics.GROUPS_CONSUMED.inc(len(entries))

    # --- inspection --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Depth, pending, counters and the staleness distribution of consumed groups."""
        raw = {k.decode(): int(v) for k, v in self.r.hgetall(self.keys.stats).items()}
        hist = {int(k): int(v) for k, v in self.r.hgetall(self.keys.staleness).items()}
        pending, unread = 0, self.r.xlen(self.keys.groups)
        for g in self.r.xinfo_groups(self.keys.groups) if self.r.exists(self.keys.groups) else []:
            if g["name"] in (TRAINER_GROUP, TRAINER_GROUP.encode()):
                pending = g["pending"]
                last = g["last-delivered-id"]
                unread = len(
                    self.r.xrange(self.keys.groups, b"(" + last if isinstance(last, bytes) else "(" + last)
                )
        return {
            "version": self.version(),
            "depth": self.r.xlen(self.keys.groups),
            "pending": pending,
            "unread": unread,
            "dead_letter_depth": self.r.xlen(self.keys.dead_letter),
            "started": int(self.r.get(self.keys.started) or 0),
            **{
                k: raw.get(k, 0)
                for k in ("produced", "consumed", "dropped_stale", "dead_letter", "duplicates", "steps")
            },
            "staleness": dict(sorted(hist.items())),
        }

    def wait_for_version(self, at_least: int, timeout_s: float) -> int:
        """Poll until the published version reaches `at_least` (driver/tests); returns the version."""
        deadline = time.monotonic() + timeout_s
        while (v := self.version()) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {v} < {at_least} after {timeout_s}s")
            time.sleep(0.05)
        return v
