"""The sandboxed child program of generator_fleet/tools/python_sandbox.py (its notes describe the layers).

Run as `python -I -S -B -u -X utf8 sandbox_child.py CONFIG_JSON` with the code on stdin, in the
working directory: it locks itself down, reports the isolation it achieved on stderr, then runs the
code. Standard library only (the interpreter has no site-packages); it imports nothing of Slipstream.
Constants are Linux's (uapi headers); the child only runs on Linux.
"""

import json
import linecache
import os
import platform
import resource
import signal
import sys
import traceback
import types

_SELF = os.path.realpath(__file__)
"""This program's file: its frames are left out of the tracebacks shown to the model."""


_SYSTEM_READ = tuple(
    "/lib /lib64 /usr/lib /usr/lib64 /usr/local/lib /etc/ld.so.cache /etc/localtime /usr/share/zoneinfo".split()
)
"""Read-only outside Python's own directories: the dynamic loader (not Python) opens these when an
extension module pulls in a shared library, e.g. libcrypto for hashlib; zoneinfo serves time zones."""
_DEVICES = ("/dev/null", "/dev/urandom")


def _child_main() -> None:
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
    netns = bool(attempt(_enter_namespaces))
    # Before Landlock, which forbids changing mounts.
    filesystem = netns and bool(attempt(_confine_filesystem, workdir, python_dirs + _SYSTEM_READ + _DEVICES))
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
        "filesystem": filesystem,
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
            # This program's frames: the bootstrap and the audit hook.
            item = pending.pop()
            frames = [f for f in item.stack if os.path.realpath(f.filename) != _SELF]
            item.stack = traceback.StackSummary.from_list(frames)
            pending += [x for x in (item.__cause__, item.__context__) if x is not None]
        sys.stderr.write("".join(report.format()))
        sys.stderr.flush()
        os._exit(1)


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _enter_namespaces() -> bool:
    """A network namespace and a mount namespace (the latter for _confine_filesystem)."""
    import ctypes

    clone_newns, clone_newuser, clone_newnet = 0x00020000, 0x10000000, 0x40000000
    uid, gid = os.getuid(), os.getgid()
    libc = _libc()
    # A user namespace first: it works unprivileged and drops the host capabilities; root with
    # CAP_SYS_ADMIN can still get bare network and mount namespaces where user namespaces are disabled.
    if libc.unshare(ctypes.c_int(clone_newuser | clone_newnet | clone_newns)) == 0:
        # The same ids inside as outside, so that files made in the new root's tmpfs have an owner. Where a
        # security module forbids the mapping, the network namespace still holds; _confine_filesystem fails.
        try:
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        except OSError:
            pass
        return True
    return libc.unshare(ctypes.c_int(clone_newnet | clone_newns)) == 0


def _confine_filesystem(workdir: str, read_roots: tuple) -> bool:
    """Make the working directory, `read_roots` and the few files Python needs the whole filesystem this
    process sees: they are bind-mounted at their own paths into an empty tmpfs that becomes the root
    (pivot_root; the old root is detached, so nothing leads back to it). Every other path is then absent
    to every call, stat() and readlink() included, which Landlock does not govern."""
    import ctypes

    ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind, ms_rec, ms_private = (
        1,
        2,
        4,
        32,
        4096,
        16384,
        1 << 18,
    )
    mnt_detach, sys_pivot_root = 2, {"x86_64": 155, "aarch64": 41}[platform.machine()]
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]

    def mount(source, target, fstype, flags):
        if libc.mount(source and os.fsencode(source), os.fsencode(target), fstype, flags, None) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {target}")

    mount(None, "/", None, ms_rec | ms_private)  # nothing below propagates back to the host
    # Descriptors first: the tmpfs may cover a source (the working directory is often under /tmp).
    sources = []
    for path in (workdir, *read_roots):
        try:
            sources.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        except OSError:
            continue  # absent on this system (/lib64 on aarch64)
    new_root = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    try:
        mount(b"tmpfs", new_root, b"tmpfs", ms_nosuid | ms_nodev)
    except BaseException:
        for _, fd in sources:
            os.close(fd)
        raise
    try:
        for path, fd in sources:
            target = new_root + path
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
            mount(f"/proc/self/fd/{fd}", target, None, ms_bind | ms_rec)
        os.chdir(new_root)
        if libc.syscall(ctypes.c_long(sys_pivot_root), b".", b".") != 0:
            raise OSError(ctypes.get_errno(), "pivot_root")
    except BaseException:
        libc.umount2(os.fsencode(new_root), ctypes.c_int(mnt_detach))  # the host's view back, as it was
        os.chdir(workdir)
        raise
    finally:
        for _, fd in sources:
            os.close(fd)
    # pivot_root(".", ".") stacks the old root on the new one; detached, nothing leads back to it.
    detached = libc.umount2(b".", ctypes.c_int(mnt_detach)) == 0
    if detached:
        # The tmpfs read-only: the working directory's mount is the only writable one.
        libc.mount(None, b"/", None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | ms_nodev, None)
    os.chdir(workdir)
    return detached


