"""Prometheus file_sd targets from Redis (slipstream/cluster/targets.py), against a real redis-server and as the
app's ACL user, who may SCAN but not KEYS."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import redis
from prometheus_client import REGISTRY
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.net import free_port
from replay_buffer.redis_server import ManagedRedis
from slipstream.cluster.targets import FILE_NAME, TargetWriter, write_file_sd

WAIT_S = 30.0
"""Upper bound on waiting for the writer thread; a timeout only, never a performance threshold."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Its own Redis: the session one is shared with tests whose jobs register targets of their own.
    with ManagedRedis(data_dir=tmp_path_factory.mktemp("targets-redis")) as s:
        yield s


@pytest.fixture
def r(server):
    client = redis.Redis.from_url(server.url)  # the ACL user `slipstream`, as the control plane connects
    yield client
    admin = redis.Redis.from_url(server.admin_url)
    admin.flushall()
    admin.close()
    client.close()


def _read(out_dir) -> list[dict]:
    return json.loads((out_dir / FILE_NAME).read_text())


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_app_user_may_not_keys(r):
    # Why write_file_sd must SCAN: KEYS is refused to the app user.
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.keys("slipstream:*")


def test_two_jobs_labels_and_order(r, tmp_path):
    r.hset(
        "slipstream:alpha:metrics_targets",
        mapping={
            "trainer-0": "127.0.0.1:9001",
            "engine-10": "127.0.0.1:9003",
            "engine-2": "127.0.0.1:9002",
            "external-engines": "127.0.0.1:9004",
        },
    )
    r.hset("slipstream:beta:metrics_targets", mapping={"rollout-0": "127.0.0.1:9101"})
    r.set("slipstream:alpha:version", 3)  # other keys of a job are not targets

    assert write_file_sd(r, tmp_path) == 5
    assert _read(tmp_path) == [
        {
            "targets": ["127.0.0.1:9002"],
            "labels": {"job": "alpha", "replica": "engine-2", "component": "engine"},
        },
        {
            "targets": ["127.0.0.1:9003"],
            "labels": {"job": "alpha", "replica": "engine-10", "component": "engine"},
        },
        {
            "targets": ["127.0.0.1:9004"],
            "labels": {"job": "alpha", "replica": "external-engines", "component": "external-engines"},
        },
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {"job": "alpha", "replica": "trainer-0", "component": "trainer"},
        },
        {
            "targets": ["127.0.0.1:9101"],
            "labels": {"job": "beta", "replica": "rollout-0", "component": "rollout"},
        },
    ]
    assert REGISTRY.get_sample_value("slipstream_control_scrape_targets") == 5
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left behind


def test_unchanged_file_is_not_rewritten(r, tmp_path):
    r.hset("slipstream:gamma:metrics_targets", "engine-0", "127.0.0.1:9201")
    write_file_sd(r, tmp_path)
    path = tmp_path / FILE_NAME
    before = os.stat(path)
    assert write_file_sd(r, tmp_path) == 1
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    r.hset("slipstream:gamma:metrics_targets", "engine-0", "127.0.0.1:9202")  # the engine restarted
    write_file_sd(r, tmp_path)
    assert os.stat(path).st_ino != before.st_ino  # replaced (os.replace), not written in place
    assert _read(tmp_path)[0]["targets"] == ["127.0.0.1:9202"]


def test_removed_target_disappears(r, tmp_path):
    key = "slipstream:delta:metrics_targets"
    r.hset(key, mapping={"engine-0": "127.0.0.1:9301", "engine-1": "127.0.0.1:9302"})
    assert write_file_sd(r, tmp_path) == 2
    r.hdel(key, "engine-1")  # scaled down
    assert write_file_sd(r, tmp_path) == 1
    assert [g["labels"]["replica"] for g in _read(tmp_path)] == ["engine-0"]
    r.delete(key)  # job gone
    assert write_file_sd(r, tmp_path) == 0
    assert _read(tmp_path) == []


@pytest.mark.parametrize("state", ["succeeded", "failed", "stopped", "interrupted"])
def test_ended_job_targets_are_removed(r, tmp_path, state):
    # The hash outlives the job's processes (its keys are cleared only by the next run of that name):
    # an ended job's targets must leave the file, or Prometheus shows them `down` forever.
    r.hset(
        "slipstream:done:metrics_targets",
        mapping={"engine-0": "127.0.0.1:9501", "trainer-0": "127.0.0.1:9502"},
    )
    r.hset("slipstream:live:metrics_targets", "engine-0", "127.0.0.1:9503")
    r.set("slipstream:done:status", json.dumps({"state": "running"}))
    r.set("slipstream:live:status", json.dumps({"state": "running"}))
    writer = TargetWriter(r, tmp_path)
    writer.tick()
    assert sorted(g["labels"]["job"] for g in _read(tmp_path)) == ["done", "done", "live"]

    r.set("slipstream:done:status", json.dumps({"state": state, "error": "x"}))
    writer.tick()
    assert [(g["labels"]["job"], g["targets"]) for g in _read(tmp_path)] == [("live", ["127.0.0.1:9503"])]
    assert write_file_sd(r, tmp_path) == 1

    r.set("slipstream:done:status", json.dumps({"state": "running"}))  # a new run of the same name
    assert write_file_sd(r, tmp_path) == 3


def test_writer_thread_follows_redis_and_stops(r, tmp_path, caplog):
    r.hset("slipstream:eps:metrics_targets", "trainer-0", "127.0.0.1:9401")
    writer = TargetWriter(r, tmp_path, interval_s=0.05)
    with caplog.at_level(logging.INFO, logger="slipstream.cluster.targets"):
        writer.start()
        _wait_for(lambda: (tmp_path / FILE_NAME).exists() and len(_read(tmp_path)) == 1, "the first target")
        r.hset("slipstream:eps:metrics_targets", "engine-0", "127.0.0.1:9402")  # a new engine joins
        _wait_for(lambda: len(_read(tmp_path)) == 2, "the new target")
        writer.stop()
    assert not any(t.name == "slipstream-targets" for t in threading.enumerate())
    assert [g["labels"]["replica"] for g in _read(tmp_path)] == ["engine-0", "trainer-0"]
    changes = [rec.getMessage() for rec in caplog.records if "scrape targets:" in rec.getMessage()]
    assert len(changes) == 2 and "added eps/engine-0=127.0.0.1:9402" in changes[1]


def test_writer_survives_redis_down(tmp_path, caplog):
    # Redis is not up yet: the writer warns and retries, then picks the targets up once it is.
    port, password, app_password = free_port(), "pw-targets-test", "pw-targets-app"
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        username="slipstream",
        password=app_password,  # the control plane's user: its own password, not the admin's
        socket_timeout=5,
        retry=Retry(NoBackoff(), 0),  # redis-py's default retries a refused connection for ~3.5 s
    )
    out = tmp_path / "targets"
    writer = TargetWriter(client, out, interval_s=0.05)
    with caplog.at_level(logging.WARNING, logger="slipstream.cluster.targets"):
        writer.start()
        _wait_for(lambda: any("not updated" in rec.getMessage() for rec in caplog.records), "a warning")
        with ManagedRedis(
            data_dir=tmp_path / "redis", port=port, password=password, app_password=app_password
        ) as server:
            server.client().hset("slipstream:zeta:metrics_targets", "rollout-1", "127.0.0.1:9501")
            _wait_for(lambda: (out / FILE_NAME).exists() and len(_read(out)) == 1, "the target")
            writer.stop()
    assert _read(out)[0]["labels"] == {"job": "zeta", "replica": "rollout-1", "component": "rollout"}
    client.close()
