"""Buffer semantics against a real redis-server: round trip, ack only on commit, staleness drop,
dead-letter, idempotent redelivery, admission control."""

import asyncio

import pytest
import redis.asyncio as aioredis

from replay_buffer import BufferProducer, ReplayBuffer, Sample, make_group
from replay_buffer.keys import TRAINER_GROUP


def _group(job, version, prompt="p"):
    s = Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.1, -0.2],
        token_versions=[version, version],
        reward=0.5,
        finish_reason="stop",
    )
    return make_group(job, prompt, [s, s])


@pytest.fixture
def buf(redis_client, job_id):
    b = ReplayBuffer(redis_client, job_id)
    b.ensure_group()
    return b


def test_round_trip_and_ack_only_on_commit(buf, job_id):
    sent = [_group(job_id, 0, f"p{i}") for i in range(3)]
    for g in sent:
        buf.put(g)
    assert buf.stats()["unread"] == 3
    batch = buf.take_batch(3, version=0, max_staleness=0, block_ms=100)
    assert [e.group for e in batch] == sent
    assert buf.stats()["pending"] == 3  # read but not yet trained: still pending
    buf.commit(batch, version=0)
    st = buf.stats()
    assert st["pending"] == 0 and st["unread"] == 0 and st["consumed"] == 3 and st["produced"] == 3
    assert st["staleness"] == {0: 3}


def test_uncommitted_batch_is_redelivered_to_another_consumer(buf, redis_client, job_id):
    buf.put(_group(job_id, 0))
    taken = buf.take_batch(1, 0, 0, block_ms=100)
    # The consumer "dies" here; the entry stays pending and can be claimed by a new consumer.
    claimed = redis_client.xautoclaim(buf.keys.groups, TRAINER_GROUP, "trainer-1", min_idle_time=0)
    assert [eid.decode() for eid, _ in claimed[1]] == [taken[0].entry_id]


def test_stale_groups_are_dropped_counted_and_release_admission(buf, job_id):
    buf.set_version(5)
    assert buf.try_admit(groups_per_step=1, max_staleness=0)
    buf.put(_group(job_id, 3, "old"))  # 5 - 3 = 2 > max_staleness 1
    fresh = _group(job_id, 4, "fresh")  # 5 - 4 = 1: usable
    buf.put(fresh)
    batch = buf.take_batch(1, version=5, max_staleness=1, block_ms=100)
    assert [e.group.group_id for e in batch] == [fresh.group_id]
    st = buf.stats()
    assert st["dropped_stale"] == 1 and st["pending"] == 1
    assert st["started"] == 0  # the dropped group's slot went back


def test_max_staleness_zero_only_accepts_current_version(buf, job_id):
    buf.set_version(2)
    buf.put(_group(job_id, 1))
    buf.put(cur := _group(job_id, 2))
    batch = buf.take_batch(1, version=2, max_staleness=0, block_ms=100)
    assert batch[0].group.group_id == cur.group_id
    assert buf.stats()["dropped_stale"] == 1


def test_malformed_record_goes_to_dead_letter(buf, redis_client, job_id):
    redis_client.xadd(buf.keys.groups, {"d": b"garbage"})
    redis_client.xadd(buf.keys.groups, {"x": b"no payload field"})
    buf.put(good := _group(job_id, 0))
    batch = buf.take_batch(1, 0, 0, block_ms=100)
    assert batch[0].group.group_id == good.group_id
    dead = redis_client.xrange(buf.keys.dead_letter)
    assert len(dead) == 2
    assert b"decode" in dead[0][1][b"reason"] and dead[0][1][b"d"] == b"garbage"
    st = buf.stats()
    assert st["dead_letter"] == 2 and st["pending"] == 1


def test_redelivered_trained_group_is_skipped(buf, job_id):
    g = _group(job_id, 0)
    buf.put(g)
    buf.commit(buf.take_batch(1, 0, 0, block_ms=100), version=0)
    buf.put(g)  # the same group arrives again (e.g. a producer retry)
    assert buf.take_batch(1, 0, 0, block_ms=50, should_stop=lambda: buf.stats()["duplicates"] > 0) == []
    st = buf.stats()
    assert st["duplicates"] == 1 and st["consumed"] == 1 and st["pending"] == 0


def test_admission_cap_follows_version(redis_server, job_id):
    async def scenario():
        r = aioredis.Redis.from_url(redis_server.url)
        prod = BufferProducer(r, job_id)
        admitted = [await prod.try_admit(groups_per_step=2, max_staleness=1) for _ in range(6)]
        assert admitted == [True] * 4 + [False] * 2  # (0 + 1 + 1) * 2 = 4
        await r.set(prod.keys.version, 1)
        assert await prod.try_admit(2, 1) and await prod.try_admit(2, 1)
        assert not await prod.try_admit(2, 1)
        await prod.release()
        assert await prod.try_admit(2, 1)
        await r.aclose()

    asyncio.run(scenario())


def test_concurrent_admission_never_exceeds_cap(redis_server, job_id):
    async def scenario():
        clients = [aioredis.Redis.from_url(redis_server.url) for _ in range(4)]
        prods = [BufferProducer(c, job_id) for c in clients]
        results = await asyncio.gather(*(p.try_admit(8, 0) for p in prods for _ in range(10)))
        for c in clients:
            await c.aclose()
        return results

    assert sum(asyncio.run(scenario())) == 8