def _apply_landlock(workdir: str, python_dirs: tuple) -> int:
    import ctypes

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
    rules = [(p, read_only) for p in python_dirs + _SYSTEM_READ]
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


# Long: the syscall filter as one list of rules
def _apply_seccomp() -> bool:
    import ctypes

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
    realpath, fsdecode, fspath, sep = os.path.realpath, os.fsdecode, os.fspath, os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    devices = _DEVICES
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

    def check(path, write, follow=True):
        if path is None:
            path = "."
        if isinstance(path, int):
            return  # an already-open descriptor
        path = fsdecode(fspath(path))
        head, tail = os.path.split(path)
        if follow or tail in ("", ".", ".."):
            resolved = realpath(path)
        else:  # the link itself (lstat, readlink): where it lies, not where it points
            resolved = os.path.join(realpath(head or "."), tail)
        if under(resolved, (workdir,)) or resolved in devices or (not write and under(resolved, read_roots)):
            return
        what = "writing" if write else "reading"
        raise PermissionError(
            f"sandbox: {what} {path!r} is not allowed (only files in the working directory)"
        )

    _guard_metadata(check)

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


_NO_FOLLOW = ("lstat", "readlink")
"""Calls about a symbolic link itself: checked where the link lies, not where it points."""


def _guard_metadata(check) -> None:
    """Python raises no audit event for stat() and its kin (os.path.exists, isdir, getsize, realpath,
    Path.stat, os.access, readlink, statvfs, chdir), so the hook cannot see them: they are wrapped
    instead, in `os` and `posix` alike, and refuse a path outside the working directory as `open` does."""
    import _thread
    import posix

    local = _thread._local()

    def guarded(original):
        name = original.__name__

        def call(path, *args, **kwargs):
            if getattr(local, "busy", False):
                return original(path, *args, **kwargs)  # check() itself resolving a path (realpath)
            local.busy = True
            try:
                follow = name not in _NO_FOLLOW and kwargs.get("follow_symlinks", True)
                entry = os.fsdecode(path) if isinstance(path, (str, bytes)) else path
                if kwargs.get("dir_fd") is not None and isinstance(entry, str) and not os.path.isabs(entry):
                    # Relative to an open directory (shutil.rmtree, os.fwalk): one entry of it, not followed.
                    if os.sep in entry or entry in (".", "..") or follow:
                        raise PermissionError(
                            f"sandbox: reading {entry!r} relative to a descriptor is not allowed"
                        )
                else:
                    check(path, False, follow=follow)
            finally:
                local.busy = False
            return original(path, *args, **kwargs)

        call.__name__ = call.__qualname__ = name
        return call

    for name in ("stat", "lstat", "access", "readlink", "statvfs", "pathconf", "chdir"):
        original = getattr(posix, name, None)
        if original is not None:
            wrapper = guarded(original)
            setattr(posix, name, wrapper)
            setattr(os, name, wrapper)


if __name__ == "__main__":
    _child_main()
