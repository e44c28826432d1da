"""`tools[].impl` is checked before a job starts, from its source, without running any of it: by the check
itself and by `slipstream validate/run`; the allow-list of tool modules takes listed modules and their
submodules only, and the rollout workers enforce it again when they build the tools. `tools:` without
`agent:` is a spec error."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from tool_allow_list import ALLOWED

import jobspec
from generator_fleet.tools import ToolSpec, build_tools
from generator_fleet.tools.impl_check import TOOL_MODULES_ENV, check_impl, check_tools
from slipstream import cli

TOOL_CLASS = """
class {name}:
    def __init__(self, name="x"):
        self.name = name

    def schema(self):
        return {{"type": "function", "function": {{"name": self.name}}}}

    {asyn}def call(self, arguments, ctx):
        return None
"""


@pytest.fixture
def package(tmp_path):
    """A package on a path of its own whose every module, and its __init__, leaves a mark when imported."""
    marks = tmp_path / "marks"
    pkg = tmp_path / "src" / "sideeffects"
    pkg.mkdir(parents=True)

    def module(name: str, body: str) -> None:
        mark = f"open({str(marks / name)!r}, 'w').close()\n"
        (pkg / f"{name}.py").write_text(mark + textwrap.dedent(body))

    marks.mkdir()
    module("__init__", "")
    module("base", TOOL_CLASS.format(name="Base", asyn="async "))
    module(
        "tools",
        TOOL_CLASS.format(name="Good", asyn="async ")
        + TOOL_CLASS.format(name="SyncCall", asyn="")
        + """
from .base import Base as Renamed

class Derived(Renamed):
    pass

class NoCall:
    name = "x"
    def schema(self):
        return {}

def factory():
    return Good()

class Outer:
    Inner = Good
""",
    )
    return [str(tmp_path / "src"), *sys.path], marks


def test_the_check_reads_sources_and_runs_none_of_them(package):
    path, marks = package
    assert check_impl("sideeffects.tools:Good", path=path) is None
    assert check_impl("sideeffects.tools:Derived", path=path) is None  # members from a relative import's base
    assert (
        check_impl("sideeffects:tools", path=path) == "tools is not a class defined in module 'sideeffects'"
    )
    why = check_impl("sideeffects.tools:SyncCall", path=path)
    assert why == "sideeffects.tools:SyncCall: call() must be an async method"
    why = check_impl("sideeffects.tools:NoCall", path=path)
    assert "does not satisfy the Tool protocol" in why and why.endswith("no call")
    assert "is not a class" in check_impl("sideeffects.tools:factory", path=path)
    assert "is not a class" in check_impl("sideeffects.tools:Outer.Inner", path=path)
    assert "cannot find the Python source" in check_impl("sideeffects.nope:Good", path=path)
    assert list(marks.iterdir()) == []  # not one module (nor the package's __init__) was imported
    assert "sideeffects" not in sys.modules


def test_os_system_and_other_non_tools_are_refused_naming_the_key():
    def tools(*impls):
        return [ToolSpec(name=f"t{i}", impl=impl) for i, impl in enumerate(impls)]

    why = check_tools(tools("generator_fleet.tools.examples:EchoTool", "os:system"))
    assert why == "tool 't1': system is not a class defined in module 'os' - at `$.tools[1].impl`"
    why = check_tools(tools("fractions:Fraction"))
    assert "does not satisfy the Tool protocol" in why and why.endswith("at `$.tools[0].impl`")
    why = check_tools(tools("does.not.exist:Foo"))
    assert "cannot find the Python source of module 'does.not.exist'" in why
    assert "not of the form" in check_tools(tools("generator_fleet.tools.examples.EchoTool"))
    why = check_tools([ToolSpec(name="calculatr")])
    assert "no builtin tool of that name" in why and why.endswith("at `$.tools[0].name`")
    assert check_tools([ToolSpec(name=n) for n in ("calculator", "python", "check_answer")]) is None


def test_the_allow_list_takes_listed_modules_and_their_submodules_only():
    echo = "generator_fleet.tools.examples:EchoTool"
    assert check_impl(echo, allowed=["generator_fleet.tools"]) is None
    assert check_impl(echo, allowed=ALLOWED) is None
    for allowed in ([], ["generator_fleet.tool"], ["generator_fleet.tools.examples.sub"]):
        why = check_impl(echo, allowed=allowed)
        assert why.startswith("module 'generator_fleet.tools.examples' is not allowed on this cluster"), why
    assert "builtin tools only" in check_impl(echo, allowed=[])


def test_rollout_workers_enforce_the_allow_list_again(monkeypatch):
    spec = ToolSpec(name="echo", impl="generator_fleet.tools.examples:EchoTool")
    monkeypatch.setenv(TOOL_MODULES_ENV, json.dumps([]))
    with pytest.raises(ValueError, match="not allowed on this cluster"):
        build_tools([spec])
    assert set(build_tools([ToolSpec(name="calculator")])) == {"calculator"}  # builtins always
    monkeypatch.setenv(TOOL_MODULES_ENV, json.dumps(ALLOWED))
    assert set(build_tools([spec])) == {"echo"}


def test_tools_without_an_agent_are_a_spec_error():
    with pytest.raises(jobspec.JobSpecError, match=r"set `agent:` too - at `\$\.tools`"):
        jobspec.from_dict({"tools": [{"name": "x", "impl": "does.not.exist:Foo"}]})
    spec = jobspec.from_dict({"agent": {}, "tools": [{"name": "calculator"}]})
    assert [t.name for t in spec.tools] == ["calculator"]


def test_validate_and_run_check_the_impl_before_anything_runs(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("agent: {}\ntools: [{name: t, impl: 'os:system', args: {command: 'id'}}]\n")
    for cmd in ("validate", "run"):
        assert cli.main([cmd, str(path)]) == 2
        err = capsys.readouterr().err
        assert "is not a class defined in module 'os' - at `$.tools[0].impl`" in err, err
