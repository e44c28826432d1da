"""The control API over TLS (docs/security.md, "Across nodes"): a real control API on loopback behind a
TLS-terminating proxy with a private CA. The `slipstream` CLI, run as users run it, works through
https:// with the CA given by `--ca-cert` or `$SLIPSTREAM_CA_CERT`, and without it (or with the wrong CA)
fails in one line that names the certificate problem, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import control_with_redis, serving
from tls_proxy import make_certs, tls_proxy

from slipstream.cluster.api import create_app

TOKEN = "tls-token"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def https_url(tmp_path_factory, certs):
    home = tmp_path_factory.mktemp("home")
    (home / "jobs").mkdir()
    with (
        control_with_redis(home, TOKEN) as (control, _),
        serving(create_app(TOKEN, control)) as url,
        tls_proxy(certs, url) as https,
    ):
        yield https


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("SLIPSTREAM_CA_CERT", "SSL_CERT_FILE")}
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), "SLIPSTREAM_API_TOKEN": TOKEN, **env},
    )  # fmt: skip


def test_cli_lists_jobs_through_a_tls_proxy_with_ca_cert_option(https_url, certs):
    out = cli("list", "--api-url", https_url, "--ca-cert", str(certs.ca))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no jobs"


def test_cli_takes_the_ca_from_the_environment(https_url, certs):
    out = cli("status", "nosuchjob", SLIPSTREAM_API_URL=https_url, SLIPSTREAM_CA_CERT=str(certs.ca))
    # the call went through TLS and reached the API, which answers 404 for an unknown job
    assert out.returncode == 1
    assert "HTTP 404" in out.stderr and "TLS" not in out.stderr, out.stderr


@pytest.mark.parametrize("ca", [None, "other"])
def test_cli_without_the_ca_fails_naming_the_certificate(https_url, certs, ca):
    extra = ["--ca-cert", str(certs.other_ca)] if ca else []
    out = cli("list", "--api-url", https_url, *extra)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("slipstream: control API at https://127.0.0.1:"), out.stderr
    assert "certificate is not trusted" in out.stderr and "--ca-cert" in out.stderr, out.stderr
    assert "unable to get local issuer certificate" in out.stderr, out.stderr


def test_cli_names_a_ca_file_that_is_not_there(https_url, tmp_path):
    out = cli("list", "--api-url", https_url, "--ca-cert", str(tmp_path / "missing.pem"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"--ca-cert: no CA certificate file {tmp_path / 'missing.pem'}" in out.stderr


def test_submitted_jobs_get_the_control_planes_ca(tmp_path, certs, monkeypatch):
    """`$SLIPSTREAM_CA_CERT` of `cluster up` reaches every job's processes (https engines, rediss)."""
    from types import SimpleNamespace

    from common import tls

    class Ray:
        def submit_job(self, **kw):
            self.runtime_env = kw["runtime_env"]

    (tmp_path / "jobs").mkdir()
    with control_with_redis(tmp_path, TOKEN) as (control, _):
        control._ray = ray = Ray()
        monkeypatch.delenv(tls.CA_ENV, raising=False)
        control._send(SimpleNamespace(name="plain"), "sid-1")
        assert tls.CA_ENV not in ray.runtime_env["env_vars"]
        monkeypatch.setenv(tls.CA_ENV, str(certs.ca))
        control._send(SimpleNamespace(name="tls"), "sid-2")
        assert ray.runtime_env["env_vars"][tls.CA_ENV] == str(certs.ca)
