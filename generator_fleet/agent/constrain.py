"""Constrained tool calls (`agent.constrain_tool_calls`): the grammar a tool call's body is generated under.

A model turn is generated freely until it writes the parser's start tag (`<tool_call>`, a stop string);
the call is then generated under one EBNF grammar (the engine's `ebnf` sampling param, xgrammar in the
built-in engine and in SGLang): at most one whitespace character, a JSON object
`{"name": <a tool's name>, "arguments": <that tool's `parameters` JSON schema>}`, at most one whitespace
character and the end tag, then only the stop token. Every call the policy makes thus parses and names a
real tool with arguments of the right shape; the tool still checks their values.
"""

from __future__ import annotations

import json
from typing import Any

WHITESPACE = 1
"""Whitespace characters allowed between JSON tokens (and around the object): compact and `json.dumps`
separators both fit, and a weak policy cannot loop on whitespace."""


def call_schema(tool_schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one Hermes call to any of `tool_schemas` (OpenAI function schemas)."""
    variants = []
    for s in tool_schemas:
        fn = s.get("function", s)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not variants:
        raise ValueError("constrained tool calls need at least one tool")
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def call_grammar(tool_schemas: list[dict[str, Any]], end_tag: str) -> str:
    """EBNF text for a call's body after the start tag: the call object, then `end_tag`. ValueError
    (naming the problem) when a tool's parameters are not a JSON schema xgrammar can compile."""
    import xgrammar as xgr  # noqa: PLC0415 - only jobs that constrain tool calls need it

    schema = call_schema(tool_schemas)
    try:
        body = xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=True, max_whitespace_cnt=WHITESPACE
        )
    except Exception as e:  # xgrammar raises RuntimeError subclasses with the converter's message
        raise ValueError(f"the tools' parameter schemas do not make a call grammar: {e}") from None
    ws = xgr.Grammar.from_ebnf(f"root ::= [ \\n]{{0,{WHITESPACE}}}")
    end = xgr.Grammar.from_ebnf(f"root ::= {json.dumps(end_tag)}")
    return str(xgr.Grammar.concat(ws, body, ws, end))
