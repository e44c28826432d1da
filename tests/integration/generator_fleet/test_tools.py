"""Builtin tools and the registry: calculator values and refusals, the Python sandbox's limits and
isolation, answer checking, and building tools from job-spec entries."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from typing import Any

import msgspec
import pytest

from generator_fleet.tools import (
    BUILTIN_TOOLS,
    Calculator,
    CheckAnswer,
    PythonSandbox,
    Tool,
    ToolContext,
    ToolResult,
    ToolSpec,
    build_tools,
)
from generator_fleet.tools.examples import EchoTool

CTX = ToolContext(prompt_id="p0")


def call(tool: Any, ctx: ToolContext = CTX, **arguments: Any) -> ToolResult:
    return asyncio.run(tool.call(arguments, ctx))


# --- calculator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2", "3"),
        ("2 * (3 + 4)", "14"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),
        ("+5 - -5", "10"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        ("2 ** -1", "0.5"),
        ("1.5e3", "1500"),
        ("10 ** 99", "1" + "0" * 99),
        ("  (12 + 30) * 2  ", "84"),
    ],
)
def test_calculator_values(expression, value):
    result = call(Calculator(), expression=expression)
    assert result == ToolResult(text=value)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("9 ** 9 ** 9", "error: result too large"),  # refused from its size, never computed
        ("10 ** 100 * 10", "error: result too large"),
        ("1e308 * 10", "error: result too large"),
        ("(-8) ** 0.5", "error: result is not a real number"),
        ("2 ^ 3", "error: use ** for powers"),
        ("x + 1", "error: only numbers"),
        ("abs(-1)", "error: only numbers"),
        ("__import__('os')", "error: only numbers"),
        ("True + 1", "error: only numbers"),
        ("1j * 2", "error: only numbers"),
        ("1 +", "error: invalid expression"),
        ("", "error: invalid expression"),
        ("1+" * 600 + "1", "error: expression longer than 1000 characters"),
    ],
)
def test_calculator_errors(expression, message):
    result = call(Calculator(), expression=expression)
    assert not result.ok
    assert result.text.startswith(message)


def test_calculator_digit_limit_is_configurable():
    assert call(Calculator(max_digits=5), expression="99999 + 1").text.startswith("error: result too large")
    assert call(Calculator(max_digits=5), expression="2 ** 16").text == "65536"


def test_calculator_bad_arguments():
    assert not call(Calculator()).ok
    assert not call(Calculator(), expression=["1"]).ok
    assert call(Calculator(), expression=7).text == "7"


# --- python sandbox --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def isolation():
    return asyncio.run(PythonSandbox().probe())


def workdir_ctx(path) -> ToolContext:
    path.mkdir(exist_ok=True)
    return ToolContext(prompt_id="p0", workdir=str(path))


def test_sandbox_prints_output():
    result = call(PythonSandbox(), code="import math\nprint(math.factorial(5))\nprint('done')")
    assert result == ToolResult(text="120\ndone")


def test_sandbox_standard_library_works():
    code = (
        "import asyncio, decimal, hashlib, json, threading\n"
        "thread = threading.Thread(target=print, args=('thread',))\n"
        "thread.start()\n"
        "thread.join()\n"
        "print(json.dumps(asyncio.run(asyncio.sleep(0, 7))))"
    )
    assert call(PythonSandbox(), code=code) == ToolResult(text="thread\n7")


def test_sandbox_no_output():
    assert call(PythonSandbox(), code="x = 1") == ToolResult(text="(no output)")


def test_sandbox_exception_reports_traceback_and_last_line():
    result = call(PythonSandbox(), code="print('before')\n1 / 0")
    assert not result.ok
    assert result.text.startswith("before\n")
    assert 'File "<code>", line 2' in result.text
    assert result.text.endswith("error: ZeroDivisionError: division by zero")
    assert "sandbox_child" not in result.text  # the sandbox's own frames are hidden


def test_sandbox_syntax_error():
    result = call(PythonSandbox(), code="def f(:\n    pass")
    assert not result.ok
    assert result.text.endswith("error: SyntaxError: invalid syntax")


def test_sandbox_exit_code():
    result = call(PythonSandbox(), code="import sys\nsys.exit(3)")
    assert result == ToolResult(text="error: exit code 3", ok=False)


def test_sandbox_runaway_loop_is_killed_by_the_timeout(tmp_path):
    ctx = workdir_ctx(tmp_path / "work")
    code = "import os\nopen('pid', 'w').write(str(os.getpid()))\nwhile True:\n    pass"
    result = call(PythonSandbox(timeout_s=1.0), ctx, code=code)
    assert result == ToolResult(text="error: timed out after 1s", ok=False)
    pid = int((tmp_path / "work" / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left running


def test_sandbox_cpu_limit():
    result = call(PythonSandbox(timeout_s=60.0, cpu_s=1), code="while True:\n    pass")
    assert result == ToolResult(text="error: CPU time limit exceeded (1s)", ok=False)


@pytest.mark.parametrize(
    "code", ["x = bytearray(1 << 30)", "x = [0] * (1 << 28)", "s = 'a'\nwhile True:\n    s += s"]
)
def test_sandbox_memory_bomb(code):
    result = call(PythonSandbox(memory_mb=128, timeout_s=30.0), code=code)
    assert not result.ok
    assert result.text.endswith("error: MemoryError") or "error: killed by" in result.text


def test_sandbox_output_is_truncated_in_the_middle():
    result = call(PythonSandbox(max_output_chars=1000), code="print('a' * 50_000)\nprint('end')")
    assert result.ok
    assert result.text.startswith("a" * 400)
    assert result.text.endswith("end")
    assert "characters cut" in result.text
    assert len(result.text) < 1100


def test_sandbox_output_flood_is_stopped():
    result = call(PythonSandbox(timeout_s=30.0), code="while True:\n    print('y' * 1000)")
    assert not result.ok
    assert result.text.endswith("error: output limit exceeded (1024 KiB)")


def test_sandbox_does_not_inherit_the_environment(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TEST_SECRET", "hunter2")
    result = call(PythonSandbox(), code="import os\nprint(sorted(os.environ))")
    assert result.ok
    assert "SLIPSTREAM_TEST_SECRET" not in result.text


def test_sandbox_probe_reports_the_audit_hook(isolation):
    assert isolation.audit_hook
    assert asyncio.run(PythonSandbox(audit_hook=False).probe()).audit_hook is False


def test_sandbox_require_isolation(isolation):
    result = call(PythonSandbox(require_isolation=True), code="print('ran')")
    if isolation.netns and isolation.landlock_abi and isolation.seccomp:
        assert result == ToolResult(text="ran")
    else:
        assert not result.ok
        assert "ran" not in result.text


def skip_unless_kernel_layer(audit_hook: bool, available: bool) -> None:
    # With the audit hook off, only the kernel layers stand: test them where this kernel has them.
    if not audit_hook and not available:
        pytest.skip("this kernel lacks the isolation layer under test")


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
def test_sandbox_network_is_denied(audit_hook, isolation):
    skip_unless_kernel_layer(audit_hook, isolation.netns or isolation.landlock_abi >= 4 or isolation.seccomp)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')"
        )
        result = call(PythonSandbox(audit_hook=audit_hook), code=code)
        assert not result.ok
        assert "connected" not in result.text
        # A completed handshake would be waiting in the accept queue by now.
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
def test_sandbox_named_unix_sockets_are_denied(audit_hook, isolation):
    # A Unix socket on the filesystem (a local Redis, docker.sock) is reachable from any network
    # namespace; only seccomp (and the hook) keep the code from it.
    skip_unless_kernel_layer(audit_hook, isolation.seccomp)
    with tempfile.TemporaryDirectory() as d, socket.socket(socket.AF_UNIX) as listener:
        path = os.path.join(d, "s.sock")  # short: a socket path must fit in 108 bytes
        listener.bind(path)
        listener.listen()
        code = f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\nprint('connected'.upper())"
        result = call(PythonSandbox(audit_hook=audit_hook), code=code)
        assert not result.ok
        assert "CONNECTED" not in result.text
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
def test_sandbox_files_outside_the_workdir_are_denied(tmp_path, audit_hook, isolation):
    skip_unless_kernel_layer(audit_hook, isolation.landlock_abi >= 1)
    sandbox = PythonSandbox(audit_hook=audit_hook)
    ctx = workdir_ctx(tmp_path / "work")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")

    for code in [
        "print(open('/etc/passwd').read())",
        f"print(open({str(secret)!r}).read())",
        "print(open('../secret.txt').read())",
        "import os\nos.symlink('../secret.txt', 'link')\nprint(open('link').read())",
        "import os\nprint(os.listdir('/'))",
    ]:
        result = call(sandbox, ctx, code=code)
        assert not result.ok, code
        # The kernel's view (a private mount namespace) has no such file at all; the hook refuses first.
        absent = not audit_hook and isolation.filesystem and "FileNotFoundError" in result.text
        assert "PermissionError" in result.text or absent, code
        assert "root:" not in result.text and "do not read" not in result.text

    result = call(sandbox, ctx, code="open('../outside.txt', 'w').write('escaped')")
    assert not result.ok
    assert not (tmp_path / "outside.txt").exists()

    result = call(
        sandbox, ctx, code="open('inside.txt', 'w').write('kept')\nprint(open('inside.txt').read())"
    )
    assert result == ToolResult(text="kept")
    assert (tmp_path / "work" / "inside.txt").read_text() == "kept"


METADATA_PROBE = """
import os, pathlib, shutil
calls = {
    "stat": os.stat, "lstat": os.lstat, "exists": os.path.exists, "isfile": os.path.isfile,
    "isdir": os.path.isdir, "getsize": os.path.getsize, "access": lambda p: os.access(p, os.F_OK),
    "Path.stat": lambda p: pathlib.Path(p).stat().st_size, "readlink": os.readlink,
    "disk_usage": lambda p: shutil.disk_usage(p).total > 0, "chdir": os.chdir,
}
for path in PATHS:
    seen = []
    for name, fn in calls.items():
        try:
            seen.append(f"{name}={fn(path)!r}")
        except OSError as e:
            seen.append(f"{name}:{type(e).__name__}")
    print(" ".join(seen))
