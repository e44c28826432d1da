"""The tool interface: a JSON schema the chat template shows the model, and an async call.

A tool result is what the model reads back (as a tool message, loss_mask 0). Tools may also score the
episode (`reward`) and end it (`done`), like verl's calc_gsm8k_reward tool.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec


class ToolResult(msgspec.Struct, kw_only=True):
    text: str
    """Content of the tool message shown to the model."""
    ok: bool = True
    """False when the call failed (bad arguments, timeout, crash): counted as a tool error."""
    reward: float | None = None
    """Set by tools that score the episode (e.g. check_answer); the last one set is the tool reward."""
    done: bool = False
    """The episode ends after this call (no further model turn)."""


class ToolContext(msgspec.Struct, kw_only=True):
    """What a tool may know about the episode it serves."""

    prompt_id: str
    answer: str | None = None
    """Ground-truth answer of the problem, for answer-checking tools."""
    workdir: str | None = None
    """A private temporary directory for this episode (sandboxed tools run there)."""


@runtime_checkable
class Tool(Protocol):
    name: str

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema: {"type": "function", "function": {"name", "description",
        "parameters": <JSON schema>}} — what `tokenizer.apply_chat_template(..., tools=[...])` takes."""
        ...

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Run the tool. Must not raise for bad input: return ToolResult(ok=False, text=<error for the
        model>). Timeouts are enforced by the caller too (agent.tool_timeout_s)."""
        ...
