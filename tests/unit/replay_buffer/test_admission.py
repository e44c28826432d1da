"""Admission control against a real redis-server: the AReaL cap, shared by all workers, correct when
workers join, leave, or die holding reservations (a dead worker's in-flight prompts are reissued)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import redis.asyncio as aioredis
from sample_pair import one_token_group

from replay_buffer import BufferProducer, ReplayBuffer


def _run(coro):
    return asyncio.run(coro)


async def _producers(url, job, names, lease_ms=60_000):
    clients = [aioredis.Redis.from_url(url) for _ in names]
    return clients, [
        BufferProducer(c, job, worker_id=n, lease_ms=lease_ms) for c, n in zip(clients, names, strict=True)
    ]


async def _close(clients):
    for c in clients:
        await c.aclose()


def test_cap_follows_version_and_release(redis_server, job_id):
    async def scenario():
        clients, (p,) = await _producers(redis_server.url, job_id, ["w0"])
        admitted = [await p.try_admit(groups_per_step=2, max_staleness=1) for _ in range(6)]
        assert admitted == [True] * 4 + [False] * 2  # (0 + 1 + 1) * 2 = 4
        await p.r.set(p.keys.version, 1)
        assert await p.try_admit(2, 1) and await p.try_admit(2, 1)
        assert not await p.try_admit(2, 1)
        await p.release()
        assert await p.try_admit(2, 1)
        await _close(clients)

    _run(scenario())


def test_concurrent_workers_never_exceed_the_shared_cap(redis_server, job_id):
    async def scenario():
        clients, prods = await _producers(redis_server.url, job_id, [f"w{i}" for i in range(4)])
        results = await asyncio.gather(*(p.try_admit(8, 0) for p in prods for _ in range(10)))
        await _close(clients)
        return results

    assert sum(_run(scenario())) == 8


def test_put_turns_a_reservation_into_a_record_and_leave_releases_the_rest(
    redis_server, redis_client, job_id
):
    async def scenario():
        clients, (p,) = await _producers(redis_server.url, job_id, ["w0"])
        for _ in range(3):
            assert await p.try_admit(10, 0)
        await p.put(one_token_group(job_id))
        assert int(await p.r.hget(p.keys.reservations, "w0")) == 2
        assert await p.leave() == 2
        await _close(clients)

    _run(scenario())
    assert int(redis_client.get(f"slipstream:{job_id}:started")) == 1  # only the produced group counts
    assert redis_client.zcard(f"slipstream:{job_id}:workers") == 0


def test_a_joining_worker_shares_the_cap(redis_server, job_id):
    async def scenario():
        clients, (a, b) = await _producers(redis_server.url, job_id, ["a", "b"])
        assert all([await a.try_admit(4, 0) for _ in range(3)])
        assert await b.try_admit(4, 0)  # joins mid-window: gets the last slot only
        assert not await b.try_admit(4, 0) and not await a.try_admit(4, 0)
        await _close(clients)

    _run(scenario())


def test_expired_lease_releases_a_dead_workers_reservations(redis_server, redis_client, job_id):
    async def scenario():
        clients, (dead, live) = await _producers(redis_server.url, job_id, ["dead", "live"])
        assert all([await dead.try_admit(3, 0) for _ in range(3)])
        assert not await live.try_admit(3, 0)
        await dead.r.zadd(dead.keys.workers, {"dead": 0})  # its lease ran out (it stopped heartbeating)
        assert await live.try_admit(3, 0)  # the admission call reaped it first
        assert await dead.r.zscore(dead.keys.workers, "dead") is None
        await _close(clients)

    _run(scenario())
    assert int(redis_client.get(f"slipstream:{job_id}:started")) == 1


_CHILD = """
import asyncio, sys, redis.asyncio as aioredis
from replay_buffer import BufferProducer
async def main():
    p = BufferProducer(aioredis.Redis.from_url(sys.argv[1]), sys.argv[2], worker_id="child", lease_ms=500)
    for i in range(3):
        assert await p.try_admit(3, 0)
        await p.begin(f"prompt-{i}")
    await p.release("prompt-1")  # given up: not in flight any more
    print("reserved", flush=True)
    await asyncio.Event().wait()  # holds its reservations until killed
