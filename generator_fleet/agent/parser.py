"""Tool-call parsing: split a model turn into its text and its tool calls, never raising.

Hermes/Qwen format (what Qwen2.5/Qwen3 chat templates teach):

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Each malformed block becomes an entry in `ParseResult.errors`, worded for the model, so the agent
loop can answer with it instead of crashing or silently dropping the call.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

_DECODER = json.JSONDecoder()


class ToolCall(msgspec.Struct):
    name: str
    arguments: dict[str, Any]


class ParseResult(msgspec.Struct):
    content: str
    """The text outside tool-call blocks, stripped."""
    calls: list[ToolCall]
    """Well-formed calls, in order."""
    errors: list[str]
    """One message per malformed block, e.g. 'error: tool call 2 is not valid JSON: ...'."""


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number per turn."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse(self, text: str) -> ParseResult:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        index = 0  # 1-based number of the block, counting malformed ones, as the model sees them
        while (start := text.find(self.start_tag, pos)) != -1:
            content.append(text[pos:start])
            index += 1
            body_start = start + len(self.start_tag)
            call, error, pos = self._parse_block(text, body_start, index)
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        content.append(text[pos:])
        # A stray closing tag is markup, not content.
        return ParseResult(
            content="".join(content).replace(self.end_tag, "").strip(), calls=calls, errors=errors
        )

    def _parse_block(self, text: str, body_start: int, index: int) -> tuple[ToolCall | None, str, int]:
        """Parse the block whose body starts at `body_start`; return (call, error, end of block)."""
        unclosed = f"error: tool call {index} is missing its closing {self.end_tag} tag"
        cursor = body_start
        while cursor < len(text) and text[cursor].isspace():
            cursor += 1
        # Decode one JSON value rather than the text up to the first end tag, so an argument string
        # that contains "</tool_call>" or "<tool_call>" (code the model writes) cannot cut it short.
        try:
            obj, json_end = _DECODER.raw_decode(text, cursor)
        except (json.JSONDecodeError, RecursionError) as e:
            end = text.find(self.end_tag, body_start)
            next_start = text.find(self.start_tag, body_start)
            if end == -1 or -1 < next_start < end:
                # Unclosed: the block runs to the next <tool_call>, or to the end of the turn.
                return None, unclosed, len(text) if next_start == -1 else next_start
            if isinstance(e, json.JSONDecodeError):
                reason = f"{e.msg} (at character {e.pos - cursor})"
            else:
                reason = "nested too deeply"
            return None, f"error: tool call {index} is not valid JSON: {reason}", end + len(self.end_tag)

        end = text.find(self.end_tag, json_end)
        next_start = text.find(self.start_tag, json_end)
        if end == -1 or -1 < next_start < end:
            return None, unclosed, len(text) if next_start == -1 else next_start
        block_end = end + len(self.end_tag)
        if text[json_end:end].strip():
            return None, f"error: tool call {index} has text after its JSON object", block_end
        call, error = _to_call(obj, index)
        return call, error, block_end


def _to_call(obj: Any, index: int) -> tuple[ToolCall | None, str]:
    """Validate one decoded block: (call, "") or (None, error for the model)."""
    if not isinstance(obj, dict):
        return None, f'error: tool call {index} must be a JSON object {{"name": ..., "arguments": {{...}}}}'
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f'error: tool call {index} has no "name" string'
    # Some models write "parameters"; a missing or null value is a call without arguments.
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        # Some templates (and OpenAI's API) carry the arguments as a JSON-encoded string.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return None, f'error: tool call {index} "arguments" is a string but not valid JSON: {e.msg}'
    if not isinstance(arguments, dict):
        return None, f'error: tool call {index} "arguments" must be a JSON object'
    return ToolCall(name=name, arguments=arguments), ""


PARSERS = {"hermes": HermesParser}


def get_parser(name: str) -> HermesParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; available: {sorted(PARSERS)}") from None
