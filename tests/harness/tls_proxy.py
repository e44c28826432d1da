"""TLS for the tests of "across nodes" (docs/security.md): a private CA and a server certificate made at test
time (`cryptography`), and a TLS-terminating TCP proxy (what caddy or nginx does in front of the control
API or an engine) in a thread of the test process: https://127.0.0.1:PORT in front of http://host:port.
Shared by the control API's, the engines' and Redis' TLS tests; its byte pump (`pipe`) by other proxies."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Certs:
    ca: Path
    """The private CA's certificate (PEM): what a client must trust."""
    cert: Path
    """The server's certificate for 127.0.0.1 and localhost, signed by the CA."""
    key: Path
    """The server's private key (PEM, unencrypted)."""
    other_ca: Path
    """A second CA that signed nothing here: trusting it instead must fail."""


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate it signed (127.0.0.1, localhost) and an unrelated CA, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("slipstream test CA")
    _, other = _ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    out = Certs(
        ca=directory / "ca.pem",
        cert=directory / "server.pem",
        key=directory / "server.key",
        other_ca=directory / "other-ca.pem",
    )
    out.ca.write_bytes(ca_cert.public_bytes(pem))
    out.other_ca.write_bytes(other.public_bytes(pem))
    out.cert.write_bytes(cert.public_bytes(pem))
    out.key.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return out


async def pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    through: Callable[[bytes], bytes | None] | None = None,
) -> None:
    """Copy `reader` to `writer` until EOF, then close `writer`. `through` sees each chunk first and
    returns what to pass on, or None to stop there (a proxy that drops a reply)."""
    try:
        while data := await reader.read(1 << 16):
            if through is not None and (data := through(data)) is None:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError, RuntimeError):
            pass


@contextmanager
def tls_proxy(certs: Certs, upstream: str) -> Iterator[str]:
    """https://127.0.0.1:PORT, terminating TLS with `certs` and passing the bytes on to `upstream`
    (http://host:port) over plain TCP, as a reverse proxy in stream mode does; stopped at the end."""
    host, port = upstream.removeprefix("http://").rstrip("/").rsplit(":", 1)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs.cert, certs.key)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict = {}

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, int(port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
        state["server"] = server
        state["port"] = server.sockets[0].getsockname()[1]
        state["stop"] = asyncio.Event()
        started.set()
        await state["stop"].wait()
        server.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10), "the TLS proxy did not start"
    try:
        yield f"https://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(state["stop"].set)
        thread.join(10)
