"""The producer side of a job's replay buffer: rollout workers append finished groups to the job's Redis
Stream under admission control (replay_buffer/scripts.py), idempotently per group id."""

from __future__ import annotations

import itertools
import time

import redis
import redis.asyncio as aioredis

from replay_buffer import metrics, scripts
from replay_buffer.keys import JobKeys
from replay_buffer.schema import GroupRecord, encode
from replay_buffer.stream import DEFAULT_LEASE_MS, as_str, full_error, is_oom, memory_async


class BufferProducer:
    """Producer side (asyncio), one per rollout worker: admission, heartbeats, XADD."""

    def __init__(
        self, client: aioredis.Redis, job: str, worker_id: str = "worker-0", lease_ms: int = DEFAULT_LEASE_MS
    ) -> None:
        self.r = client
        self.keys = JobKeys(job)
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self._admit = client.register_script(scripts.ADMIT)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._leave = client.register_script(scripts.LEAVE)
        self._end_slot = client.register_script(scripts.END_SLOT)
        self._inflight = self.keys.inflight(worker_id)
        self._admitted_mine = self.keys.admitted_by(worker_id)
        self._lease_keys = self.keys.lease_keys
        self._calls = itertools.count()
        """Numbers this worker's admission calls (with the caller, ADMIT's guard against a retried call)."""

    async def version(self) -> int:
        return int(await self.r.get(self.keys.version) or 0)

    async def try_admit(
        self, groups_per_step: int, max_staleness: int, oldest: bool = False, caller: int = 0
    ) -> bool:
        """`admit`, for callers that do not hand the admission version back to `put`/`release`."""
        return await self.admit(groups_per_step, max_staleness, oldest, caller) is not None

    async def admit(
        self, groups_per_step: int, max_staleness: int, oldest: bool = False, caller: int = 0
    ) -> int | None:
        """Atomically reserve one group slot for this worker; the version it was admitted at (give it to
        `put` or `release`), or None when the fleet is max_staleness versions ahead of the published
        version or, with `oldest` (buffer.admission: oldest), of the oldest group still in flight. Also
        renews this worker's lease and releases expired workers' reservations. `caller`: which of the
        worker's concurrent loops asks (each has one call out at a time): a call the client retries after
        losing Redis's reply is then answered once, not given a second slot."""
        try:
            v = await self._admit(
                keys=[*self._lease_keys[:3], self.keys.version, *self._lease_keys[3:]],
                args=[
                    groups_per_step,
                    max_staleness,
                    self.worker_id,
                    self.lease_ms,
                    self.keys.inflight_prefix,
                    self.keys.admitted_prefix,
                    1 if oldest else 0,
                    caller,
                    next(self._calls),
                ],
            )
        except redis.ResponseError as e:
            if is_oom(e):
                raise full_error(e, self.keys.job, await memory_async(self.r)) from e
            raise
        return int(v) if int(v) >= 0 else None

    async def begin(self, prompt_id: str) -> None:
        """Record that this worker now generates a group for `prompt_id` (after try_admit): if the worker
        dies before `put` or `release`, the prompt is reissued to the others once its lease expires."""
        await self.r.rpush(self._inflight, prompt_id)

    async def next_reissued(self) -> str | None:
        """A prompt_id that a dead worker had in flight, to generate again (served before anything else)."""
        return as_str(await self.r.lpop(self.keys.reissue))

    async def heartbeat(self) -> None:
        """Renew the lease; a worker that stops calling this (and try_admit) for lease_ms is presumed dead."""
        await self._heartbeat(keys=[self.keys.workers], args=[self.worker_id, self.lease_ms])

    async def release(
        self, prompt_id: str | None = None, admitted_at: int | None = None, caller: int | None = None
    ) -> None:
        """Give back a reserved slot whose group will not be produced (e.g. the rollout failed); the
        prompt `begin` recorded, if any, is no longer in flight, nor the admission `admit` returned.
        `caller`: the loop whose admission this was (as given to `admit`): a retried call is then applied
        once."""
        await self._end(prompt_id, admitted_at, caller, "")

    async def leave(self) -> int:
        """Worker shutdown: release every reservation it still holds; returns how many."""
        n = await self._leave(
            keys=self._lease_keys, args=[self.worker_id, self.keys.inflight_prefix, self.keys.admitted_prefix]
        )
        return int(n)

    async def next_recycled(self) -> str | None:
        """A prompt_id whose group was dropped as stale (stale_policy: recycle), to generate again."""
        return as_str(await self.r.lpop(self.keys.recycle))

    async def put(self, group: GroupRecord, admitted_at: int | None = None, caller: int | None = None) -> str:
        """Append a finished group (its reservation becomes a record); `admitted_at`: what `admit`
        returned for it; `caller`: the loop that was admitted (as given to `admit`): a retried call then
        stores the group once and answers the first call's entry id."""
        t0 = time.perf_counter()
        entry_id = await self._end(group.prompt_id, admitted_at, caller, encode(group))
        metrics.PUT_SECONDS.observe(time.perf_counter() - t0)
        metrics.GROUPS_PRODUCED.inc()
        return entry_id

    async def _end(self, prompt_id: str | None, admitted_at: int | None, caller: int | None, data) -> str:
        """A reserved slot ends (scripts.END_SLOT): with `data` (the encoded group) put, else released."""
        k = self.keys
        try:
            out = await self._end_slot(
                keys=[
                    k.reservations,
                    k.started,
                    k.stats,
                    k.groups,
                    self._inflight,
                    k.admitted,
                    self._admitted_mine,
                    k.admit_calls,
                ],
                args=[
                    self.worker_id,
                    prompt_id or "",
                    "" if admitted_at is None else admitted_at,
                    "" if caller is None else f"{self.worker_id}:{caller}",
                    data,
                ],
            )
        except redis.ResponseError as e:
            if is_oom(e):
                raise full_error(e, k.job, await memory_async(self.r)) from e
            raise
        return as_str(out)
