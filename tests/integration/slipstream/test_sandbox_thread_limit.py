"""The Python sandbox's thread limit is what its notes say: a sandboxed program (a real subprocess) at the
default memory_mb starts the number of threads python_sandbox.py documents, and no more."""

import asyncio
import re
import resource


def test_sandbox_thread_limit_is_what_its_notes_say(record_property):
    """Measures how many threads a sandboxed program can start at the default memory_mb, and checks
    the number python_sandbox.py's notes give (they held "Threads still work" before)."""
    from generator_fleet.tools import python_sandbox
    from generator_fleet.tools.base import ToolContext

    code = (
        "import threading\nev = threading.Event()\nn = 0\ntry:\n"
        "    while n < 200:\n        threading.Thread(target=ev.wait, daemon=True).start()\n        n += 1\n"
        "except RuntimeError as e:\n    print('stopped by', e)\nprint('threads', n)\nev.set()\n"
    )
    sandbox = python_sandbox.PythonSandbox()
    result = asyncio.run(sandbox.call({"code": code}, ToolContext(prompt_id="p")))
    started = int(re.search(r"threads (\d+)", result.text).group(1))
    record_property("sandbox_threads_at_default_memory", started)
    print(f"memory_mb={sandbox.memory_mb}: {started} threads started ({result.text!r})")
    assert 0 < started < 200 and "can't start new thread" in result.text
    documented = re.search(r"memory_mb=256 only (\d+) threads start", python_sandbox.__doc__)
    assert documented, "python_sandbox.py's notes must say how many threads start at the default"
    if resource.getrlimit(resource.RLIMIT_STACK)[0] == 8 << 20:  # the notes' number is for 8 MiB stacks
        assert abs(started - int(documented.group(1))) <= 2, (started, documented.group(0))
