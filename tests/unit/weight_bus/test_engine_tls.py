"""Engines over TLS (docs/security.md, "Across nodes"): a real built-in engine behind a TLS-terminating
proxy with a private CA, as `generators.engine: external` with `urls: [https://...]` attaches to. With the
CA in `$SLIPSTREAM_CA_CERT`, the rollout client generates through https://, the weight bus's control
calls (its one-at-a-time channel for https://) publish new weights over gloo, and the engine reports the
new version; without the CA every client fails naming the certificate. (The gloo tensors themselves do not
go through the proxy: they cross in clear.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from bus_engines import KEY, assert_holds, noisy_model
from tls_proxy import make_certs, tls_proxy

from common import tls
from generator_fleet.client import EngineClient as RolloutClient
from generator_fleet.client import EngineError
from generator_fleet.engine import EngineServer
from weight_bus import WeightBus
from weight_bus.engine_client import EngineClient

PROMPT = [1, 5, 6, 3, 7, 14]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def engine(model_dir, certs):
    server = EngineServer(str(model_dir), api_key=KEY, torch_threads=1).start()
    try:
        with tls_proxy(certs, server.url) as https:
            yield server, https
    finally:
        server.stop()


async def _generate(url: str) -> list[int]:
    async with RolloutClient(url, api_key=KEY) as client:
        return (await client.generate(PROMPT, GREEDY)).output_ids


def test_rollout_client_and_weight_bus_work_through_https_with_the_ca(engine, certs, tmp_path, monkeypatch):
    server, https = engine
    monkeypatch.setenv(tls.CA_ENV, str(certs.ca))
    assert https.startswith("https://")
    direct = asyncio.run(_generate(server.url))
    assert asyncio.run(_generate(https)) == direct

    with EngineClient(KEY, 30.0) as control:
        info = control.server_info(https)
        assert info["weight_update_groups"] == []
        control.pause_generation(https, "in_place")
        control.continue_generation(https)

    model_b = noisy_model(tmp_path / "b", 5)
    bus = WeightBus([https], api_key=KEY, backend="gloo", bucket_bytes=64 * 1024)
    bus.connect()
    try:
        stats = bus.publish(model_b.named_parameters(), version=9)
        assert stats.version == 9 and stats.buckets >= 2 and stats.engines == [https]
    finally:
        bus.close()
    assert_holds(server, model_b)
    with EngineClient(KEY, 30.0) as control:
        assert control.server_info(https)["weight_version"] == "9"
        assert control.server_info(https)["weight_update_groups"] == []
    assert asyncio.run(_generate(https)) != direct


@pytest.mark.parametrize("ca", [None, "other"])
def test_engine_clients_without_the_ca_fail_naming_the_certificate(engine, certs, monkeypatch, ca):
    _, https = engine
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    if ca:
        monkeypatch.setenv(tls.CA_ENV, str(certs.other_ca))
    else:
        monkeypatch.delenv(tls.CA_ENV, raising=False)
    with pytest.raises(EngineError) as e:
        asyncio.run(_generate(https))
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value)
    with EngineClient(KEY, 30.0) as control, pytest.raises(httpx.ConnectError) as e2:
        control.server_info(https)
    assert "unable to get local issuer certificate" in tls.describe(e2.value)
    with EngineClient(KEY, 30.0) as control:
        channel = control.channel(https)
        try:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                channel.update_weight_version(3).result(timeout=30)
        finally:
            channel.close()
