"""Tools the model can call, and the registry that builds them from the job spec's tool list.

A tool is a builtin (`BUILTIN_TOOLS`, chosen by name) or any class named by import path:

    tools:
      - {name: calculator}
      - {name: python, args: {timeout_s: 2.0}}
      - {name: echo, impl: "generator_fleet.tools.examples:EchoTool"}
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from generator_fleet.tools.base import Tool, ToolContext, ToolResult
from generator_fleet.tools.calculator import Calculator
from generator_fleet.tools.check_answer import CheckAnswer
from generator_fleet.tools.impl_check import BUILTIN_TOOL_NAMES, allowed_from_env, module_allowed, not_allowed
from generator_fleet.tools.python_sandbox import PythonSandbox
from generator_fleet.tools.spec import ToolSpec

__all__ = [
    "BUILTIN_TOOLS",
    "Calculator",
    "CheckAnswer",
    "PythonSandbox",
    "Tool",
    "ToolContext",
    "ToolResult",
    "ToolSpec",
    "build_tools",
]

BUILTIN_TOOLS: dict[str, type] = {
    "calculator": Calculator,
    "python": PythonSandbox,
    "check_answer": CheckAnswer,
}
assert tuple(BUILTIN_TOOLS) == BUILTIN_TOOL_NAMES


def build_tools(specs: Iterable[ToolSpec]) -> dict[str, Tool]:
    """Construct every tool in `specs`, keyed by name; raises ValueError naming the faulty tool."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if spec.name in tools:
            raise ValueError(f"tool {spec.name!r} is listed twice")
        tools[spec.name] = build_tool(spec)
    return tools


def build_tool(spec: ToolSpec) -> Tool:
    if spec.impl is None:
        factory = BUILTIN_TOOLS.get(spec.name)
        if factory is None:
            raise ValueError(
                f"tool {spec.name!r}: no builtin tool of that name (builtins: {sorted(BUILTIN_TOOLS)}); "
                "set impl: 'package.module:ClassName' for a custom tool"
            )
    else:
        # The operator's allow-list, checked again here (the control API checked it at submit).
        allowed = allowed_from_env()
        if not module_allowed(spec.impl.partition(":")[0], allowed):
            raise ValueError(f"tool {spec.name!r}: {not_allowed(spec.impl.partition(':')[0], allowed or [])}")
        factory = _import(spec.name, spec.impl)
    try:
        tool = factory(**spec.args)
    except Exception as e:
        raise ValueError(f"tool {spec.name!r}: constructing {_describe(spec)} failed: {e!r}") from e
    _check_protocol(spec, tool)
    return tool


def _import(name: str, impl: str) -> Any:
    from generator_fleet.tools.impl_check import import_path

    module_name, sep, attr_path = impl.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"tool {name!r}: impl {impl!r} is not of the form 'package.module:ClassName'")
    obj = import_path(f"tool {name!r}", impl)
    if not callable(obj):
        raise ValueError(f"tool {name!r}: {impl!r} is not a class or factory")
    return obj


def _check_protocol(spec: ToolSpec, tool: Any) -> None:
    what = f"tool {spec.name!r}: {_describe(spec)}"
    if not isinstance(tool, Tool):
        raise ValueError(f"{what} does not satisfy the Tool protocol (needs name, schema(), async call())")
    if not inspect.iscoroutinefunction(tool.call):
        raise ValueError(f"{what}: call() must be an async method")
    # The model calls a tool by the name in its schema, and the agent looks it up by the spec's name:
    # the two must agree or every call would miss.
    if tool.name != spec.name:
        raise ValueError(
            f"{what} is named {tool.name!r}, not {spec.name!r} (pass args.name if the class takes one)"
        )
    try:
        schema_name = tool.schema()["function"]["name"]
    except Exception as e:
        raise ValueError(f"{what}: schema() is not an OpenAI function schema: {e!r}") from e
    if schema_name != spec.name:
        raise ValueError(f"{what}: schema() names the function {schema_name!r}, not {spec.name!r}")


def _describe(spec: ToolSpec) -> str:
    return spec.impl if spec.impl is not None else f"builtin {BUILTIN_TOOLS[spec.name].__name__}"
