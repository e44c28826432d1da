"""Run model-written Python in a separate, locked-down process and return what it printed.

Each call starts a fresh `python -I -S -B -u sandbox_child.py` (isolated mode: stdlib only, no PYTHON*
variables, not even the script's own directory on sys.path; and an empty environment) in the episode's
working directory, feeds it the code on stdin, and returns stdout and stderr. Before any user code
exists the child (tools/sandbox_child.py) locks itself down in layers. Each kernel
layer is used where the kernel allows it, and `probe()` reports which ones took hold.

Kernel-enforced, holding even against code that defeats the Python-level hook:
  1. Network namespace: unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS), or without NEWUSER for root
     with CAP_SYS_ADMIN. The child sees only a loopback interface that is down: no IP traffic, no
     abstract Unix sockets of the host. The user namespace also drops every capability in the
     host namespace (root in the child cannot raise its rlimits, mount, or override file modes).
     A mount namespace beside it (`filesystem` in `probe()`): the child's root becomes an empty
     read-only tmpfs holding, bind-mounted at their own paths, only the working directory, the
     directories Landlock lets it read and /dev/null, /dev/urandom (pivot_root; the old root is
     detached). Every other path does not exist for it, to stat(), exists(), readlink() and listdir()
     of a parent as much as to open(); Landlock alone does not govern file metadata.
  2. Landlock (Linux >= 5.13): reads only below the Python stdlib directories (sys.path), the
     system library directories the dynamic loader needs, zoneinfo, /dev/null and /dev/urandom;
     reads and writes only below the working directory; no execve of anything; no ptrace of
     processes outside. ABI >= 4 also denies every TCP bind/connect; ABI >= 6 denies signals to
     processes outside the sandbox (it cannot kill the rollout worker) and abstract sockets.
  3. seccomp filter (x86_64, aarch64): fork, vfork, clone without CLONE_THREAD, execve(at),
     ptrace, process_vm_readv/writev, pidfd_open, io_uring_setup fail; kill/tgkill only reach the
     child itself; socket() only for AF_UNIX, and connect, bind, sendmsg and sendto with an address
     fail, so the only usable sockets are socketpair()s (asyncio needs one). Threads may start,
     but few: see 4.
  4. rlimits: RLIMIT_CPU (then SIGXCPU), RLIMIT_AS (allocations fail: MemoryError), RLIMIT_NOFILE,
     RLIMIT_FSIZE (writes past it fail with EFBIG), RLIMIT_CORE = 0. Every thread reserves its stack
     (RLIMIT_STACK, 8 MiB by default) and a malloc arena inside RLIMIT_AS, so at the default
     memory_mb=256 only 6 threads start besides the main one (with an 8 MiB stack limit; measured by
     tests/integration/slipstream/test_sandbox_thread_limit.py), then `RuntimeError: can't start new
     thread`; a larger memory_mb allows a few more. Code that needs many threads does not run here.
  5. From the parent: a wall-clock timeout that SIGKILLs the child's process group (also when the
     caller cancels), a cap on the bytes read from its pipes (the child is killed past it).

Python-level: a `sys.addaudithook` hook, installed last. It refuses sockets other than AF_UNIX and
every connect, bind, sendto and name lookup; subprocess.Popen, os.system, os.exec*, os.fork,
os.posix_spawn, os.spawn*; os.kill and friends; every ctypes operation (so `import ctypes` fails);
resource.setrlimit; further audit hooks; and `open` (and os.listdir, remove, rename, mkdir, chmod,
..., sqlite3.connect) of a resolved path outside the working directory, except reads below the
stdlib directories and zoneinfo. stat() and its kin raise no audit event, so os.stat, lstat, access,
readlink, statvfs, pathconf and chdir are wrapped (in `os` and `posix`) with the same check, and with
them os.path.exists/isdir/getsize/realpath and Path.stat. It gives ordinary code a clear PermissionError, and is the only
defence where the kernel layers are missing. On its own it is NOT a security boundary (PEP 578
says so): deliberately hostile code can defeat it, e.g. with hand-built code objects.

Not guaranteed: secrecy of file metadata where the mount namespace is missing and the hook is defeated;
that the parents of the working directory and of the readable directories exist (they are directories
of the new root); a cap on the total
memory or CPU of many concurrent sandboxes (the limits are per process, no cgroup); anything of
layers 1-3 where `probe()` reports them missing. Set `require_isolation=True` to refuse to run code
unless the network namespace, Landlock and seccomp are all in force.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from generator_fleet.tools.base import ToolContext, ToolResult

_STATUS_MARKER = "\x00slipstream-sandbox-status "
"""First line the child writes to stderr, before any user code: the isolation it achieved."""

_EXIT_NO_ISOLATION = 78  # EX_CONFIG: the child refused to run because require_isolation failed

_PYTHON_FLAGS = ("-I", "-S", "-B", "-u", "-X", "utf8")
"""Isolated mode, no site-packages, no .pyc writes, unbuffered (what was printed before a kill is
kept), UTF-8 streams whatever the locale."""

_CHILD_PROGRAM = str(Path(__file__).resolve().with_name("sandbox_child.py"))
"""The child program, run as a script; isolated mode keeps its directory off the child's sys.path."""

