"""A trainer process killed between read and ack loses nothing and trains nothing twice (real processes,
real redis-server)."""

import collections
import os
import signal
import subprocess
import sys
import time

from replay_buffer import ReplayBuffer, Sample, make_group

_CONSUMER = """
import sys, time, redis
from replay_buffer import ReplayBuffer
buf = ReplayBuffer(redis.Redis.from_url(sys.argv[1]), sys.argv[2], consumer="trainer-doomed")
batch = buf.take_batch(int(sys.argv[3]), version=0, max_staleness=0, block_ms=1000)
print(" ".join(e.group.group_id for e in batch), flush=True)
if sys.argv[4] == "commit":
    buf.commit(batch, 0)
    print("committed", flush=True)
time.sleep(3600)  # "training" -- killed here
"""


def _group(job, i):
    s = Sample.build(
        prompt_ids=[1, 2],
        response_ids=[3],
        loss_mask=[1],
        behavior_logprobs=[-0.3],
        token_versions=[0],
        reward=float(i % 2),
        finish_reason="stop",
    )
    return make_group(job, f"p{i}", [s, s])


def _run_doomed(url, job, n, mode):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER, url, job, str(n), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        taken = child.stdout.readline().split()
        if mode == "commit":
            assert child.stdout.readline().strip() == "committed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return taken


def _drain(buf, expected_total, trained_log):
    deadline = time.monotonic() + 30
    while buf.stats()["consumed"] < expected_total:
        assert time.monotonic() < deadline, buf.stats()
        batch = buf.take_batch(
            2, version=0, max_staleness=0, block_ms=100, should_stop=lambda: time.monotonic() > deadline
        )
        trained_log += [e.group.group_id for e in batch]
        buf.commit(batch, 0)


def test_killed_between_read_and_ack_every_group_trained_exactly_once(redis_server, redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id, consumer="trainer-survivor", reclaim_idle_ms=200)
    buf.ensure_group()
    groups = [_group(job_id, i) for i in range(6)]
    for g in groups:
        buf.put(g)
    taken = _run_doomed(redis_server.url, job_id, 3, "no-commit")
    assert len(taken) == 3 and buf.stats()["pending"] == 3  # read, never acked

    trained_log: list[str] = []
    _drain(buf, 6, trained_log)
    counts = collections.Counter(trained_log)
    assert counts == {g.group_id: 1 for g in groups}
    st = buf.stats()
    assert st["reclaimed"] == 3 and st["pending"] == 0 and st["consumed"] == 6 and st["duplicates"] == 0


def test_killed_after_commit_nothing_is_redelivered(redis_server, redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id, consumer="trainer-survivor", reclaim_idle_ms=1)
    buf.ensure_group()
    groups = [_group(job_id, i) for i in range(4)]
    for g in groups:
        buf.put(g)
    taken = _run_doomed(redis_server.url, job_id, 2, "commit")
    trained_log = list(taken)
    _drain(buf, 4, trained_log)
    assert collections.Counter(trained_log) == {g.group_id: 1 for g in groups}
    assert buf.stats()["reclaimed"] == 0
