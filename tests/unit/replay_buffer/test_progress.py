"""The progress stream's records: steps and evaluations round-trip through Redis as typed records, a field
not measured stays out of the JSON, records written before `kind` existed read as steps, and the run clock
reads the same for the buffer and the evaluator."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import redis.asyncio as aioredis

from replay_buffer import ReplayBuffer
from replay_buffer.progress import (
    UNSET,
    EvalRecord,
    RunClock,
    StepRecord,
    append_progress,
    as_dict,
    async_append_progress,
    decode_progress,
    entry_record,
    run_clock,
)


def _stored(r, keys) -> list:
    return [entry_record(fields) for _, fields in r.xrange(keys.progress)]


def test_a_step_round_trips_and_leaves_unmeasured_fields_out(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id)
    rec = StepRecord(version=3, step=3, elapsed_s=1.5, samples=8, response_tokens=64, mfu=None, loss=0.25)
    append_progress(redis_client, buf.keys, rec)
    (raw,) = [json.loads(f[b"j"]) for _, f in redis_client.xrange(buf.keys.progress)]
    assert raw["kind"] == "step" and raw["mfu"] is None  # due but not measured: written as null
    assert "kl_ref" not in raw and "release_s" not in raw  # not measured by this job: left out
    (back,) = _stored(redis_client, buf.keys)
    assert back == rec and back.kl_ref is UNSET
    d = as_dict(back)
    assert d["loss"] == 0.25 and d["mfu"] is None and "kl_ref" not in d and d["kind"] == "step"


def test_records_without_kind_read_as_steps_and_unknown_keys_are_ignored():
    old = json.dumps({"version": 2, "elapsed_s": 4, "response_tokens": 10, "staleness_max": 1.0, "gone": 1})
    rec = decode_progress(old)
    assert isinstance(rec, StepRecord)
    assert (rec.version, rec.elapsed_s, rec.response_tokens, rec.staleness_max) == (2, 4.0, 10, 1)
    assert rec.samples == 0 and rec.optimizer_steps == 1  # the reader's defaults for records without them
    with pytest.raises(msgspec.ValidationError):
        decode_progress(json.dumps({"kind": "nonsense", "version": 1}))


def test_an_evaluation_is_told_apart_by_kind(redis_server, redis_client, job_id):
    keys = ReplayBuffer(redis_client, job_id).keys
    rec = EvalRecord(
        version=4, version_max=5, eval={"accuracy": 0.5, "pass@4": 0.75}, elapsed_s=9.0, attempt=1
    )

    async def go():
        r = aioredis.from_url(redis_server.url)
        try:
            await async_append_progress(r, keys, rec)
        finally:
            await r.aclose()

    asyncio.run(go())
    append_progress(redis_client, keys, StepRecord(version=5, elapsed_s=10.0))
    got = _stored(redis_client, keys)
    assert got[0] == rec and isinstance(got[1], StepRecord)
    assert as_dict(got[0])["kind"] == "eval" and as_dict(got[0])["eval"]["pass@4"] == 0.75


def test_run_clock_reads_started_at_or_where_the_last_attempt_ended():
    assert run_clock({}) == RunClock(started_at=None, elapsed_before=0.0, attempt=1)
    waiting = run_clock({b"elapsed_before": b"12.5", b"attempt": b"2", b"run_id": b"x"})
    assert waiting.reading(100.0) is None and waiting.elapsed_s(100.0) == 12.5 and waiting.attempt == 2
    running = run_clock({"started_at": "90.0", "elapsed_before": "12.5", "attempt": "2"})
    assert running.reading(100.0) == running.elapsed_s(100.0) == 10.0


def test_the_buffer_clock_continues_a_resumed_attempt(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id)
    buf.begin_run(resume=False)
    assert buf.clock() is None
    assert 0.0 <= buf.start_clock() < 5.0
    append_progress(redis_client, buf.keys, StepRecord(version=1, elapsed_s=100.0))
    info = buf.begin_run(resume=True)  # the next attempt continues the clock where the records ended
    assert info["attempt"] == 2 and buf.clock() is None
    assert 100.0 <= buf.start_clock() < 105.0
    assert run_clock(redis_client.hgetall(buf.keys.run)).attempt == 2