_KILL_OUTPUT_BYTES = 1 << 20
"""Output beyond this per pipe is unreadable for the model anyway: stop the child, don't buffer it."""


class SandboxIsolation(msgspec.Struct, kw_only=True):
    """Which layers a sandboxed child managed to put in place (see the module docstring)."""

    netns: bool
    """In a fresh network namespace."""
    filesystem: bool = False
    """In a mount namespace whose root holds only the working directory and the read-only paths: every
    other path does not exist for it (stat and exists included)."""
    landlock_abi: int
    """Landlock ABI version in force; 0 = none (4+ covers TCP, 6+ covers signals)."""
    seccomp: bool
    """The syscall filter is in force."""
    audit_hook: bool
    """The Python-level audit hook is installed."""


class PythonSandbox:
    name = "python"

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        cpu_s: int = 5,
        *,
        max_output_chars: int = 4000,
        file_mb: int = 16,
        max_open_files: int = 64,
        require_isolation: bool = False,
        audit_hook: bool = True,
    ) -> None:
        """
        timeout_s: wall-clock limit per call, after which the process group is SIGKILLed.
        memory_mb: address-space limit (RLIMIT_AS) of the child; thread stacks count against it (at
            256 only 6 threads start: see the module's notes).
        cpu_s: CPU-time limit (RLIMIT_CPU) of the child.
        max_output_chars: stdout + stderr shown to the model; the middle is cut beyond this.
        file_mb: largest file the code may write (RLIMIT_FSIZE).
        max_open_files: RLIMIT_NOFILE.
        require_isolation: refuse to run code unless netns, Landlock and seccomp are all in force.
        audit_hook: False only to test that the kernel layers hold on their own.
        """
        if timeout_s <= 0 or memory_mb <= 0 or cpu_s <= 0 or max_output_chars <= 0:
            raise ValueError("timeout_s, memory_mb, cpu_s and max_output_chars must be positive")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.cpu_s = cpu_s
        self.max_output_chars = max_output_chars
        self.file_mb = file_mb
        self.max_open_files = max_open_files
        self.require_isolation = require_isolation
        self.audit_hook = audit_hook

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run a Python 3 program (standard library only, no network, no files "
                f"outside its working directory, {self.timeout_s:g}s limit) and return what it prints. "
                "Use print() to see values.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The Python source to run."}},
                    "required": ["code"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult(text="error: argument 'code' must be a string of Python source", ok=False)
        if ctx.workdir is not None:
            if not os.path.isdir(ctx.workdir):
                return ToolResult(text="error: the sandbox working directory is missing", ok=False)
            return await self._run(code, ctx.workdir)
        with tempfile.TemporaryDirectory(prefix="slipstream-sandbox-") as workdir:
            return await self._run(code, workdir)

    async def probe(self) -> SandboxIsolation:
        """Start a child that runs nothing and report the isolation it achieved here."""
        with tempfile.TemporaryDirectory(prefix="slipstream-sandbox-") as workdir:
            run = await self._execute("", workdir)
        if run.status is None:
            raise RuntimeError(f"sandbox child failed to start: {run.stderr[-500:]!r}")
        return run.status

    async def _run(self, code: str, workdir: str) -> ToolResult:
        run = await self._execute(code, workdir)
        shown = _truncate_middle(run.stdout + run.stderr, self.max_output_chars).rstrip("\n")
        error = self._error(run)
        if error is None:
            return ToolResult(text=shown if shown else "(no output)")
        return ToolResult(text=f"{shown}\nerror: {error}" if shown else f"error: {error}", ok=False)

    def _error(self, run: _Run) -> str | None:
        """The one-line failure summary for the model; None when the code ran to completion."""
        if run.timed_out:
            return f"timed out after {self.timeout_s:g}s"
        if run.output_exceeded:
            return f"output limit exceeded ({_KILL_OUTPUT_BYTES // 1024} KiB)"
        if run.returncode == 0:
            return None
        if run.returncode < 0:
            sig = -run.returncode
            if sig == signal.SIGXCPU:
                return f"CPU time limit exceeded ({self.cpu_s}s)"
            return f"killed by {signal.Signals(sig).name}"
        if run.returncode == _EXIT_NO_ISOLATION and run.status is not None:
            return "the sandbox cannot isolate code on this machine (require_isolation is set)"
        # An uncaught exception: its traceback's last line ("ZeroDivisionError: division by zero").
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        if run.returncode == 1 and lines:
            return lines[-1].strip()
        return f"exit code {run.returncode}"

    async def _execute(self, code: str, workdir: str) -> _Run:
        workdir = os.path.realpath(workdir)
        config = {
            "workdir": workdir,
            "memory_bytes": self.memory_mb << 20,
            "cpu_s": self.cpu_s,
            "fsize_bytes": self.file_mb << 20,
            "nofile": self.max_open_files,
            "require_isolation": self.require_isolation,
            "audit_hook": self.audit_hook,
            "marker": _STATUS_MARKER,
            "exit_no_isolation": _EXIT_NO_ISOLATION,
        }
        argv = [sys.executable, *_PYTHON_FLAGS, _CHILD_PROGRAM, json.dumps(config)]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env={},  # nothing of the worker's environment (tokens, passwords) reaches the code
            start_new_session=True,  # its own process group, so the kill below takes every descendant
        )
        stdout, stderr = bytearray(), bytearray()
        exceeded = False
        timed_out = False

        async def feed() -> None:
            try:
                proc.stdin.write(code.encode("utf-8", "replace"))
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the child died before reading its code; its exit status says why

        async def drain(stream: asyncio.StreamReader, into: bytearray) -> None:
            nonlocal exceeded
            while chunk := await stream.read(1 << 16):
                if len(into) + len(chunk) > _KILL_OUTPUT_BYTES:
                    exceeded = True
                    _kill_group(proc)
                    return
                into += chunk

        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.gather(feed(), drain(proc.stdout, stdout), drain(proc.stderr, stderr))
                await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            # Also on cancellation by the caller: never leave a child running.
            if proc.returncode is None:
                _kill_group(proc)
                await proc.wait()
        status, err_text = _split_status(stderr.decode("utf-8", "replace"))
        return _Run(
            stdout=stdout.decode("utf-8", "replace"),
            stderr=err_text,
            returncode=proc.returncode,
            timed_out=timed_out,
            output_exceeded=exceeded,
            status=status,
        )


class _Run(msgspec.Struct, kw_only=True):
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    output_exceeded: bool
    status: SandboxIsolation | None


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _split_status(stderr: str) -> tuple[SandboxIsolation | None, str]:
    if not stderr.startswith(_STATUS_MARKER):
        return None, stderr  # the child died before reporting (it could not start)
    line, _, rest = stderr.partition("\n")
    try:
        return msgspec.json.decode(line[len(_STATUS_MARKER) :], type=SandboxIsolation), rest
    except msgspec.DecodeError:
        return None, rest


def _truncate_middle(text: str, limit: int) -> str:
    """Keep the head (the first prints) and the tail (where a traceback ends)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}"
