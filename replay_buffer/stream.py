"""Replay buffer on a Redis Stream: producers XADD groups; the trainer reads them through one consumer group,
drops too-stale groups (trains them under `stale_policy: keep`), and XACKs a batch only when the optimizer
step that used it has committed.

Invariants:
- A group is acknowledged only in `commit` (trained) or when it is dropped/dead-lettered, so a trainer
  that dies between read and commit leaves its groups pending; the next `take_batch` of any trainer
  re-reads its own pending entries after a restart and claims (XAUTOCLAIM) other consumers' entries once
  they have been idle for `reclaim_idle_ms`.
- `commit` records the group_ids as trained in the same script as the XACK, so a redelivered group that
  was already trained is recognised and skipped, never trained twice.
- The books count each step and each group once: a client sends a write again when Redis' reply is lost
  (a stall past the socket timeout: replay_buffer/client.py), and Redis runs both copies once it
  continues. A commit carries an id (its version and entries) that the script records and checks; a drop,
  skip or dead letter counts only when its own XACK acknowledged the entry (scripts.COMMIT, SETTLE).
- Admission: a producer may start group number `started + 1` only while it is
  <= (version + max_staleness + 1) * groups_per_step (replay_buffer/scripts.py). A dropped stale group
  gives its slot back, otherwise at max_staleness = 0 one drop would starve the step that needs it.
- A group with a token from a version newer than the trainer's (a previous attempt of the run got further
  than the checkpoint this one resumed from) is never trained: it is acknowledged, counted as
  `dropped_future` and its admission slot given back, as a stale one is.
- Runs: each run of a job starts from empty per-run state (`begin_run`); a resumed run keeps it and
  continues its run_id, clock and progress (records of steps lost after the checkpoint are dropped).
- Hygiene: after each commit, entries below the oldest pending/unread one are all acknowledged and are
  trimmed (XTRIM MINID); trained ids are kept while a redelivery could still be fresh (always, under keep).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable

import msgspec
import redis
import redis.asyncio as aioredis

from replay_buffer import metrics, scripts
from replay_buffer.config import STALE_POLICIES
from replay_buffer.keys import TRAINER_GROUP, JobKeys
from replay_buffer.progress import StepRecord, entry_record, redis_now, run_clock
from replay_buffer.schema import GroupRecord, RecordError, decode, encode
from replay_buffer.staleness import is_usable, staleness

log = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 30_000
DEAD_LETTER_MAXLEN = 100_000
"""Dead letters are kept for inspection, capped (approximately) so a flood of garbage cannot fill Redis."""
COMMITS_KEPT = 64
"""Versions whose commit ids are remembered (JobKeys.commits): a retry only re-sends the commit in flight."""


class Entry(msgspec.Struct):
    """One stream entry as handed to the trainer."""

    entry_id: str
    group: GroupRecord


def as_str(x) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _length_counts(fate: str, lengths: list[int]) -> dict[str, int]:
    """Samples' response lengths as increments of the run's length histogram (`<fate>:<tokens>` -> samples)."""
    counts: dict[str, int] = {}
    for n in lengths:
        counts[f"{fate}:{n}"] = counts.get(f"{fate}:{n}", 0) + 1
    return counts


def commit_id(entries: list[Entry], version: int) -> str:
    """A commit's identity: its version and the entries it acknowledges. A retry of the same call has the
    same id; two different commits cannot (an entry is committed once: it is never redelivered after)."""
    digest = hashlib.sha1(" ".join(e.entry_id for e in entries).encode()).hexdigest()[:20]
    return f"{version}:{digest}"


class RedisFullError(RuntimeError):
    """Redis refused a write at its memory limit (maxmemory with `noeviction`: nothing stored was evicted)."""


def is_oom(e: redis.RedisError) -> bool:
    return isinstance(e, redis.exceptions.OutOfMemoryError) or "used memory > 'maxmemory'" in str(e)


def full_error(
    e: redis.RedisError, job: str, mem: tuple[int, int] | None, cannot: str = "add to its buffer"
) -> RedisFullError:
    """The clear error for an OOM reply (and one more count of `slipstream_buffer_redis_oom_total`);
    `cannot`: what the job cannot do now (the buffer's writers add to it; the driver records its state)."""
    metrics.REDIS_OOM.inc()
    used = f" (used {mem[0]} of maxmemory {mem[1]} bytes)" if mem else ""
    log.error("job %s: Redis is full%s: a write was refused (the job cannot %s)", job, used, cannot)
    return RedisFullError(
        f"Redis is full{used}: it refuses writes at its memory limit instead of evicting, so nothing "
        f"stored was lost, but job {job!r} cannot {cannot}. Raise the limit (`slipstream cluster "
        "down`, then `slipstream cluster up --redis-maxmemory SIZE`) or free memory (end other jobs, let "
        f"the trainer drain the buffer). Redis said: {e}"
    )


def _memory_of(info: dict) -> tuple[int, int]:
    return int(info["used_memory"]), int(info.get("maxmemory", 0))


def memory(r: redis.Redis) -> tuple[int, int] | None:
    """(used_memory, maxmemory) in bytes, or None when this user may not read INFO (or Redis is gone)."""
    try:
        return _memory_of(r.info("memory"))
    except redis.RedisError:
        return None


async def memory_async(r: aioredis.Redis) -> tuple[int, int] | None:
    try:
        return _memory_of(await r.info("memory"))
    except redis.RedisError:
        return None


# Long: the consumer's whole contract on one connection (take, commit, reclaim, dead-letter, trim, the run
#   clock); each method is short
class ReplayBuffer:
    """Consumer side (sync, trainer rank 0) plus job-state helpers shared by the driver, CLI and tests."""

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        consumer: str = "trainer-0",
        reclaim_idle_ms: int = 30_000,
        stale_policy: str = "drop",
        trim_interval_s: float = 1.0,
        ledger: bool = False,
    ) -> None:
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy {stale_policy!r}: expected one of {STALE_POLICIES}")
        self.r = client
        self.keys = JobKeys(job)
        self.consumer = consumer
        self.reclaim_idle_ms = reclaim_idle_ms
        self.stale_policy = stale_policy
        self.keep_stale = stale_policy == "keep"
        self.trim_interval_s = trim_interval_s
        self.ledger = ledger
        self._own_pending_done = False
        self._own_cursor = "0"
        self._next_claim = 0.0
        self._next_trim = 0.0
        self._reap = client.register_script(scripts.REAP)
        self.stale_lengths: list[int] = []
        """Response tokens of each sample in the groups dropped (or recycled) as too stale since the last
        `pop_stale_lengths` (the trainer's per-step record)."""
        self._rewind = client.register_script(scripts.REWIND)
        self._commit = client.register_script(scripts.COMMIT)
        self._settle_script = client.register_script(scripts.SETTLE)
        self._dead_letter_script = client.register_script(scripts.DEAD_LETTER)

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

    def rewind(self, version: int, groups_per_step: int) -> int:
        """Set the published version back to `version` (a resumed checkpoint older than it) and give back
        the admission slots of the steps in between; returns how many versions were rewound."""
        n = int(self._rewind(keys=[self.keys.version, self.keys.started], args=[version, groups_per_step]))
        if n > 0:
            log.warning(
                "version rewound by %d to %d: %d admission slots given back", n, version, n * groups_per_step
            )
        return n

    # --- runs ----------------------------------------------------------------------------------------
    def reset_run(self) -> int:
        """Delete every per-run key of the job (stream and consumer group, version, admission, trained
        ids, progress, engine registry, ...; not the control records); returns how many existed."""
        # a worker's `inflight:<worker>` list exists only while it is in the `workers` lease zset (leaving
        # or reaping removes both), so no SCAN: a job's Redis user may not list keys (other jobs' names)
        workers = [as_str(w) for w in self.r.zrange(self.keys.workers, 0, -1)]
        keys = self.keys.per_run() + [
            k for w in workers for k in (self.keys.inflight(w), self.keys.admitted_by(w))
        ]
        return int(self.r.delete(*keys))

    def begin_run(self, resume: bool) -> dict:
        """Start a job's run: a new one (fresh run_id, attempt 1, every per-run key deleted), or, with
        `resume` and a run on record, the next attempt of that run: its state stays (groups newer than
        the resumed checkpoint are dropped as from the future, progress records after it are dropped when
        the trainer resumes) and its clock continues where the last attempt's records ended."""
        info = self.run_info()
        if resume and info:
            last = self.r.xrevrange(self.keys.progress, count=1)
            before = entry_record(last[0][1]).elapsed_s if last else 0.0
            pipe = self.r.pipeline(transaction=True)
            pipe.hincrby(self.keys.run, "attempt", 1)
            pipe.hdel(self.keys.run, "started_at")  # the first trainer pool of this attempt sets it
            pipe.hset(self.keys.run, "elapsed_before", repr(float(before)))
            pipe.execute()
            info = self.run_info()
            log.info("run %s: attempt %d resumes (its clock continues at %.1f s)", info["run_id"],
                     info["attempt"], before)  # fmt: skip
            return info
        n = self.reset_run()
        self.r.hset(self.keys.run, mapping={"run_id": uuid.uuid4().hex[:12], "attempt": 1})
        info = self.run_info()
        log.info("run %s of job %s begins%s", info["run_id"], self.keys.job,
                 f" (the previous run's {n} keys deleted)" if n else "")  # fmt: skip
        return info

    def run_info(self) -> dict:
        """run_id and attempt of the job's current run ({} when none began)."""
        raw = {as_str(k): as_str(v) for k, v in self.r.hgetall(self.keys.run).items()}
        if "run_id" not in raw:
            return {}
        return {
            "run_id": raw["run_id"],
            "attempt": run_clock(raw).attempt,
            "trims": int(raw.get("trims", 0)),
        }

    def start_clock(self) -> float:
        """The run clock's reading now (seconds): it starts when the run's first trainer pool starts and
        every later pool (rescale, restart, resumed attempt) continues it; Redis time, so every process
        reads the same clock."""
        now = redis_now(self.r.time())
        before = run_clock(self.r.hgetall(self.keys.run)).elapsed_before
        self.r.hsetnx(self.keys.run, "started_at", repr(now - before))
        return run_clock(self.r.hgetall(self.keys.run)).reading(now)

    def clock(self) -> float | None:
        """The run clock's reading now; None before the first trainer pool started it."""
        return run_clock(self.r.hgetall(self.keys.run)).reading(redis_now(self.r.time()))

    def truncate_progress(self, version: int) -> int:
        """Drop the progress records of steps after `version` (the trainer resumed from a checkpoint there:
        those steps are lost and will be trained again); returns how many were dropped."""
        drop = []
        for entry_id, fields in self.r.xrevrange(self.keys.progress, count=10_000):
            rec = entry_record(fields)
            if rec.version > version:
                drop.append(entry_id)
            elif isinstance(rec, StepRecord):  # evaluations trail the steps: a step ends the scan
                break
        if drop:
            pipe = self.r.pipeline(transaction=True)
            pipe.xdel(self.keys.progress, *drop)
            pipe.hincrby(self.keys.run, "trims", 1)
            pipe.execute()
            log.warning("dropped %d progress records of steps after version %d (lost)", len(drop), version)
        return len(drop)

    def reap_workers(self) -> int:
        """Release the reservations of workers whose lease expired (their in-flight prompts are
        reissued); returns how many reservations were released."""
        args = [self.keys.inflight_prefix, self.keys.admitted_prefix]
        return int(self._reap(keys=self.keys.lease_keys, args=args))

    def put(self, group: GroupRecord) -> str:
        """Synchronous XADD without a reservation (tests, tools); rollout workers use BufferProducer."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.groups, {"d": encode(group)})
        pipe.hincrby(self.keys.stats, "produced", 1)
        try:
            entry_id, _ = pipe.execute()
        except redis.ResponseError as e:
            if is_oom(e):
                raise full_error(e, self.keys.job, memory(self.r)) from e
            raise
        return as_str(entry_id)

    # --- consumption -------------------------------------------------------------------------------
    def _read_own_pending(self, count: int) -> list[tuple[str, dict | None]]:
        """After a restart under the same consumer name: entries we read but never committed."""
        # From after the last one returned: those are in a batch now (still pending until its commit).
        resp = self.r.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: self._own_cursor}, count=count
        )
        entries = resp[0][1] if resp else []
        if len(entries) < count:
            self._own_pending_done = True
        if entries:
            self._own_cursor = as_str(entries[-1][0])
        return [(as_str(eid), fields) for eid, fields in entries]

    def _claim(self, count: int) -> list[tuple[str, dict | None]]:
        """Entries other consumers read but did not commit within reclaim_idle_ms (dead trainers)."""
        resp = self.r.xautoclaim(
            self.keys.groups, TRAINER_GROUP, self.consumer, self.reclaim_idle_ms, start_id="0-0", count=count
        )
        claimed = [(as_str(eid), fields) for eid, fields in resp[1]]
        if claimed:
            metrics.RECLAIMED.inc(len(claimed))
            self.r.hincrby(self.keys.stats, "reclaimed", len(claimed))
            log.warning("reclaimed %d pending entries idle > %d ms", len(claimed), self.reclaim_idle_ms)
        return claimed

    def _read_new(self, count: int, block_ms: int) -> list[tuple[str, dict | None]]:
        resp = self.r.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=count, block=block_ms
        )
        return [(as_str(eid), fields) for eid, fields in resp[0][1]] if resp else []

    def _read(self, count: int, block_ms: int) -> list[tuple[str, dict | None]]:
        if not self._own_pending_done:
            if own := self._read_own_pending(count):
                return own
        # Another consumer's entries become claimable only after reclaim_idle_ms, so looking more often
        # than a few times per that interval buys nothing and costs a round trip per read.
        if time.monotonic() >= self._next_claim:
            if claimed := self._claim(count):
                return claimed
            self._next_claim = time.monotonic() + min(self.reclaim_idle_ms / 4000, 5.0)
        return self._read_new(count, block_ms)

    def _dead_letter(self, entry_id: str, fields: dict | None, reason: str) -> None:
        keys = [self.keys.groups, self.keys.dead_letter, self.keys.stats]
        payload = (fields or {}).get(b"d", b"")
        args = [TRAINER_GROUP, entry_id, reason, payload, DEAD_LETTER_MAXLEN]
        self._dead_letter_script(keys=keys, args=args)
        metrics.DEAD_LETTER.inc()
        log.warning("dead-lettered entry %s: %s", entry_id, reason)

    def _settle(self, entry: Entry, counter: str, give_back: bool, lengths: list[int] | None = None) -> None:
        """Acknowledge a group that will not be trained and count it under `counter` (once: scripts.SETTLE);
        `give_back`: its admission slot returns to the pool (recycled too under stale_policy recycle)."""
        recycle = give_back and self.stale_policy == "recycle"
        keys = [self.keys.groups, self.keys.stats, self.keys.started, self.keys.recycle, self.keys.lengths]
        args = [
            TRAINER_GROUP,
            entry.entry_id,
            counter,
            int(give_back),
            int(recycle),
            entry.group.prompt_id,
            json.dumps(_length_counts("stale", lengths or [])),
        ]
        self._settle_script(keys=keys, args=args)

    def _drop_stale(self, entry: Entry, version: int) -> None:
        lengths = [len(s) for s in entry.group.samples]
        # the admission slot goes back (see module docstring)
        self._settle(entry, "dropped_stale", give_back=True, lengths=lengths)
        metrics.GROUPS_DROPPED.inc()
        self.stale_lengths += lengths
        for n in lengths:
            metrics.RESPONSE_TOKENS.labels("stale").observe(n)
        log.info(
            "%s stale group %s (prompt %s): version %d, min_version %d",
            "recycled" if self.stale_policy == "recycle" else "dropped",
            entry.group.group_id,
            entry.group.prompt_id,
            version,
            entry.group.min_version,
        )

    def _drop_future(self, entry: Entry, version: int) -> None:
        # its slot was not used by this attempt's steps: give it back
        self._settle(entry, "dropped_future", give_back=True)
        metrics.GROUPS_FUTURE.inc()
        log.warning(
            "dropped group %s (prompt %s) from the future: versions %d..%d, trainer at version %d",
            entry.group.group_id,
            entry.group.prompt_id,
            entry.group.min_version,
            entry.group.max_version,
            version,
        )

    def _skip_duplicate(self, entry: Entry) -> None:
        self._settle(entry, "duplicates", give_back=False)
        metrics.DUPLICATES.inc()
        log.warning("skipped already-trained group %s (entry %s)", entry.group.group_id, entry.entry_id)

    def take_batch(
        self,
        n: int,
        version: int,
        max_staleness: int,
        block_ms: int = 1000,
        should_stop: Callable[[], bool] = lambda: False,
        batch: list[Entry] | None = None,
    ) -> list[Entry]:
        """Block until the batch holds `n` usable groups (or should_stop()); stale, bad and duplicate ones
        are acknowledged and never returned. The returned entries stay pending until `commit`.
        `batch`: entries an earlier call already took for this batch (it was stopped short); extended in
        place and returned, so that none of them is read twice when it is redelivered meanwhile."""
        batch = [] if batch is None else batch
        seen: set[str] = {e.group.group_id for e in batch}
        while len(batch) < n and not should_stop():
            t0 = time.perf_counter()
            raw = self._read(n - len(batch), block_ms)
            in_batch = {e.entry_id for e in batch}
            candidates: list[Entry] = []
            for entry_id, fields in raw:
                if entry_id in in_batch:
                    # Already in this batch: XAUTOCLAIM hands back our own entries too once they idle past
                    # reclaim_idle_ms while a slow batch fills. Not a duplicate group: acking it here would
                    # count it twice and lose it if we died before the commit.
                    continue
                if fields is None:  # claimed entry that was deleted meanwhile: nothing to train
                    self.r.xack(self.keys.groups, TRAINER_GROUP, entry_id)
                    continue
                try:
                    group = decode(fields[b"d"])
                except (RecordError, KeyError) as e:
                    reason = str(e) if not isinstance(e, KeyError) else "missing field 'd'"
                    self._dead_letter(entry_id, fields, reason)
                    continue
                candidates.append(Entry(entry_id, group))
            trained = (
                self.r.zmscore(self.keys.trained, [e.group.group_id for e in candidates])
                if candidates
                else []
            )
            for entry, score in zip(candidates, trained, strict=True):
                if score is not None or entry.group.group_id in seen:
                    self._skip_duplicate(entry)
                elif max(entry.group.min_version, entry.group.max_version) > version:
                    self._drop_future(entry, version)
                elif not (self.keep_stale or is_usable(version, entry.group.min_version, max_staleness)):
                    self._drop_stale(entry, version)
                else:
                    seen.add(entry.group.group_id)
                    batch.append(entry)
            if raw:
                metrics.GET_SECONDS.observe(time.perf_counter() - t0)
        return batch

    def commit(self, entries: list[Entry], version: int, max_staleness: int | None = None) -> None:
        """After the optimizer step that used `entries` (trained at `version`): mark trained, ack, count,
        then trim acknowledged entries. With `max_staleness`, forget trained ids too old to matter.
        Idempotent: the same call again (a client's retry after a lost reply) changes nothing."""
        if not entries:
            return
        lengths = [len(s) for e in entries for s in e.group.samples]
        stale = [staleness(version, e.group.min_version) for e in entries]
        hist: dict[str, int] = {}
        for s in stale:
            hist[str(s)] = hist.get(str(s), 0) + 1
        commit = {
            "version": version,
            "keep": COMMITS_KEPT,
            "groups": [[e.group.group_id, e.group.min_version] for e in entries],
            "entries": [e.entry_id for e in entries],
            "staleness": hist,
            "lengths": _length_counts("trained", lengths),
            "ledger": self.ledger,
        }
        if max_staleness is not None and not self.keep_stale:
            # A redelivered group with min_version < (next version) - max_staleness is stale: dropped
            # as such, so its id need not be remembered (under `keep` it would be trained: every id stays).
            commit["forget_below"] = version + 1 - max_staleness
        cid = commit_id(entries, version)
        k = self.keys
        try:
            applied = self._commit(
                keys=[k.commits, k.trained, k.groups, k.stats, k.staleness, k.lengths, k.ledger],
                args=[cid, TRAINER_GROUP, json.dumps(commit)],
            )
        except redis.ResponseError as e:
            if is_oom(e):
                raise full_error(e, self.keys.job, memory(self.r)) from e
            raise
        if not applied:
            # the usual cause: Redis stalled past the socket timeout, the client sent the commit again and
            # Redis ran the first copy once it continued; this process' metrics below count it once
            metrics.COMMIT_REPLAYS.inc()
            log.warning("commit %s (version %d, %d groups) was applied already: a retry after Redis' "
                        "reply was lost; counted once", cid, version, len(entries))  # fmt: skip
        metrics.GROUPS_CONSUMED.inc(len(entries))
        for s in stale:
            metrics.STALENESS.observe(s)
        for n in lengths:
            metrics.RESPONSE_TOKENS.labels("trained").observe(n)
        if time.monotonic() >= self._next_trim:  # trimming costs ~5 round trips: at most every interval
            self.trim()
            self._next_trim = time.monotonic() + self.trim_interval_s

    def trim(self) -> int:
        """XTRIM MINID below the oldest entry that is pending or unread: everything older is acknowledged
        (trained, dropped or dead-lettered). Returns the number of entries removed."""
        info = self._group_info()
        if info is None:
            return 0
        last = as_str(info["last-delivered-id"])
        keep_from = _next_id(last)
        if info["pending"]:
            oldest = as_str(self.r.xpending(self.keys.groups, TRAINER_GROUP)["min"])
            keep_from = min(keep_from, oldest, key=_id_key)
        removed = self.r.xtrim(self.keys.groups, minid=keep_from, approximate=False)
        if removed:
            metrics.TRIMMED.inc(removed)
        depth = self.r.xlen(self.keys.groups)
        metrics.DEPTH.set(depth)
        metrics.PENDING.set(info["pending"])
        metrics.OLDEST_AGE.set(self.oldest_age_s())
        if mem := memory(self.r):
            metrics.REDIS_USED_MEMORY.set(mem[0])
            metrics.REDIS_MAXMEMORY.set(mem[1])
        return removed

    def oldest_age_s(self) -> float:
        """Seconds since the oldest entry still in the stream was written (its ID is Redis' clock in ms,
        compared with Redis' clock now); 0 when the stream is empty."""
        first = self.r.xrange(self.keys.groups, count=1)
        if not first:
            return 0.0
        sec, usec = self.r.time()
        return max(0.0, sec + usec / 1e6 - int(as_str(first[0][0]).split("-")[0]) / 1e3)

    def pop_stale_lengths(self) -> list[int]:
        """The response lengths of the samples dropped as stale since the last call."""
        out, self.stale_lengths = self.stale_lengths, []
        return out

    # --- inspection --------------------------------------------------------------------------------
    def length_histograms(self) -> dict[str, dict[int, int]]:
        """The run's response-length distributions, samples per length (tokens): `trained`, and `stale`
        (in groups dropped or recycled as too stale)."""
        out: dict[str, dict[int, int]] = {"trained": {}, "stale": {}}
        for k, v in self.r.hgetall(self.keys.lengths).items():
            fate, _, n = as_str(k).partition(":")
            if fate in out:
                out[fate][int(n)] = int(v)
        return {fate: dict(sorted(h.items())) for fate, h in out.items()}

    def _group_info(self) -> dict | None:
        if not self.r.exists(self.keys.groups):
            return None
        for g in self.r.xinfo_groups(self.keys.groups):
            if as_str(g["name"]) == TRAINER_GROUP:
                return g
        return None

    def stats(self) -> dict:
        """Depth, pending, unread, counters and the staleness distribution of consumed groups."""
        raw = {as_str(k): int(v) for k, v in self.r.hgetall(self.keys.stats).items()}
        hist = {int(k): int(v) for k, v in self.r.hgetall(self.keys.staleness).items()}
        depth = self.r.xlen(self.keys.groups)
        pending, unread = 0, depth
        if info := self._group_info():
            pending = info["pending"]
            unread = len(self.r.xrange(self.keys.groups, "(" + as_str(info["last-delivered-id"])))
        counters = (
            "produced",
            "consumed",
            "dropped_stale",
            "dropped_future",
            "recycled",
            "reissued",
            "dead_letter",
            "duplicates",
            "reclaimed",
            "steps",
        )
        return {
            "version": self.version(),
            "depth": depth,
            "pending": pending,
            "unread": unread,
            "dead_letter_depth": self.r.xlen(self.keys.dead_letter),
            "started": int(self.r.get(self.keys.started) or 0),
            "workers": self.r.zcard(self.keys.workers),
            "recycle_queue": self.r.llen(self.keys.recycle),
            "reissue_queue": self.r.llen(self.keys.reissue),
            **{k: raw.get(k, 0) for k in counters},
            "staleness": dict(sorted(hist.items())),
        }
