"""The bearer auth scheme is case-insensitive (RFC 7235 section 2.1): the control API and the built-in
engine take `bearer <token>` and `BEARER <token>` as they take `Bearer <token>`, and still refuse a wrong
token, another scheme or a bare token. Real Redis, the real control API and engine over HTTP."""

from __future__ import annotations

import http_calls
import pytest
from cluster_helpers import control_with_redis, serving

from slipstream.cluster.api import create_app

TOKEN = "scheme-token"
ENGINE_KEY = "scheme-engine-key"
ACCEPTED = ["Bearer {t}", "bearer {t}", "BEARER {t}", "bEaReR {t}", "Bearer  {t}"]
REFUSED = ["bearer wrong", "Basic {t}", "{t}", "bearer", "bearer{t}", ""]


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    (home / "jobs").mkdir()
    with control_with_redis(home, TOKEN) as (control, _), serving(create_app(TOKEN, control)) as url:
        yield url


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from generator_fleet.engine import EngineServer

    server = EngineServer(str(tiny_model_dir), api_key=ENGINE_KEY).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("header", ACCEPTED)
def test_control_api_takes_the_bearer_scheme_in_any_case(api_url, header):
    r = http_calls.get(f"{api_url}/jobs", headers={"Authorization": header.format(t=TOKEN)})
    assert r.status_code == 200, (header, r.status_code, r.text)


@pytest.mark.parametrize("header", REFUSED)
def test_control_api_still_refuses_a_wrong_token_or_scheme(api_url, header):
    r = http_calls.get(f"{api_url}/jobs", headers={"Authorization": header.format(t=TOKEN)})
    assert r.status_code == 401, (header, r.status_code, r.text)


@pytest.mark.parametrize("header", ACCEPTED)
def test_engine_takes_the_bearer_scheme_in_any_case(engine, header):
    r = http_calls.get(f"{engine.url}/get_model_info", headers={"Authorization": header.format(t=ENGINE_KEY)})
    assert r.status_code == 200, (header, r.status_code, r.text)


@pytest.mark.parametrize("header", REFUSED)
def test_engine_still_refuses_a_wrong_key_or_scheme(engine, header):
    r = http_calls.get(f"{engine.url}/get_model_info", headers={"Authorization": header.format(t=ENGINE_KEY)})
    assert r.status_code == 401, (header, r.status_code, r.text)
