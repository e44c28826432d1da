"""A minimal custom tool: the template to copy when registering your own tool in a job spec.

    tools:
      - name: echo
        impl: generator_fleet.tools.examples:EchoTool
        args: {prefix: "echo: "}

Any class works if its instances have a ``name`` attribute, a ``schema()`` method and an
``async call(arguments, ctx)`` method (see generator_fleet/tools/base.py).
"""

from __future__ import annotations

from typing import Any

from generator_fleet.tools.base import ToolContext, ToolResult


class EchoTool:
    """Returns its ``text`` argument, with an optional prefix."""

    def __init__(self, name: str = "echo", prefix: str = "") -> None:
        # Taking `name` lets one job register the same class twice under different names.
        self.name = name
        self.prefix = prefix

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Repeat the given text back.",
                "parameters": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "description": "Text to repeat."}},
                    "required": ["text"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        text = arguments.get("text")
        if not isinstance(text, str):
            return ToolResult(text="error: argument 'text' must be a string", ok=False)
        return ToolResult(text=self.prefix + text)
