"""Run model-written Python in a separate, locked-down process and return what it printed.

Each call starts a fresh `python -I -S -B -u` (isolated mode: stdlib only, no PYTHON* variables; and
an empty environment) in the episode's working directory, feeds it the code on stdin, and returns
stdout and stderr. Before any user code exists the child locks itself down in layers. Each kernel
layer is used where the kernel allows it, and `probe()` reports which ones took hold.

Kernel-enforced, holding even against code that defeats the Python-level hook:
  1. Network namespace: unshare(CLONE_NEWUSER | CLONE_NEWNET), or CLONE_NEWNET alone for root
     with CAP_SYS_ADMIN. The child sees only a loopback interface that is down: no IP traffic, no
     abstract Unix sockets of the host. The user namespace also drops every capability in the
     host namespace (root in the child cannot raise its rlimits, mount, or override file modes).
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
     tests/slipstream/test_cli_ux.py), then `RuntimeError: can't start new thread`; a larger
     memory_mb allows a few more. Code that needs many threads does not run here.
  5. From the parent: a wall-clock timeout that SIGKILLs the child's process group (also when the
     caller cancels), a cap on the bytes read from its pipes (the child is killed past it).

Python-level: a `sys.addaudithook` hook, installed last. It refuses sockets other than AF_UNIX and
every connect, bind, sendto and name lookup; subprocess.Popen, os.system, os.exec*, os.fork,
os.posix_spawn, os.spawn*; os.kill and friends; every ctypes operation (so `import ctypes` fails);
resource.setrlimit; further audit hooks; and `open` (and os.listdir, remove, rename, mkdir, chmod,
..., sqlite3.connect) of a resolved path outside the working directory, except reads below the
stdlib directories and zoneinfo. It gives ordinary code a clear PermissionError, and is the only
defence where the kernel layers are missing. On its own it is NOT a security boundary (PEP 578
says so): deliberately hostile code can defeat it, e.g. with hand-built code objects.

Not guaranteed: secrecy of file metadata (stat and exists work on any path); a cap on the total
memory or CPU of many concurrent sandboxes (the limits are per process, no cgroup); anything of
layers 1-3 where `probe()` reports them missing. Set `require_isolation=True` to refuse to run code
unless the network namespace, Landlock and seccomp are all in force.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import signal
import sys
import tempfile
from typing import Any

import msgspec

from generator_fleet.tools.base import ToolContext, ToolResult

_STATUS_MARKER = "\x00slipstream-sandbox-status "
"""First line the child writes to stderr, before any user code: the isolation it achieved."""

_EXIT_NO_ISOLATION = 78  # EX_CONFIG: the child refused to run because require_isolation failed

_PYTHON_FLAGS = ("-I", "-S", "-B", "-u", "-X", "utf8")
"""Isolated mode, no site-packages, no .pyc writes, unbuffered (what was printed before a kill is
kept), UTF-8 streams whatever the locale."""

_KILL_OUTPUT_BYTES = 1 << 20
"""Output beyond this per pipe is unreadable for the model anyway: stop the child, don't buffer it."""


class SandboxIsolation(msgspec.Struct, kw_only=True):
    """Which layers a sandboxed child managed to put in place (see the module docstring)."""

    netns: bool
    """In a fresh network namespace."""
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
        argv = [sys.executable, *_PYTHON_FLAGS, "-c", _child_source(), json.dumps(config)]
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


# --- The child side. --------------------------------------------------------------------------------
# The functions below run inside the sandboxed interpreter, which gets their *source* (see
# _child_source): they use only the standard library, import what they need themselves, and refer to
# nothing else in this module. Constants are Linux's (uapi headers); the child only runs on Linux.


