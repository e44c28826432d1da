"""Runs never mix, against a real redis-server: a group with a token from a version newer than the
trainer's is never trained (dropped, counted, its slot given back); a new run of a job name starts from
empty per-run state with a new run_id, a resumed one continues its run, its clock and its progress
without the records of steps it lost."""

import json

import pytest
from prometheus_client import REGISTRY

from replay_buffer import ReplayBuffer, Sample, make_group
from slipstream.job.progress import ProgressReader
from slipstream.job.store import JobStore


def _group(job, versions, prompt="p"):
    s = Sample.build(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.1, -0.2],
        token_versions=list(versions),
        reward=0.5,
        finish_reason="stop",
    )
    return make_group(job, prompt, [s, s])


@pytest.fixture
def buf(redis_client, job_id):
    b = ReplayBuffer(redis_client, job_id, trim_interval_s=0)
    b.ensure_group()
    return b


def _future_metric() -> float:
    return REGISTRY.get_sample_value("slipstream_buffer_groups_dropped_future_total") or 0.0


@pytest.mark.parametrize("policy", ["drop", "recycle"])
def test_groups_from_a_newer_version_are_never_trained(redis_client, job_id, policy):
    buf = ReplayBuffer(redis_client, job_id, trim_interval_s=0, stale_policy=policy)
    buf.ensure_group()
    # A resumed trainer at version 391 finds groups an earlier attempt generated at version 458.
    buf.set_version(391)
    redis_client.set(buf.keys.started, 3)  # the three groups' admission slots
    future = _group(job_id, [458, 458], "future")
    partial = _group(job_id, [390, 392], "partial")  # its last token came from a newer version
    ok = _group(job_id, [391, 391], "ok")
    for g in (future, partial, ok):
        buf.put(g)
    m0 = _future_metric()
    batch = buf.take_batch(1, version=391, max_staleness=2, block_ms=100)
    assert [e.group.group_id for e in batch] == [ok.group_id]
    buf.commit(batch, version=391, max_staleness=2)
    st = buf.stats()
    assert st["dropped_future"] == 2 and st["dropped_stale"] == 0 and st["consumed"] == 1
    assert st["staleness"] == {0: 1}  # nothing trained with a negative staleness
    assert st["pending"] == 0 and st["unread"] == 0  # acknowledged: never delivered again
    assert int(redis_client.get(buf.keys.started)) == 1  # the dropped groups gave their slots back
    assert _future_metric() - m0 == 2
    recycled = [p.decode() for p in redis_client.lrange(buf.keys.recycle, 0, -1)]
    assert recycled == (["future", "partial"] if policy == "recycle" else [])
    # the books balance with the new outcome
    accounted = st["consumed"] + st["dropped_stale"] + st["dropped_future"] + st["dead_letter"]
    assert st["produced"] == accounted + st["duplicates"] + st["pending"] + st["unread"]


def _progress(r, keys, version, elapsed, samples=8, tokens=16):
    rec = {"version": version, "elapsed_s": elapsed, "samples": samples, "response_tokens": tokens}
    r.xadd(keys.progress, {"j": json.dumps(rec)})


def test_a_new_run_starts_from_empty_state_and_keeps_the_control_records(buf, redis_client, job_id):
    store = JobStore(redis_client)
    store.create(job_id, "{}", 1, 1)
    first = buf.begin_run(resume=False)
    assert first["attempt"] == 1
    buf.ensure_group()
    # the first run leaves state behind
    buf.set_version(458)
    buf.put(_group(job_id, [457, 458]))
    buf.take_batch(1, version=458, max_staleness=2, block_ms=100)  # pending
    buf.put(_group(job_id, [458, 458], "unread"))
    redis_client.set(buf.keys.started, 40)
    redis_client.zadd(
        buf.keys.workers, {"w1": 1}
    )  # as admission does: a worker's lease, then its in-flight list
    redis_client.rpush(buf.keys.inflight("w1"), "p9")
    redis_client.zadd(buf.keys.trained, {"g": 1})
    _progress(redis_client, buf.keys, 458, 100.0)
    redis_client.zadd(f"slipstream:{job_id}:engines", {"http://127.0.0.1:1": 1})
    buf.start_clock()

    second = buf.begin_run(resume=False)
    assert second["run_id"] != first["run_id"] and second["attempt"] == 1
    leftovers = [k.decode() for k in redis_client.scan_iter(match=f"slipstream:{job_id}:*")]
    control = {
        f"slipstream:{job_id}:{n}" for n in ("spec", "desired", "status", "run", "submission", "lease")
    }
    assert set(leftovers) <= control  # every per-run key is gone; the control records are not
    assert store.status(job_id).state == "submitted" and store.desired(job_id).trainers == 1
    assert buf.version() == 0 and buf.clock() is None
    buf.ensure_group()
    st = buf.stats()
    assert st["depth"] == st["produced"] == st["pending"] == st["started"] == 0
    assert ProgressReader(redis_client, job_id).read(block_ms=0) == []


def test_a_resumed_run_continues_its_run_clock_and_progress(buf, redis_client, job_id):
    run = buf.begin_run(resume=False)
    assert buf.start_clock() >= 0
    for v, t in ((1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)):
        _progress(redis_client, buf.keys, v, t)
    buf.put(_group(job_id, [3, 3], "kept"))

    again = buf.begin_run(resume=True)  # a resubmission with trainer.resume_from
    assert again["run_id"] == run["run_id"] and again["attempt"] == 2
    assert buf.stats()["produced"] == 1  # the run's buffer stays
    assert buf.clock() is None  # until the attempt's first trainer pool starts it ...
    assert 40.0 <= buf.start_clock() < 40.0 + 60  # ... where the last attempt's records ended
    # the trainer resumed from a checkpoint at version 2: the records of steps 3 and 4 are lost steps'
    assert buf.truncate_progress(2) == 2
    assert buf.run_info()["trims"] == 1
    reader = ProgressReader(redis_client, job_id)
    assert [r["version"] for r in reader.read(block_ms=0)] == [1, 2]
    # a second pool of the attempt continues the same clock (no second origin)
    started = redis_client.hget(buf.keys.run, "started_at")
    buf.start_clock()
    assert redis_client.hget(buf.keys.run, "started_at") == started


def test_progress_reader_rates_are_the_runs_own_and_drop_superseded_records(redis_client, job_id):
    """A reader that saw records which a restarted pool then repeats (it resumed from an older checkpoint)
    keeps only the newer ones; rates are the records' own: samples (tokens) ÷ the run's elapsed_s."""
    buf = ReplayBuffer(redis_client, job_id)
    reader = ProgressReader(redis_client, job_id)
    for v, t in ((1, 10.0), (2, 20.0), (3, 30.0)):
        _progress(redis_client, buf.keys, v, t, samples=8, tokens=16)
    assert reader.read(block_ms=0)[-1]["samples_per_s"] == pytest.approx(24 / 30.0)
    _progress(redis_client, buf.keys, 3, 45.0, samples=4, tokens=8)  # the restarted pool's step 3
    rec = reader.read(block_ms=0)[-1]
    assert [r["version"] for r in reader.records] == [1, 2, 3]
    assert rec["samples_per_s"] == pytest.approx((8 + 8 + 4) / 45.0)
    assert rec["tokens_per_s"] == pytest.approx((16 + 16 + 8) / 45.0)
