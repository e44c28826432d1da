"""The managed redis-server: real process, password and ACL user required, AOF on, clean stop."""

import os
import stat

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from replay_buffer.redis_server import ManagedRedis, find_redis_server


def test_finds_a_redis_server_binary():
    assert find_redis_server().endswith("redis-server")


NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries auth failures with backoff by default: seconds wasted


def test_auth_is_required(redis_server):
    anon = redis.Redis(host=redis_server.host, port=redis_server.port, retry=NO_RETRY)
    with pytest.raises(redis.AuthenticationError):
        anon.ping()
    wrong = redis.Redis(
        host=redis_server.host, port=redis_server.port, username="slipstream", password="nope", retry=NO_RETRY
    )
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()


def test_app_user_is_limited_to_its_keys_and_safe_commands(redis_server):
    app = redis_server.client()
    app.set("slipstream:acl-test:x", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.set("not-slipstream", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.config_set("appendonly", "no")
    admin = redis.Redis.from_url(redis_server.admin_url)
    assert admin.config_get("appendonly") == {"appendonly": "yes"}
    assert admin.acl_whoami() == "default"


def _auth(server: ManagedRedis, username: str | None, password: str) -> redis.Redis:
    return redis.Redis(
        host=server.host, port=server.port, username=username, password=password, retry=NO_RETRY
    )


def test_control_plane_user_has_its_own_password_and_each_authenticates_only_as_itself(redis_server):
    admin_pw, control_pw = redis_server.password, redis_server.app_password
    assert admin_pw != control_pw
    assert control_pw not in redis_server.admin_url and admin_pw not in redis_server.url
    assert _auth(redis_server, None, admin_pw).acl_whoami() == "default"
    control = _auth(redis_server, "slipstream", control_pw)
    assert control.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):  # it is not the admin (who may ACL WHOAMI)
        control.acl_whoami()
    # Neither password opens the other user: the control plane's URL leaking does not make one admin.
    for user, pw in ((None, control_pw), ("default", control_pw), ("slipstream", admin_pw)):
        with pytest.raises(redis.AuthenticationError):
            _auth(redis_server, user, pw).ping()
    # The ACL file holds hashes only, one per password.
    acl = redis_server.acl_path.read_text()
    assert admin_pw not in acl and control_pw not in acl


def test_a_running_redis_takes_a_new_control_plane_password(tmp_path):
    """What `cluster up` does to a Redis an older `up` started with one password for both users."""
    from replay_buffer.redis_server import set_app_password

    with ManagedRedis(data_dir=tmp_path / "r", password="admin-pw", app_password="old-pw") as r:
        set_app_password(redis.Redis.from_url(r.admin_url), "new-pw")
        assert _auth(r, "slipstream", "new-pw").ping()
        with pytest.raises(redis.AuthenticationError):
            _auth(r, "slipstream", "old-pw").ping()
        assert "new-pw" not in r.acl_path.read_text()


def test_aof_settings_and_stop(tmp_path):
    with ManagedRedis(data_dir=tmp_path / "r", appendfsync="always") as r:
        admin = redis.Redis.from_url(r.admin_url)
        assert admin.config_get("appendfsync") == {"appendfsync": "always"}
        r.client().xadd("slipstream:j:groups", {"d": b"x"})
        port = r.port
    assert (tmp_path / "r" / "appendonly.aof").exists()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=1, retry=NO_RETRY).ping()


def test_data_survives_a_restart_from_the_aof(tmp_path):
    with ManagedRedis(data_dir=tmp_path / "r", appendfsync="always", password="pw") as r:
        r.client().xadd("slipstream:j:groups", {"d": b"kept"})
    with ManagedRedis(data_dir=tmp_path / "r", password="pw") as r:
        assert r.client().xrange("slipstream:j:groups")[0][1] == {b"d": b"kept"}


def test_a_new_run_does_not_inherit_the_previous_runs_redis(tmp_path):
    from slipstream.job.prepare import reset_run_state

    with ManagedRedis(data_dir=tmp_path / "redis", password="pw") as r:
        r.client().set("slipstream:demo:version", 200)  # the previous run finished at version 200
    (tmp_path / "samples.txt").write_text("old")
    reset_run_state(tmp_path, managed_redis=True)
    assert not (tmp_path / "samples.txt").exists()
    with ManagedRedis(data_dir=tmp_path / "redis", password="pw") as r:
        assert r.client().get("slipstream:demo:version") is None


def test_the_config_holding_the_password_is_never_readable_by_others(tmp_path, monkeypatch):
    """Created 0600, not written under the umask and narrowed afterwards: with a permissive umask and no
    later chmod, the file's mode is its creation mode."""
    from pathlib import Path

    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
    old_umask = os.umask(0)
    try:
        with ManagedRedis(data_dir=tmp_path / "r") as r:
            conf = r.data_dir / "redis.conf"
            assert stat.S_IMODE(conf.stat().st_mode) == 0o600
            assert r.password in conf.read_text()
    finally:
        os.umask(old_umask)
    os.chmod(conf, 0o644)  # left wide by something else: the next start narrows it
    with ManagedRedis(data_dir=tmp_path / "r"):
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
