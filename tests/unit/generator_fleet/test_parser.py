"""Hermes tool-call parsing: well-formed calls come out as ToolCalls, anything else as a model-facing error."""

from __future__ import annotations

import json

import pytest

from generator_fleet.agent.parser import HermesParser, ParseResult, ToolCall, get_parser


def parse(text: str) -> ParseResult:
    return HermesParser().parse(text)


def block(obj: object) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_single_call_and_surrounding_text():
    text = (
        "Let me compute.\n" + block({"name": "calculator", "arguments": {"expression": "12*7"}}) + "\nDone."
    )
    result = parse(text)
    assert result.calls == [ToolCall(name="calculator", arguments={"expression": "12*7"})]
    assert result.errors == []
    assert result.content == "Let me compute.\n\nDone."


def test_multiple_calls_in_order():
    text = (
        block({"name": "calculator", "arguments": {"expression": "1+1"}})
        + "\n"
        + block({"name": "python", "arguments": {"code": "print(2)"}})
    )
    result = parse(text)
    assert [c.name for c in result.calls] == ["calculator", "python"]
    assert result.calls[1].arguments == {"code": "print(2)"}
    assert result.content == ""
    assert result.errors == []


def test_no_tool_call_is_all_content():
    result = parse("  The answer is 42.  ")
    assert result == ParseResult(content="The answer is 42.", calls=[], errors=[])


def test_arguments_as_json_string():
    result = parse(block({"name": "calculator", "arguments": json.dumps({"expression": "2**8"})}))
    assert result.calls == [ToolCall(name="calculator", arguments={"expression": "2**8"})]


def test_parameters_alias_and_missing_arguments():
    result = parse(block({"name": "a", "parameters": {"x": 1}}) + block({"name": "b"}))
    assert result.calls == [ToolCall(name="a", arguments={"x": 1}), ToolCall(name="b", arguments={})]


def test_end_tag_inside_an_argument_string_does_not_cut_the_call():
    code = 'print("</tool_call> and <tool_call>")'
    result = parse(block({"name": "python", "arguments": {"code": code}}) + " after")
    assert result.calls == [ToolCall(name="python", arguments={"code": code})]
    assert result.content == "after"
    assert result.errors == []


def test_malformed_json_is_an_error_and_later_calls_still_parse():
    text = '<tool_call>{"name": "calculator", "arguments": {</tool_call>' + block(
        {"name": "ok", "arguments": {}}
    )
    result = parse(text)
    assert result.calls == [ToolCall(name="ok", arguments={})]
    assert len(result.errors) == 1
    assert result.errors[0].startswith("error: tool call 1 is not valid JSON: ")


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"arguments": {"x": 1}}, 'error: tool call 1 has no "name" string'),
        ({"name": "", "arguments": {}}, 'error: tool call 1 has no "name" string'),
        ({"name": 3, "arguments": {}}, 'error: tool call 1 has no "name" string'),
        ({"name": "f", "arguments": [1, 2]}, 'error: tool call 1 "arguments" must be a JSON object'),
        ({"name": "f", "arguments": "[1, 2]"}, 'error: tool call 1 "arguments" must be a JSON object'),
        (
            {"name": "f", "arguments": "{oops"},
            'error: tool call 1 "arguments" is a string but not valid JSON',
        ),
        (["f", {}], "error: tool call 1 must be a JSON object"),
    ],
)
def test_bad_call_shapes_are_errors(obj, message):
    result = parse(block(obj))
    assert result.calls == []
    assert len(result.errors) == 1
    assert result.errors[0].startswith(message)


def test_text_after_the_json_object_is_an_error():
    result = parse('<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>')
    assert result.calls == []
    assert result.errors == ["error: tool call 1 has text after its JSON object"]


def test_unclosed_tag_at_end_of_turn():
    result = parse('Thinking.<tool_call>{"name": "f", "arguments": {}}')
    assert result.calls == []
    assert result.errors == ["error: tool call 1 is missing its closing </tool_call> tag"]
    assert result.content == "Thinking."


def test_unclosed_tag_followed_by_a_good_call():
    text = '<tool_call>{"name": "f", "argu' + block({"name": "g", "arguments": {"y": 2}})
    result = parse(text)
    assert result.calls == [ToolCall(name="g", arguments={"y": 2})]
    assert result.errors == ["error: tool call 1 is missing its closing </tool_call> tag"]


def test_every_prefix_of_a_turn_parses_without_raising():
    text = "Sure. " + block({"name": "calculator", "arguments": {"expression": "1+2"}}) + " ok"
    for end in range(len(text) + 1):
        result = parse(text[:end])
        complete = "</tool_call>" in text[:end]
        assert len(result.calls) == (1 if complete else 0)
        assert len(result.errors) == (1 if "<tool_call>" in text[:end] and not complete else 0)


def test_deeply_nested_json_is_an_error_not_a_crash():
    result = parse("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>")
    assert result.calls == []
    assert result.errors == ["error: tool call 1 is not valid JSON: nested too deeply"]


def test_stray_closing_tag_is_not_content():
    assert parse("42</tool_call>").content == "42"


def test_get_parser():
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen9'"):
        get_parser("qwen9")