"""


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
def test_sandbox_file_metadata_outside_the_workdir_is_hidden(tmp_path, audit_hook, isolation):
    # stat() and its kin answer whether a path exists, its size and owner: outside the working directory
    # a file that exists must look exactly like one that does not.
    skip_unless_kernel_layer(audit_hook, isolation.filesystem)
    ctx = workdir_ctx(tmp_path / "work")
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "key.pem").write_text("x" * 1234)
    (tmp_path / "work" / "mine.txt").write_text("abc")
    pairs = [
        (secret_dir / "key.pem", secret_dir / "missing.pem"),
        (secret_dir, tmp_path / "missing-dir"),
        ("/etc/passwd", "/etc/no-such-file"),
        ("../secret/key.pem", "../secret/missing.pem"),
    ]
    for present, missing in pairs:
        code = f"PATHS = {[str(present), str(missing)]!r}\n{METADATA_PROBE}"
        result = call(PythonSandbox(audit_hook=audit_hook), ctx, code=code)
        assert result.ok, result.text
        seen_present, seen_missing = result.text.splitlines()
        assert seen_present == seen_missing, (present, result.text)
        assert "=True" not in seen_present and "1234" not in seen_present, result.text
    result = call(
        PythonSandbox(audit_hook=audit_hook), ctx, code="import os\nprint(os.stat('mine.txt').st_size)"
    )
    assert result == ToolResult(text="3")


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
@pytest.mark.parametrize(
    "code",
    [
        # Each would print SPAWNED, a word that its source (shown in tracebacks) does not contain.
        "import subprocess\nprint(subprocess.run(['echo', 'spawned'.upper()], capture_output=True).stdout)",
        "import os\nprint('rc', os.system('echo SPAWN\"\"ED'))",
        "import os\nif os.fork() == 0:\n    print('spawned'.upper())",
        "import os\nos.execv('/bin/echo', ['echo', 'spawned'.upper()])",
    ],
)
def test_sandbox_cannot_spawn_processes(audit_hook, code, isolation):
    skip_unless_kernel_layer(audit_hook, isolation.seccomp)
    result = call(PythonSandbox(audit_hook=audit_hook), code=code)
    assert "SPAWNED" not in result.text
    if audit_hook:
        assert not result.ok


@pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])
def test_sandbox_cannot_signal_its_parent(audit_hook, isolation):
    skip_unless_kernel_layer(audit_hook, isolation.landlock_abi >= 6)
    # Signal 0 only checks permission, so a failure of this test cannot hurt the test run.
    result = call(
        PythonSandbox(audit_hook=audit_hook),
        code="import os\nos.kill(os.getppid(), 0)\nprint('signalled'.upper())",
    )
    assert not result.ok
    assert "SIGNALLED" not in result.text


def test_sandbox_blocks_ctypes():
    result = call(PythonSandbox(), code="import ctypes\nprint(ctypes.CDLL(None).getpid())")
    assert not result.ok
    assert "ctypes.dlopen is not allowed" in result.text


def test_sandbox_cancellation_kills_the_child(tmp_path):
    """A caller that gives up (agent.tool_timeout_s) must not leave the process running."""
    work = tmp_path / "work"
    work.mkdir()
    os.mkfifo(work / "fifo")
    code = "import os\nopen('pid', 'w').write(str(os.getpid()))\nopen('fifo').read()"

    async def scenario() -> int:
        task = asyncio.create_task(PythonSandbox(timeout_s=60.0).call({"code": code}, workdir_ctx(work)))
        # Opening a FIFO for writing returns once the child has opened it for reading: it is running.
        fd = await asyncio.to_thread(os.open, work / "fifo", os.O_WRONLY)
        try:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            os.close(fd)
        return int((work / "pid").read_text())

    pid = asyncio.run(scenario())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sandbox_bad_arguments():
    assert call(PythonSandbox()) == ToolResult(
        text="error: argument 'code' must be a string of Python source", ok=False
    )


# --- check_answer ----------------------------------------------------------------------------------


def answer_ctx(answer: str | None) -> ToolContext:
    return ToolContext(prompt_id="p0", answer=answer)


@pytest.mark.parametrize("given", ["1234", "1,234", "$1,234", " 1234 ", "1234.00", 1234, 1234.0])
def test_check_answer_correct_numeric(given):
    result = call(CheckAnswer(), answer_ctx("1234"), answer=given)
    assert result == ToolResult(text="Correct.", reward=1.0, done=False)


def test_check_answer_compares_numbers_exactly():
    assert call(CheckAnswer(), answer_ctx("0.5"), answer="1/2").text == "Correct."
    assert call(CheckAnswer(), answer_ctx("0.3"), answer=0.30000000000000004).text == "Incorrect."


def test_check_answer_rewards():
    tool = CheckAnswer(correct_reward=1.0, wrong_reward=-1.0, format_reward=0.1)
    assert call(tool, answer_ctx("42"), answer="42").reward == 1.0
    assert call(tool, answer_ctx("42"), answer="41") == ToolResult(text="Incorrect.", reward=0.1)
    assert call(tool, answer_ctx("42"), answer="forty-two") == ToolResult(text="Incorrect.", reward=-1.0)
    assert call(tool, answer_ctx("42"), answer="") == ToolResult(text="Incorrect.", reward=-1.0)


def test_check_answer_text_reference():
    tool = CheckAnswer(format_reward=0.1)
    assert call(tool, answer_ctx("Paris"), answer="  paris ") == ToolResult(text="Correct.", reward=1.0)
    assert call(tool, answer_ctx("Paris"), answer="Lyon") == ToolResult(text="Incorrect.", reward=0.1)


def test_check_answer_errors():
    assert not call(CheckAnswer(), answer_ctx("1")).ok
    assert not call(CheckAnswer(), answer_ctx("1"), answer=True).ok
    assert not call(CheckAnswer(), answer_ctx(None), answer="1").ok


# --- registry --------------------------------------------------------------------------------------


def test_build_builtin_tools():
    tools = build_tools(
        [
            ToolSpec(name="calculator"),
            ToolSpec(name="python", args={"timeout_s": 2.0}),
            ToolSpec(name="check_answer"),
        ]
    )
    assert list(tools) == ["calculator", "python", "check_answer"]
    assert {name: type(tool) for name, tool in tools.items()} == BUILTIN_TOOLS
    assert tools["python"].timeout_s == 2.0
    for name, tool in tools.items():
        assert isinstance(tool, Tool)
        assert tool.schema()["function"]["name"] == name


def test_build_tool_from_import_path():
    spec = msgspec.convert(
        {
            "name": "shout",
            "impl": "generator_fleet.tools.examples:EchoTool",
            "args": {"name": "shout", "prefix": ">> "},
        },
        ToolSpec,
    )
    tool = build_tools([spec])["shout"]
    assert isinstance(tool, EchoTool)
    assert call(tool, text="hi") == ToolResult(text=">> hi")


def test_tool_spec_rejects_unknown_fields():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"name": "calculator", "arg": {}}, ToolSpec)


class SyncTool:
    name = "sync"

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "sync"}}

    def call(self, arguments, ctx):
        return ToolResult(text="")


@pytest.mark.parametrize(
    "spec, message",
    [
        (ToolSpec(name="nope"), "tool 'nope': no builtin tool"),
        (ToolSpec(name="x", impl="generator_fleet.tools.examples.EchoTool"), "not of the form"),
        (ToolSpec(name="x", impl="generator_fleet.no_such_module:EchoTool"), "cannot import module"),
        (ToolSpec(name="x", impl="generator_fleet.tools.examples:Missing"), "has no attribute 'Missing'"),
        (ToolSpec(name="x", impl="fractions:Fraction"), "does not satisfy the Tool protocol"),
        (ToolSpec(name="x", impl="generator_fleet.tools.examples:EchoTool"), "is named 'echo', not 'x'"),
        (
            ToolSpec(name="echo", impl="generator_fleet.tools.examples:EchoTool", args={"bogus": 1}),
            "constructing",
        ),
        (ToolSpec(name="calculator", args={"max_digits": 0}), "max_digits must be >= 1"),
    ],
)
def test_build_tools_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        build_tools([spec])


def test_build_tools_rejects_a_sync_call(monkeypatch):
    monkeypatch.setitem(BUILTIN_TOOLS, "sync", SyncTool)
    with pytest.raises(ValueError, match="tool 'sync'.*call\\(\\) must be an async method"):
        build_tools([ToolSpec(name="sync")])


def test_build_tools_rejects_duplicate_names():
    with pytest.raises(ValueError, match="tool 'calculator' is listed twice"):
        build_tools([ToolSpec(name="calculator"), ToolSpec(name="calculator")])
