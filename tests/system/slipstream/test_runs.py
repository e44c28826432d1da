"""Runs never mix, on a real cluster (Redis, Ray head, control API) started by the test, with one job name
submitted three times:

1. a run that is rescaled (trainers 1 -> 2) and stopped: its progress is one clock (elapsed never restarts
   with the new pool) and `status`'s samples/s is the records' own rate;
2. the same name resubmitted with `trainer.resume_from` an older checkpoint of it: the same run, attempt
   2; the groups the first attempt generated past that checkpoint are dropped as from the future (none
   trained with a negative staleness) and the progress has each version once, in order;
3. the same name submitted again without resume: a new run from version 0 with an empty stream; its
   progress, buffer counters and samples file hold only the new run.
"""

from pathlib import Path

import pytest
import redis
from cluster_helpers import QUICK_POLL_S, spec_text, wait_for

from replay_buffer import ReplayBuffer
from replay_buffer.keys import TRAINER_GROUP
from replay_buffer.schema import decode

NAME = "again"
GROUPS_PER_STEP, GROUP_SIZE = 2, 4


def _stop(client) -> dict:
    client.stop(NAME)
    return wait_for(
        client,
        NAME,
        "the stop",
        lambda s: s["state"] in ("stopped", "failed", "succeeded"),
        ended_ok=True,
        poll_s=QUICK_POLL_S,
    )


def _progress(client) -> dict:
    return client._call("GET", f"/jobs/{NAME}/progress")


def _left_for_the_trainer(r, job) -> list:
    """Groups a trainer will still be handed: pending (redelivered) and unread entries of the stream."""
    buf = ReplayBuffer(r, job)
    info = buf._group_info()
    pending = {e["message_id"] for e in r.xpending_range(buf.keys.groups, TRAINER_GROUP, "-", "+", 100_000)}
    last = info["last-delivered-id"].decode()
    return [
        decode(fields[b"d"])
        for eid, fields in r.xrange(buf.keys.groups)
        if eid in pending or tuple(map(int, eid.decode().split("-"))) > tuple(map(int, last.split("-")))
    ]


def _one_clock(records: list[dict]) -> None:
    versions = [p["version"] for p in records]
    assert versions == list(range(1, len(records) + 1)), versions  # each version once, in order
    elapsed = [p["elapsed_s"] for p in records]
    assert all(b > a for a, b in zip(elapsed, elapsed[1:], strict=False)), elapsed  # one clock


def test_resubmissions_are_runs_that_never_mix(info, client, tmp_path, tiny_model_dir):
    r = redis.Redis.from_url(info.redis_url)
    spec = spec_text(
        tiny_model_dir,
        NAME,
        max_staleness=4,
        group_size=GROUP_SIZE,
        groups_per_step=GROUPS_PER_STEP,
        trainer="{checkpoint_every: 2, keep_checkpoints: 100}",
    )

    # 1. a run, rescaled and stopped
    client.submit(spec, [], str(tmp_path))
    # the first pool trains longer than the second will: a second pool whose elapsed_s restarted at 0
    # would show it going back
    st = wait_for(client, NAME, "first steps", lambda s: s.get("version", 0) >= 8, poll_s=QUICK_POLL_S)
    first_run = st["run_id"]
    assert st["attempt"] == 1
    client.scale(NAME, generators=None, trainers=2)
    v0 = st["version"]
    wait_for(
        client,
        NAME,
        "2 trainers",
        lambda s: s["pools"]["trainers"] == 2 and s["version"] > v0 + 2,
        poll_s=QUICK_POLL_S,
    )
    st = _stop(client)
    assert st["state"] == "stopped", st
    records = _progress(client)["records"]
    _one_clock(records)  # the pool after the rescale continued the run's clock
    assert {(p["run_id"], p["attempt"]) for p in records} == {(first_run, 1)}
    last = records[-1]
    own_rate = len(records) * GROUPS_PER_STEP * GROUP_SIZE / last["elapsed_s"]
    assert st["samples_per_s"] == pytest.approx(own_rate)  # status reads the run's own rate
    assert st["elapsed_s"] >= last["elapsed_s"]
    stopped_at = st["version"]
    print(f"run {first_run}: stopped at version {stopped_at}, {own_rate:.1f} samples/s")

    # 2. the same name resumed from an older checkpoint: groups generated after it are from the future
    out = Path(st["output_dir"])
    resume_at = 2
    ckpt = out / "checkpoints" / f"step-{resume_at:08d}"
    assert ckpt.is_dir() and stopped_at >= resume_at + 4
    future = [g for g in _left_for_the_trainer(r, NAME) if g.max_version > resume_at]
    client.submit(spec, [f"trainer.resume_from={ckpt}"], str(tmp_path))
    st = wait_for(
        client,
        NAME,
        "steps after the resume",
        lambda s: s.get("attempt") == 2 and s["version"] >= resume_at + 6,
        poll_s=QUICK_POLL_S,
    )
    assert st["run_id"] == first_run  # a resume continues the run
    st = _stop(client)
    records = _progress(client)["records"]
    _one_clock(records)  # the first attempt's records past the checkpoint are gone; no version twice
    assert {p["attempt"] for p in records if p["version"] <= resume_at} == {1}
    assert {p["attempt"] for p in records if p["version"] > resume_at} == {2}
    assert min(p["staleness_mean"] for p in records) >= 0  # nothing trained from the future
    assert min(p["staleness_max"] for p in records) >= 0
    stats = ReplayBuffer(r, NAME).stats()
    assert stats["dropped_future"] >= len(future) > 0, (stats, len(future))
    assert all(k >= 0 for k in stats["staleness"])
    print(f"attempt 2 of run {first_run}: {len(future)} groups from the future dropped; {stats}")

    # 3. the same name submitted again without resume: a new run, from version 0
    client.submit(spec, ["algorithm.total_steps=3", "trainer.checkpoint_every=0"], str(tmp_path))
    st = wait_for(
        client,
        NAME,
        "the new run's end",
        lambda s: s["state"] in ("succeeded", "failed", "stopped"),
        ended_ok=True,
        poll_s=QUICK_POLL_S,
    )
    assert st["state"] == "succeeded" and st["version"] == 3, st
    assert st["run_id"] != first_run and st["attempt"] == 1
    records = _progress(client)["records"]
    assert [p["version"] for p in records] == [1, 2, 3]
    assert {p["run_id"] for p in records} == {st["run_id"]}
    stats = ReplayBuffer(r, NAME).stats()
    assert stats["steps"] == 3 and stats["consumed"] == 3 * GROUPS_PER_STEP
    assert stats["dropped_future"] == 0 and stats["duplicates"] == 0
    # the earlier run's checkpoints are kept, apart: this run's `latest` and pruning see only its own
    assert (out / f"checkpoints.before-{st['run_id']}" / f"step-{resume_at:08d}").is_dir()
    assert not list((out / "checkpoints").glob("step-*"))
    samples = (out / "samples.txt").read_text()
    assert [ln.split()[2] for ln in samples.splitlines() if ln.startswith("=== version")] == ["1", "2", "3"]
    assert st["samples_per_s"] == pytest.approx(3 * GROUPS_PER_STEP * GROUP_SIZE / records[-1]["elapsed_s"])
