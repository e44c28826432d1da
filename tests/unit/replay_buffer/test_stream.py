"""Buffer semantics against a real redis-server: round trip, ack only on commit, staleness drop/recycle,
dead-letter, idempotent redelivery, reclaim from idle consumers, trimming."""

import time

import pytest

from replay_buffer import ReplayBuffer, Sample, make_group
from replay_buffer.keys import TRAINER_GROUP


def _group(job, version, prompt="p"):
    s = Sample.build(
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
    b = ReplayBuffer(redis_client, job_id, trim_interval_s=0)
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


def test_stale_groups_are_dropped_counted_and_release_admission(buf, redis_client, job_id):
    buf.set_version(5)
    redis_client.set(buf.keys.started, 1)  # the stale group's admission slot
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


def test_recycle_policy_queues_the_prompt_again(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id, stale_policy="recycle")
    buf.ensure_group()
    buf.set_version(3)
    buf.put(_group(job_id, 0, "prompt-7"))
    assert buf.take_batch(1, 3, 1, block_ms=50, should_stop=lambda: buf.stats()["dropped_stale"] > 0) == []
    st = buf.stats()
    assert st["recycled"] == 1 and st["recycle_queue"] == 1
    assert redis_client.lpop(buf.keys.recycle) == b"prompt-7"


def test_keep_policy_trains_a_stale_group_and_never_trains_it_twice(redis_client, job_id):
    """`stale_policy: keep` (AReaL's rule with `admission: version`): a group past max_staleness is trained
    with its staleness counted; its id stays remembered, so a later redelivery is a duplicate, not a
    second training."""
    buf = ReplayBuffer(redis_client, job_id, stale_policy="keep", trim_interval_s=0)
    buf.ensure_group()
    buf.put(g := _group(job_id, 0, "long"))  # 5 - 0 = 5 > max_staleness 1
    batch = buf.take_batch(1, 5, 1, block_ms=100)
    assert [e.group.group_id for e in batch] == [g.group_id]
    buf.commit(batch, version=5, max_staleness=1)
    for v in (6, 7):
        buf.put(_group(job_id, v, f"fresh-{v}"))
        buf.commit(buf.take_batch(1, v, 1, block_ms=100), version=v, max_staleness=1)
    assert redis_client.zscore(buf.keys.trained, g.group_id) == 0
    buf.put(g)  # the same group arrives again (a producer retry)
    assert buf.take_batch(1, 8, 1, block_ms=50, should_stop=lambda: buf.stats()["duplicates"] > 0) == []
    st = buf.stats()
    assert st["dropped_stale"] == 0 and st["duplicates"] == 1 and st["consumed"] == 3
    assert st["staleness"] == {0: 2, 5: 1}


def test_uncommitted_entries_of_a_dead_consumer_are_reclaimed(redis_client, job_id):
    dead = ReplayBuffer(redis_client, job_id, consumer="trainer-dead")
    dead.ensure_group()
    dead.put(g := _group(job_id, 0))
    assert [e.group.group_id for e in dead.take_batch(1, 0, 0, block_ms=50)] == [g.group_id]
    # A live consumer with a zero idle threshold claims it at once (production default: 30 s).
    live = ReplayBuffer(redis_client, job_id, consumer="trainer-live", reclaim_idle_ms=1)
    redis_client.xgroup_setid(live.keys.groups, TRAINER_GROUP, "$")  # nothing new to read: only the claim
    batch = live.take_batch(1, 0, 0, block_ms=50)
    assert [e.group.group_id for e in batch] == [g.group_id]
    live.commit(batch, 0)
    st = live.stats()
    assert st["reclaimed"] == 1 and st["consumed"] == 1 and st["pending"] == 0


def test_own_entry_reclaimed_while_a_slow_batch_fills_is_not_a_duplicate(redis_client, job_id):
    """A batch that waits longer than reclaim_idle_ms for its last groups gets its own first entries back
    from XAUTOCLAIM. They are the same entries, not duplicate groups: nothing is acked or counted twice
    (the fault-injection run once counted one as both duplicate and consumed: books off by one)."""
    buf = ReplayBuffer(redis_client, job_id, reclaim_idle_ms=1, trim_interval_s=0)
    buf.ensure_group()
    buf.put(first := _group(job_id, 0, "p0"))
    reads = []

    def stop() -> bool:  # the second group arrives only after several reads (and claims) of the first
        reads.append(1)
        if len(reads) == 5:
            buf.put(_group(job_id, 0, "p1"))
        return len(reads) > 50

    batch = buf.take_batch(2, 0, 0, block_ms=20, should_stop=stop)
    assert [e.group.prompt_id for e in batch] == ["p0", "p1"] and batch[0].group == first
    st = buf.stats()
    assert st["reclaimed"] >= 1  # the first entry did come back through XAUTOCLAIM
    assert st["duplicates"] == 0 and st["pending"] == 2  # and is still pending, not acked
    buf.commit(batch, 0)
    st = buf.stats()
    assert st["consumed"] == 2 and st["produced"] == 2 and st["pending"] == 0 and st["duplicates"] == 0


def test_batch_stopped_short_goes_on_in_a_later_call_without_reading_an_entry_twice(redis_client, job_id):
    """The trainer interrupts a batch that fills slowly (to publish for joining engines) and goes on with
    the entries it already took: they come back through XAUTOCLAIM meanwhile, and are neither taken twice
    nor acked."""
    buf = ReplayBuffer(redis_client, job_id, reclaim_idle_ms=1, trim_interval_s=0)
    buf.ensure_group()
    buf.put(first := _group(job_id, 0, "p0"))
    checks = []

    def stop() -> bool:  # a few reads: p0, then waits for a second group that is not there yet
        checks.append(1)
        return len(checks) > 3

    partial = buf.take_batch(2, 0, 0, block_ms=20, should_stop=stop)
    assert [e.group for e in partial] == [first]
    time.sleep(0.01)  # past reclaim_idle_ms: the next read's XAUTOCLAIM hands p0 back
    buf.put(_group(job_id, 0, "p1"))
    batch = buf.take_batch(2, 0, 0, block_ms=20, batch=partial)
    assert batch is partial and [e.group.prompt_id for e in batch] == ["p0", "p1"]
    st = buf.stats()
    assert st["reclaimed"] >= 1 and st["duplicates"] == 0 and st["pending"] == 2
    buf.commit(batch, 0)
    st = buf.stats()
    assert st["consumed"] == 2 and st["pending"] == 0 and st["duplicates"] == 0


def test_restarted_consumer_rereads_each_own_pending_entry_once(redis_client, job_id):
    """A restarted consumer whose first pending entry is now stale: the batch fills from the second one
    and new entries, not from the same pending entry over and over."""
    first = ReplayBuffer(redis_client, job_id, consumer="trainer-0")
    first.ensure_group()
    first.put(_group(job_id, 0, "old"))
    first.put(_group(job_id, 1, "p1"))
    assert len(first.take_batch(2, 1, 1, block_ms=50)) == 2  # then the process dies, nothing committed
    first.put(_group(job_id, 2, "p2"))
    restarted = ReplayBuffer(redis_client, job_id, consumer="trainer-0")
    calls = []
    batch = restarted.take_batch(2, 2, 1, block_ms=20, should_stop=lambda: calls.append(1) or len(calls) > 20)
    assert [e.group.prompt_id for e in batch] == ["p1", "p2"]  # "old" (version 0) is stale at version 2
    st = restarted.stats()
    assert st["dropped_stale"] == 1 and st["duplicates"] == 0 and st["pending"] == 2


def test_restarted_consumer_rereads_its_own_pending_entries_first(redis_client, job_id):
    first = ReplayBuffer(redis_client, job_id, consumer="trainer-0")
    first.ensure_group()
    for i in range(3):
        first.put(_group(job_id, 0, f"p{i}"))
    taken = first.take_batch(2, 0, 0, block_ms=50)
    restarted = ReplayBuffer(redis_client, job_id, consumer="trainer-0")  # same name, fresh process state
    again = restarted.take_batch(3, 0, 0, block_ms=50)
    assert [e.entry_id for e in again[:2]] == [e.entry_id for e in taken]
    assert len(again) == 3


def test_trim_removes_only_acknowledged_entries(buf, job_id):
    for i in range(6):
        buf.put(_group(job_id, 0, f"p{i}"))
    first = buf.take_batch(2, 0, 0, block_ms=50)
    second = buf.take_batch(2, 0, 0, block_ms=50)
    buf.commit(second, 0)  # `first` is still pending: nothing before it may go
    assert buf.stats()["depth"] == 6
    buf.commit(first, 0)  # now the 4 oldest are acknowledged
    st = buf.stats()
    assert st["depth"] == 2 and st["unread"] == 2 and st["pending"] == 0
    assert len(buf.take_batch(2, 0, 0, block_ms=50)) == 2


def test_trained_ids_are_forgotten_only_once_a_redelivery_would_be_stale(buf, redis_client, job_id):
    g = _group(job_id, 4)
    buf.put(g)
    buf.commit(buf.take_batch(1, 4, 1, block_ms=50), version=4, max_staleness=1)
    assert redis_client.zscore(buf.keys.trained, g.group_id) == 4  # at version 5 it is still fresh
    buf.put(h := _group(job_id, 5))
    buf.commit(buf.take_batch(1, 5, 1, block_ms=50), version=5, max_staleness=1)
    assert redis_client.zscore(buf.keys.trained, g.group_id) is None  # at version 6 it is stale
    assert redis_client.zscore(buf.keys.trained, h.group_id) == 5


def test_memory_stays_bounded_over_a_long_run(buf, redis_client, job_id):
    for step in range(50):
        for i in range(4):
            buf.put(_group(job_id, step, f"s{step}-{i}"))
        buf.commit(buf.take_batch(4, step, 1, block_ms=50), version=step, max_staleness=1)
        buf.set_version(step + 1)
    st = buf.stats()
    assert st["consumed"] == 200 and st["depth"] == 0
    assert redis_client.zcard(buf.keys.trained) <= 2 * 4


def test_oldest_age_follows_the_oldest_entry_left_after_trimming(buf, job_id):
    import time

    from replay_buffer import metrics

    assert buf.oldest_age_s() == 0.0  # nothing written yet
    buf.put(_group(job_id, 0))
    first = buf.oldest_age_s()
    time.sleep(0.05)
    assert buf.oldest_age_s() > first >= 0.0  # the same entry, older now
    entries = buf.take_batch(1, 0, 1, 100)
    buf.commit(entries, 0, 1)
    buf.trim()  # acknowledged: trimmed away, nothing older left
    assert buf.oldest_age_s() == 0.0 and metrics.OLDEST_AGE._value.get() == 0.0