def _child_main() -> None:
    import json
    import linecache
    import os
    import resource
    import signal
    import sys
    import traceback
    import types

    config = json.loads(sys.argv[1])
    source = sys.stdin.buffer.read().decode("utf-8", "replace")
    workdir = config["workdir"]
    os.chdir(workdir)
    python_dirs = tuple(
        sorted({os.path.realpath(p) for p in sys.path if p and os.path.isabs(p) and os.path.exists(p)})
    )

    def attempt(layer, *args):
        try:
            return layer(*args)
        except Exception:
            return 0  # this platform lacks it (libc symbol, syscall, architecture): reported as absent

    # Kernel layers first, while this process is still single-threaded (unshare(CLONE_NEWUSER)
    # requires it) and before any user code exists.
    netns = bool(attempt(_enter_network_namespace))
    landlock_abi = attempt(_apply_landlock, workdir, python_dirs)
    for limit, value in (
        (resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (config["memory_bytes"], config["memory_bytes"])),
        (resource.RLIMIT_NOFILE, (config["nofile"], config["nofile"])),
        (resource.RLIMIT_FSIZE, (config["fsize_bytes"], config["fsize_bytes"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)
    seccomp = bool(attempt(_apply_seccomp))
    # Past RLIMIT_FSIZE a write should fail with an exception the code sees, not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    # ctypes served the layers above; the user code must import it afresh, which the hook refuses.
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.")]:
        del sys.modules[name]
    if config["audit_hook"]:
        _install_audit_hook(workdir, python_dirs + ("/usr/share/zoneinfo",))
    status = {
        "netns": netns,
        "landlock_abi": landlock_abi,
        "seccomp": seccomp,
        "audit_hook": config["audit_hook"],
    }
    sys.stderr.write(config["marker"] + json.dumps(status) + "\n")
    sys.stderr.flush()
    if config["require_isolation"] and not (netns and landlock_abi and seccomp):
        sys.exit(config["exit_no_isolation"])

    # Register the source so tracebacks show the offending lines of "<code>".
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    # The user code gets a fresh __main__, not this bootstrap's globals.
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(source, "<code>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # reported like an uncaught exception, without the sandbox's frames
        report = traceback.TracebackException(type(e), e, e.__traceback__, compact=True)
        pending = [report]
        while pending:
            # "<string>" is this program (run with -c): the bootstrap and the audit hook.
            item = pending.pop()
            frames = [f for f in item.stack if f.filename != "<string>"]
            item.stack = traceback.StackSummary.from_list(frames)
            pending += [x for x in (item.__cause__, item.__context__) if x is not None]
        sys.stderr.write("".join(report.format()))
        sys.stderr.flush()
        os._exit(1)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _enter_network_namespace() -> bool:
    import ctypes

    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    libc = _libc()
    # A user namespace first: it works unprivileged and drops the host capabilities; root with
    # CAP_SYS_ADMIN can still get a bare network namespace where user namespaces are disabled.
    for flags in (clone_newuser | clone_newnet, clone_newnet):
        if libc.unshare(ctypes.c_int(flags)) == 0:
            return True
    return False


def _apply_landlock(workdir: str, python_dirs: tuple) -> int:
    import ctypes
    import os

    sys_create_ruleset, sys_add_rule, sys_restrict_self = 444, 445, 446  # same on x86_64 and aarch64
    pr_set_no_new_privs = 38
    libc = _libc()
    syscall = libc.syscall
    syscall.restype = long = ctypes.c_long  # variadic: pass every integer at full register width
    abi = syscall(long(sys_create_ruleset), None, long(0), long(1))  # flag 1: report the ABI version
    if abi < 1:
        return 0

    execute, write_file, read_file, read_dir = 1 << 0, 1 << 1, 1 << 2, 1 << 3
    make_char, make_block = 1 << 6, 1 << 11
    truncate, ioctl_dev = 1 << 14, 1 << 15
    handled = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        handled |= 1 << 13  # REFER
    if abi >= 3:
        handled |= truncate
    if abi >= 5:
        handled |= ioctl_dev
    file_rights = (execute | write_file | read_file | truncate | ioctl_dev) & handled

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    # Handled with no rule granting it = denied: all TCP bind/connect (ABI 4), signals to and
    # abstract-socket connections with processes outside the sandbox (ABI 6).
    attr = RulesetAttr(handled, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    ruleset = syscall(long(sys_create_ruleset), ctypes.byref(attr), long(ctypes.sizeof(attr)), long(0))
    if ruleset < 0:
        return 0
    read_only = read_file | read_dir
    read_write = handled & ~execute & ~make_char & ~make_block
    # The dynamic loader (not Python) opens these when an extension module pulls in a shared
    # library, e.g. libcrypto for hashlib.
    system = (
        "/lib /lib64 /usr/lib /usr/lib64 /usr/local/lib /etc/ld.so.cache /etc/localtime /usr/share/zoneinfo"
    )
    rules = [(p, read_only) for p in python_dirs + tuple(system.split())]
    rules += [
        ("/dev/null", read_file | write_file | truncate),
        ("/dev/urandom", read_file),
        (workdir, read_write),
    ]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    access &= file_rights  # directory-only rights are invalid on a file
                rule = PathBeneath(access & handled, fd)
                syscall(long(sys_add_rule), long(ruleset), long(1), ctypes.byref(rule), long(0))
            finally:
                os.close(fd)
        if libc.prctl(ctypes.c_int(pr_set_no_new_privs), long(1), long(0), long(0), long(0)) != 0:
            return 0
        if syscall(long(sys_restrict_self), long(ruleset), long(0)) != 0:
            return 0
    finally:
        os.close(ruleset)
    return abi


def _apply_seccomp() -> bool:
    import ctypes
    import os
    import platform

    # Syscall numbers from the uapi headers (asm/unistd_64.h, asm-generic/unistd.h); -1: none there.
    names = (
        "socket connect sendto sendmsg bind clone fork vfork execve kill ptrace tkill tgkill sendmmsg "
        "process_vm_readv process_vm_writev execveat pidfd_send_signal io_uring_setup pidfd_open clone3"
    ).split()
    # fmt: off
    table = {
        "x86_64": (41, 42, 44, 46, 49, 56, 57, 58, 59, 62, 101, 200, 234, 307, 310, 311, 322, 424, 425, 434, 435),
        "aarch64": (198, 203, 206, 211, 200, 220, -1, -1, 221, 129, 117, 130, 131, 269, 270, 271, 281, 424, 425,
                    434, 435),
    }
    # fmt: on
    if platform.machine() not in table:
        return False
    numbers = dict(zip(names, table[platform.machine()], strict=True))
    audit_arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    # Opcodes: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|{BPF_JEQ,BPF_JGE,BPF_JSET}|BPF_K, BPF_RET|BPF_K.
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill_process = 0x7FFF0000, 0x80000000
    eperm, eacces, enosys = 0x50001, 0x5000D, 0x50026  # SECCOMP_RET_ERRNO | errno
    # struct seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i (low half first: little endian).
    off_nr, off_arch = 0, 4

    def arg(i, high=False):
        return 16 + 8 * i + (4 if high else 0)

    pid = os.getpid()
    program: list = []  # [code, jump-if-true, jump-if-false, k]; a jump may name a label
    labels: dict = {}

    def emit(code, k, jt=0, jf=0):
        program.append([code, jt, jf, k])

    emit(ld, off_arch)
    emit(jeq, audit_arch, jt=1)
    emit(ret, kill_process)  # a foreign syscall ABI (32-bit int 0x80) would dodge the numbers below
    emit(ld, off_nr)
    if platform.machine() == "x86_64":
        emit(jge, 0x40000000, jt="eperm")  # the x32 ABI: same syscalls, other numbers
    # New processes and programs, other processes' memory and signals: the sandbox's way out.
    for name in (
        "fork vfork execve execveat ptrace process_vm_readv process_vm_writev tkill pidfd_open "
        "pidfd_send_signal io_uring_setup"
    ).split():
        if numbers[name] >= 0:
            emit(jeq, numbers[name], jt="eperm")
    # Sockets other than socketpair()s (which asyncio needs): a named Unix socket is reachable by path
    # from inside any network namespace, and Landlock does not guard it.
    for name in ("connect", "bind", "sendmsg", "sendmmsg"):
        emit(jeq, numbers[name], jt="eacces")
    emit(jeq, numbers["clone3"], jt="enosys")  # glibc then falls back to clone, whose flags we can see
    emit(jeq, numbers["clone"], jt="clone")
    emit(jeq, numbers["socket"], jt="socket")
    emit(jeq, numbers["sendto"], jt="sendto")
    emit(jeq, numbers["kill"], jt="kill")
    emit(jeq, numbers["tgkill"], jt="tgkill")
    emit(ret, allow)
    labels["clone"] = len(program)
    emit(ld, arg(0))
    emit(jset, 0x10000, jt="allow")  # CLONE_THREAD: a thread, not a process
    emit(ret, eperm)
    labels["socket"] = len(program)
    emit(ld, arg(0))
    emit(jeq, 1, jt="allow")  # AF_UNIX
    emit(ret, eacces)
    labels["sendto"] = len(program)  # send() on a connected socket passes no address
    emit(ld, arg(4))
    emit(jeq, 0, jf="eacces")
    emit(ld, arg(4, high=True))
    emit(jeq, 0, jt="allow", jf="eacces")
    labels["kill"] = len(program)  # itself (pid, or its own process group: 0 or -pid) and nothing else
    emit(ld, arg(0))
    emit(jeq, pid, jt="allow")
    emit(jeq, 0, jt="allow")
    emit(jeq, -pid & 0xFFFFFFFF, jt="allow", jf="eperm")
    labels["tgkill"] = len(program)
    emit(ld, arg(0))
    emit(jeq, pid, jt="allow", jf="eperm")
    for label, action in (("allow", allow), ("eperm", eperm), ("eacces", eacces), ("enosys", enosys)):
        labels[label] = len(program)
        emit(ret, action)

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(program))()
    for i, (code, jt, jf, k) in enumerate(program):
        # Classic BPF jumps forward only, counted from the next instruction.
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        filters[i] = SockFilter(code, jt, jf, k)
    fprog = SockFprog(len(program), filters)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    libc = _libc()
    ulong = ctypes.c_ulong
    libc.prctl(ctypes.c_int(pr_set_no_new_privs), ulong(1), ulong(0), ulong(0), ulong(0))
    mode = ulong(seccomp_mode_filter)
    return libc.prctl(ctypes.c_int(pr_set_seccomp), mode, ctypes.byref(fprog), ulong(0), ulong(0)) == 0


def _install_audit_hook(workdir: str, read_roots: tuple) -> None:
    import os
    import sys

    realpath, fsdecode, fspath, sep = os.path.realpath, os.fsdecode, os.fspath, os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    devices = ("/dev/null", "/dev/urandom")
    af_unix = 1
    blocked = frozenset(
        (
            "subprocess.Popen os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty os.kill os.killpg "
            "signal.pthread_kill resource.setrlimit resource.prlimit sys.addaudithook "
            "sqlite3.enable_load_extension"
        ).split()
    )
    read_events = frozenset("os.listdir os.scandir os.getxattr os.listxattr".split())
    write_events = frozenset(
        (
            "os.remove os.rmdir os.mkdir os.chmod os.chown os.utime os.truncate os.setxattr os.removexattr "
            "os.chflags os.lchflags sqlite3.connect"
        ).split()
    )

    def under(path, roots):
        return any(path == root or path.startswith(root + sep) for root in roots)

    def check(path, write):
        if path is None:
            path = "."
        if isinstance(path, int):
            return  # an already-open descriptor
        path = fsdecode(fspath(path))
        resolved = realpath(path)
        if under(resolved, (workdir,)) or resolved in devices or (not write and under(resolved, read_roots)):
            return
        what = "writing" if write else "reading"
        raise PermissionError(
            f"sandbox: {what} {path!r} is not allowed (only files in the working directory)"
        )

    def hook(event, args):
        if event == "open":
            check(args[0], bool(args[2] & write_flags))
        elif event in read_events:
            check(args[0], False)
        elif event in write_events:
            check(args[0], True)
        elif event in ("os.rename", "os.link"):
            check(args[0], True)
            check(args[1], True)
        elif event == "os.symlink":
            check(args[1], True)  # the link itself; its target is checked when it is opened
        elif event == "socket.__new__":
            if args[1] != af_unix:
                raise PermissionError("sandbox: network access is not allowed")
        elif event.startswith("socket."):
            raise PermissionError("sandbox: network access is not allowed")
        elif event in blocked or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(hook)


_CHILD_FUNCTIONS = (
    _libc,
    _enter_network_namespace,
    _apply_landlock,
    _apply_seccomp,
    _install_audit_hook,
    _child_main,
)


@functools.cache
def _child_source() -> str:
    """The child program: the functions above, shipped as source and run with `python -c`."""
    return "\n\n".join(inspect.getsource(f) for f in _CHILD_FUNCTIONS) + "\n\n_child_main()\n"
