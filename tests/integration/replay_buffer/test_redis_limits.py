"""Redis' memory limit and per-job ACL users, on a real managed redis-server: at `maxmemory` a write fails
with a clear error (and a metric) and nothing stored is evicted; a job's user reaches its own keys only,
may not flush scripts, and survives a Redis restart."""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from replay_buffer import BufferProducer, ReplayBuffer, Sample, make_group
from replay_buffer import metrics as bm
from replay_buffer.redis_server import ManagedRedis, job_user, set_job_user
from replay_buffer.stream import RedisFullError

MAXMEMORY = 4 << 20
"""Small enough to fill in a moment, above what an empty redis-server uses (~1 MB)."""


def _group(job, prompt_id="p", tokens=1):
    s = Sample.build(
        prompt_ids=[1],
        response_ids=list(np.arange(tokens) % 7),
        loss_mask=[1] * tokens,
        behavior_logprobs=[-0.1] * tokens,
        token_versions=[0] * tokens,
        reward=1.0,
        finish_reason="stop",
    )
    return make_group(job, prompt_id, [s, s])


def _job_url(server: ManagedRedis, job: str) -> str:
    password = secrets.token_hex(16)
    set_job_user(redis.Redis.from_url(server.admin_url), job, password)
    return f"redis://{job_user(job)}:{password}@{server.host}:{server.port}/0"


@pytest.fixture
def small_redis(tmp_path):
    with ManagedRedis(data_dir=tmp_path / "r", maxmemory=MAXMEMORY) as server:
        yield server


def _counter(c) -> float:
    return c._value.get()


def test_redis_runs_with_a_memory_limit_and_never_evicts(small_redis):
    admin = redis.Redis.from_url(small_redis.admin_url)
    assert admin.config_get("maxmemory") == {"maxmemory": str(MAXMEMORY)}
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    # the default limit applies when none is given
    assert ManagedRedis().config_text().count("maxmemory 2gb") == 1


def test_a_full_redis_gives_a_clear_error_a_metric_and_loses_nothing(small_redis):
    job = "full"
    r = redis.Redis.from_url(_job_url(small_redis, job))
    buf = ReplayBuffer(r, job, trim_interval_s=0)
    buf.ensure_group()
    before = _counter(bm.REDIS_OOM)
    stored = 0
    with pytest.raises(RedisFullError) as err:
        for i in range(10_000):
            buf.put(_group(job, f"p{i}", tokens=256))
            stored += 1
    msg = str(err.value)
    assert "Redis is full" in msg and f"of maxmemory {MAXMEMORY} bytes" in msg and "--redis-maxmemory" in msg
    assert _counter(bm.REDIS_OOM) == before + 1
    assert stored > 0 and r.xlen(buf.keys.groups) == stored  # nothing evicted to make room

    async def producer_put():
        client = aioredis.Redis.from_url(_job_url(small_redis, job))
        try:
            return await BufferProducer(client, job, worker_id="w0").put(_group(job, "x", tokens=256))
        finally:
            await client.aclose()

    with pytest.raises(RedisFullError, match="Redis is full"):
        asyncio.run(producer_put())  # a rollout worker's put: the same clear error
    assert _counter(bm.REDIS_OOM) == before + 2
    assert r.xlen(buf.keys.groups) == stored

    # the trainer's periodic trim reports memory against the limit
    buf.trim()
    assert bm.REDIS_MAXMEMORY._value.get() == MAXMEMORY
    assert bm.REDIS_USED_MEMORY._value.get() > MAXMEMORY / 2


def test_a_jobs_user_reaches_its_own_keys_only(small_redis):
    a = redis.Redis.from_url(_job_url(small_redis, "a"))
    _job_url(small_redis, "b")
    control = small_redis.client()
    control.set("slipstream:b:version", 3)
    control.hset("slipstream:control:jobs", "a", 1)
    a.set("slipstream:a:version", 1)
    assert a.get("slipstream:a:version") == b"1"
    for op in (
        lambda: a.get("slipstream:b:version"),
        lambda: a.set("slipstream:b:version", 9),
        lambda: a.delete("slipstream:b:version"),
        lambda: a.hgetall("slipstream:control:jobs"),
        lambda: a.hset("slipstream:control:jobs", "a", 2),
        lambda: a.get("slipstream:a"),  # the prefix is `slipstream:a:`, not `slipstream:a*`
        lambda: a.set("slipstream:ab:x", 1),
        lambda: a.scan(),  # would list other jobs' key names
        lambda: a.script_flush(),
        lambda: a.flushall(),
        lambda: a.config_get("maxmemory"),
        lambda: a.execute_command("ACL", "SETUSER", "job-a", "~*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            op()
    # a Lua script of job a reaches job b's keys no more than a command does
    script = a.register_script("return redis.call('GET', KEYS[1])")
    assert script(keys=["slipstream:a:version"]) == b"1"
    with pytest.raises(redis.exceptions.ResponseError, match="permission|no permissions"):
        script(keys=["slipstream:b:version"])
    assert control.get("slipstream:b:version") == b"3"
    with pytest.raises(redis.exceptions.NoPermissionError):
        control.script_flush()  # the control plane's user may not flush the jobs' scripts either


def test_a_jobs_user_survives_a_redis_restart(tmp_path):
    with ManagedRedis(data_dir=tmp_path / "r", password="pw") as server:
        assert ">pw" not in (tmp_path / "r" / "users.acl").read_text()  # no password in the file
        url, port = _job_url(server, "kept"), server.port
        redis.Redis.from_url(url).set("slipstream:kept:version", 5)
    acl = (tmp_path / "r" / "users.acl").read_text()
    assert "user job-kept " in acl and url.split(":")[2].split("@")[0] not in acl  # stored hashed
    with ManagedRedis(data_dir=tmp_path / "r", password="pw", port=port) as server:
        r = redis.Redis.from_url(url)
        assert r.get("slipstream:kept:version") == b"5"
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.get("slipstream:other:version")
        with pytest.raises(redis.exceptions.AuthenticationError):  # the default user still needs the password
            redis.Redis(host=server.host, port=server.port).ping()


def test_an_async_client_under_more_concurrent_commands_than_connections_waits_instead_of_failing(
    redis_server,
):
    """A rollout worker runs a coroutine per group in flight (`rollout.concurrency`, e.g. 128): more
    commands at once than its pool has connections queue for one (redis-py's own pool raised `Too many
    connections` past 100 and killed the worker), and the client never opens more than its cap."""
    from replay_buffer.client import ASYNC_MAX_CONNECTIONS, connect_async

    admin = redis.Redis.from_url(redis_server.admin_url)
    before = admin.info("clients")["connected_clients"]
    n = 3 * ASYNC_MAX_CONNECTIONS + 10

    async def run():
        r = connect_async(redis_server.url)
        try:  # each BLPOP holds its connection for 0.2 s, so all n overlap
            got = await asyncio.gather(
                *(r.blpop([f"slipstream:{secrets.token_hex(4)}:none"], timeout=0.2) for _ in range(n))
            )
            opened = admin.info("clients")["connected_clients"] - before
            return got, opened
        finally:
            await r.aclose()

    got, opened = asyncio.run(run())
    assert got == [None] * n
    assert 0 < opened <= ASYNC_MAX_CONNECTIONS
