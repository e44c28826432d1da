"""Which certificates the project's HTTPS and `rediss://` clients trust (docs/security.md, "Across nodes").

`$SLIPSTREAM_CA_CERT` (or the CLI's `--ca-cert`) names a PEM file of CA certificates, e.g. the private CA
of the reverse proxy in front of the control API or the engines. It is trusted in addition to the public
CAs (certifi's bundle, as httpx's default): the CLI's control API client, the rollout workers' and the
weight bus's engine clients, and every `rediss://` Redis client without an `ssl_ca_certs` of its own.
Without it, httpx's default applies (certifi, or `$SSL_CERT_FILE` / `$SSL_CERT_DIR` when set).
"""

from __future__ import annotations

import functools
import os
import ssl

CA_ENV = "SLIPSTREAM_CA_CERT"


def ca_file(ca_cert: str | None = None) -> str | None:
    """`ca_cert`, else `$SLIPSTREAM_CA_CERT`, else None; a file that is not there is an error naming it."""
    path = ca_cert or os.environ.get(CA_ENV) or None
    if path is not None and not os.path.isfile(path):
        where = "--ca-cert" if ca_cert else f"${CA_ENV}"
        raise FileNotFoundError(f"{where}: no CA certificate file {path}")
    return path


def verify(ca_cert: str | None = None) -> ssl.SSLContext:
    """httpx's `verify` for a client: a context that trusts the public CAs and `ca_file(ca_cert)`; without a
    CA file, httpx's default trust (`default_context`)."""
    path = ca_file(ca_cert)
    if path is None:
        return default_context()
    import certifi

    ctx = ssl.create_default_context(cafile=certifi.where())
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        raise ValueError(f"CA certificate file {path} holds no PEM certificate: {e}") from None
    return ctx


def default_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's bundle, or `$SSL_CERT_FILE` / `$SSL_CERT_DIR` when set), built
    once per process and setting: httpx builds one for every client it creates, and loading the bundle
    costs about 45 ms of CPU each time. A context may be shared by any number of clients and threads."""
    return _default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _default_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    import httpx  # reads the same two variables

    return httpx.create_ssl_context()


def redis_kwargs(url: str) -> dict:
    """Extra keyword arguments for a Redis client of `url`: `ssl_ca_certs` from `$SLIPSTREAM_CA_CERT` for a
    `rediss://` URL that does not name its own (`?ssl_ca_certs=...` in the URL wins); else none."""
    if not url.startswith("rediss://") or "ssl_ca_certs=" in url:
        return {}
    path = ca_file()
    return {"ssl_ca_certs": path} if path else {}


def describe(error: BaseException) -> str | None:
    """One line for a TLS failure of an HTTPS call (None for any other error): what went wrong with the
    server's certificate and how to trust its CA."""
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text or isinstance(error, ssl.SSLCertVerificationError):
        reason = text.split("certificate verify failed:", 1)[-1].split("(_ssl.c")[0].strip(" :)")
        if "mismatch" in reason:  # trusted, but for another name: the URL must use one the certificate has
            return f"TLS: the server's certificate is not for this address ({reason})"
        return (
            f"TLS: the server's certificate is not trusted ({reason or text}); give its CA with "
            f"--ca-cert FILE or ${CA_ENV}"
        )
    if "SSL" in text or "TLS" in text or isinstance(error, ssl.SSLError):
        return f"TLS handshake failed: {text}"
    return None
