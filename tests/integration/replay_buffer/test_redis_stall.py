"""The buffer's books across a Redis stall: a write whose reply was lost is sent again by redis-py's retry
(replay_buffer/client.py) and Redis, once it continues, runs both copies. The trainer's commit, and the
acknowledgement of a dropped or skipped group, must count once however often they are replayed: the
counters (steps, consumed, dropped_stale, duplicates, the staleness and length histograms) stay balanced
against the versions trained and the groups produced. Real redis-server, SIGSTOPped for the stall."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from prometheus_client import REGISTRY

from replay_buffer import ReplayBuffer, Sample, make_group
from replay_buffer.client import connect
from replay_buffer.redis_server import ManagedRedis

SOCKET_TIMEOUT_S = 0.3
"""The clients' socket timeout here (production: redis-py's 5 s): short, so the stall below outlasts it."""
STALL_S = 2.0
"""How long Redis stays stopped: several socket timeouts, so the write is sent again while it sleeps."""


def _group(job, version, prompt):
    s = Sample.build(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5][: 1 + len(prompt) % 3],
        loss_mask=[1] * (1 + len(prompt) % 3),
        behavior_logprobs=[-0.1] * (1 + len(prompt) % 3),
        token_versions=[version] * (1 + len(prompt) % 3),
        reward=0.5,
        finish_reason="stop",
    )
    return make_group(job, prompt, [s, s])


def _books(buf: ReplayBuffer) -> dict:
    """Everything a commit or a drop counts, and the ledger."""
    r = buf.r
    return {
        "stats": buf.stats(),
        "lengths": buf.length_histograms(),
        "ledger": [g.decode() for g in r.lrange(buf.keys.ledger, 0, -1)],
        "trained": sorted(g.decode() for g in r.zrange(buf.keys.trained, 0, -1)),
    }


def _balanced(st: dict) -> bool:
    accounted = st["consumed"] + st["dropped_stale"] + st["dropped_future"] + st["dead_letter"]
    accounted += st["duplicates"] + st["pending"] + st["unread"]
    return st["produced"] == accounted


def test_a_commit_sent_again_as_a_retry_would_counts_once(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id, trim_interval_s=0, ledger=True)
    buf.ensure_group()
    for i in range(3):
        buf.put(_group(job_id, 0, f"p{i}"))
    batch = buf.take_batch(3, version=1, max_staleness=1, block_ms=100)
    buf.commit(batch, version=1, max_staleness=1)
    once = _books(buf)
    assert once["stats"]["steps"] == 1 and once["stats"]["consumed"] == 3
    assert once["stats"]["staleness"] == {1: 3}

    buf.commit(batch, version=1, max_staleness=1)  # the identical commit again: what a retry re-sends
    assert _books(buf) == once
    assert _balanced(once["stats"])

    # the next step's commit (other entries) is a commit of its own
    buf.put(_group(job_id, 1, "next"))
    buf.commit(buf.take_batch(1, version=2, max_staleness=1, block_ms=100), version=2, max_staleness=1)
    st = buf.stats()
    assert st["steps"] == 2 and st["consumed"] == 4 and _balanced(st)


def test_a_drop_or_skip_sent_again_counts_once(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id, trim_interval_s=0)
    buf.ensure_group()
    buf.set_version(5)
    redis_client.set(buf.keys.started, 3)
    buf.put(_group(job_id, 0, "stale"))
    buf.put(fresh := _group(job_id, 5, "fresh"))
    stale = _entries(buf)[0]  # (read now: acknowledged entries are trimmed at a commit)
    buf.commit(buf.take_batch(1, version=5, max_staleness=1, block_ms=100), version=5)
    buf.put(fresh)  # the trained group again: skipped as a duplicate
    buf.put(_group(job_id, 5, "wanted"))
    duplicate = _entries(buf)[-2]
    assert len(buf.take_batch(1, version=5, max_staleness=1, block_ms=100)) == 1
    before = _books(buf)
    assert before["stats"]["dropped_stale"] == 1 and before["stats"]["duplicates"] == 1
    assert before["stats"]["started"] == 2  # the stale group's slot given back once

    # what redis-py's retry re-sends for each of them, after Redis ran the first copy
    buf._drop_stale(stale, 5)
    buf._skip_duplicate(duplicate)
    after = _books(buf)
    assert after == before, (before["stats"], after["stats"])
    assert _balanced(after["stats"])


def _entries(buf: ReplayBuffer):
    """Every entry still in the stream, as the trainer decoded it."""
    from replay_buffer import decode
    from replay_buffer.stream import Entry, as_str

    return [Entry(as_str(eid), decode(f[b"d"])) for eid, f in buf.r.xrange(buf.keys.groups)]


@pytest.fixture
def stalled_redis(tmp_path):
    """A private redis-server (the session's one must not stall other tests) and a `stall(fn)` that runs fn
    in a thread while Redis is SIGSTOPped for STALL_S, continues Redis (always) and returns fn's result."""
    with ManagedRedis(data_dir=tmp_path / "redis") as server:

        def stall(fn):
            out: list = []
            thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                thread.start()
                time.sleep(STALL_S)  # the fault's length, not a synchronisation: fn is retrying meanwhile
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            thread.join(60)
            assert not thread.is_alive() and out, "the call did not finish after Redis continued"
            return out[0]

        yield server, stall


def test_the_books_balance_after_redis_stalls_during_a_commit(stalled_redis, job_id):
    server, stall = stalled_redis
    # the trainer's client as in production (replay_buffer.client.connect: retries through an outage),
    # with a socket timeout short enough for the stall to outlast it
    buf = ReplayBuffer(connect(server.url, socket_timeout=SOCKET_TIMEOUT_S), job_id, ledger=True)
    buf.ensure_group()
    for i in range(8):
        buf.put(_group(job_id, 0, f"p{i}"))
    # mid-job: one step committed already (its script is loaded in Redis), the next one's batch read
    buf.commit(buf.take_batch(4, version=0, max_staleness=1, block_ms=50), version=0, max_staleness=1)
    batch = buf.take_batch(4, version=1, max_staleness=1, block_ms=50)
    assert len(batch) == 4

    replays = REGISTRY.get_sample_value("slipstream_buffer_commit_replays_total")
    stall(lambda: buf.commit(batch, version=1, max_staleness=1))
    # the client did send it again, and Redis did run both copies: the second found the first's id
    assert REGISTRY.get_sample_value("slipstream_buffer_commit_replays_total") == replays + 1

    books = _books(ReplayBuffer(server.client(), job_id))
    st = books["stats"]
    print(f"after a {STALL_S} s stall during the commit: {st}")
    assert st["steps"] == 2 and st["consumed"] == 8, st  # two steps, their groups counted once
    assert st["staleness"] == {0: 4, 1: 4}
    assert sum(books["lengths"]["trained"].values()) == 16  # 2 samples per group
    assert len(books["ledger"]) == 8 and len(set(books["ledger"])) == 8
    assert _balanced(st)