asyncio.run(main())
"""


def test_killed_worker_process_gets_its_reservations_released(redis_server, redis_client, job_id):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, redis_server.url, job_id], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline().strip() == "reserved"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    buf = ReplayBuffer(redis_client, job_id)
    deadline = time.monotonic() + 30
    while buf.reap_workers() == 0:  # lease is 500 ms; poll the server-side expiry
        assert time.monotonic() < deadline, "dead worker's lease never expired"
        time.sleep(0.05)
    st = buf.stats()
    assert st["started"] == 0 and st["workers"] == 0
    assert st["reissued"] == 2 and st["reissue_queue"] == 2
    assert [p.decode() for p in redis_client.lrange(f"slipstream:{job_id}:reissue", 0, -1)] == [
        "prompt-0",
        "prompt-2",
    ]

    async def next_two():
        clients, (p,) = await _producers(redis_server.url, job_id, ["heir"])
        got = [await p.next_reissued() for _ in range(3)]
        await _close(clients)
        return got

    assert _run(next_two()) == ["prompt-0", "prompt-2", None]


def test_in_flight_prompts_follow_put_release_and_leave(redis_server, redis_client, job_id):
    async def scenario():
        clients, (w,) = await _producers(redis_server.url, job_id, ["w"])
        for prompt in ("a", "b", "c", "d"):
            assert await w.try_admit(4, 0)
            await w.begin(prompt)
        await w.put(one_token_group(job_id, "a"))
        await w.release("b")  # given up: not reissued
        key = w.keys.inflight("w")
        assert [x.decode() for x in await w.r.lrange(key, 0, -1)] == ["c", "d"]
        assert await w.leave() == 2  # stopped with c and d unfinished: they go to the others
        assert [x.decode() for x in await w.r.lrange(w.keys.reissue, 0, -1)] == ["c", "d"]
        assert not await w.r.exists(key)
        await _close(clients)

    _run(scenario())
    assert ReplayBuffer(redis_client, job_id).stats()["reissued"] == 2


def test_rewind_gives_back_the_slots_of_lost_steps(redis_server, redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id)
    buf.set_version(10)
    redis_client.set(f"slipstream:{job_id}:started", 26)  # the cap at version 10, max_staleness 2, 2/step

    async def admits(n: int) -> int:
        clients, (w,) = await _producers(redis_server.url, job_id, ["w"])
        got = sum([await w.try_admit(2, 2) for _ in range(n)])
        await _close(clients)
        return got

    assert _run(admits(1)) == 0
    assert buf.rewind(7, groups_per_step=2) == 3  # resumed from a checkpoint 3 steps back
    assert buf.version() == 7 and int(redis_client.get(f"slipstream:{job_id}:started")) == 20
    buf.set_version(8)  # each step trained again frees its groups' slots as before
    assert _run(admits(5)) == 2
    assert buf.rewind(8, groups_per_step=2) == 0  # not behind: nothing given back
    assert int(redis_client.get(f"slipstream:{job_id}:started")) == 22


def _train_one_step(url, job, version, gps):
    """The trainer's side of one step: a batch taken, committed, the next version published."""
    import redis as sync_redis

    r = sync_redis.Redis.from_url(url)
    buf = ReplayBuffer(r, job)
    buf.ensure_group()
    entries = buf.take_batch(gps, version, max_staleness=1, block_ms=100)
    assert len(entries) == gps
    buf.commit(entries, version)
    buf.set_version(version + 1)
    r.close()


def test_oldest_admission_waits_for_the_oldest_group_in_flight(redis_server, job_id):
    """buffer.admission: oldest. A long group admitted at version 0 is still generating while short ones
    admitted after it are trained: the cap stays at (0 + max_staleness + 1) * groups_per_step until the long
    one is in, so it can never be overtaken into staleness. The version rule would admit more."""

    async def scenario(oldest: bool):
        clients, (long, short) = await _producers(redis_server.url, job_id + str(oldest), ["long", "short"])
        job = job_id + str(oldest)
        assert await long.admit(2, 1, oldest) == 0
        short_at = [await short.admit(2, 1, oldest) for _ in range(3)]
        assert short_at == [0, 0, 0] and await short.admit(2, 1, oldest) is None  # (0 + 1 + 1) * 2 = 4
        for i, at in enumerate(short_at):
            await short.put(one_token_group(job, f"s{i}"), admitted_at=at)
        await asyncio.to_thread(_train_one_step, redis_server.url, job, 0, 2)  # version 1 published
        more = await short.admit(2, 1, oldest)
        if oldest:
            assert more is None  # base = the long group's version 0, not 1
            assert {int(k): int(v) for k, v in (await long.r.hgetall(long.keys.admitted)).items()} == {0: 1}
            await long.put(one_token_group(job, "long"), admitted_at=0)
            assert await long.r.hgetall(long.keys.admitted) == {}  # no count of 0 is left behind
            assert await long.r.exists(long.keys.admitted_by("long"), long.keys.admitted_by("short")) == 0
            assert await short.admit(2, 1, oldest) == 1  # base = version 1 now: cap 6
        else:
            assert more == 1  # the version rule: cap (1 + 1 + 1) * 2 = 6 with the long group still out
        await _close(clients)

    _run(scenario(True))
    _run(scenario(False))


def test_released_and_dead_workers_admissions_leave_the_oldest_count(redis_server, redis_client, job_id):
    async def scenario():
        clients, (dead, live) = await _producers(redis_server.url, job_id, ["dead", "live"], lease_ms=200)
        assert await dead.admit(4, 0, oldest=True) == 0 and await dead.admit(4, 0, oldest=True) == 0
        at = await live.admit(4, 0, oldest=True)
        await live.release("p", admitted_at=at)  # given up: no longer in flight
        assert int(await live.r.hget(live.keys.admitted, 0)) == 2
        await asyncio.sleep(0.4)  # `dead`'s lease expires; the next admission reaps it
        await live.heartbeat()
        assert await live.admit(4, 0, oldest=True) == 0
        assert {int(k): int(v) for k, v in (await live.r.hgetall(live.keys.admitted)).items()} == {0: 1}
        assert await dead.r.exists(dead.keys.admitted_by("dead")) == 0
        assert await live.leave() == 1
        assert await live.r.hgetall(live.keys.admitted) == {}
        await _close(clients)

    _run(scenario())
