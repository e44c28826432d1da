"""agent.constrain_tool_calls: the loop's two phases (free text stopped at `<tool_call>`, then the call's
body under the call grammar, one turn), scripted; the call grammar on a real engine with an untrained
model (every sampled call parses and fits the tools' schemas, which the free model never writes); and
the submit-time checks with their key paths."""

from __future__ import annotations

import asyncio
import json

import http_calls
import pytest

import jobspec
from generator_fleet.agent.constrain import call_grammar, call_schema
from generator_fleet.agent.loop import AgentLoop, Limits
from generator_fleet.agent.parser import HermesParser
from generator_fleet.client import GenerateResult
from generator_fleet.tools.base import ToolContext
from generator_fleet.tools.calculator import Calculator
from generator_fleet.tools.check_answer import CheckAnswer
from model_zoo.tiny_tools import build_tokenizer

API_KEY = "constrained-agent-key"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class Lookup:
    """A tool whose arguments are bounded (short key, small integer, one of two units): an untrained
    model's calls under the grammar always end within a few dozen tokens."""

    name = "lookup"

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Look a value up.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "key": {"type": "string", "maxLength": 6},
                        "n": {"type": "integer", "minimum": 0, "maximum": 99},
                        "unit": {"enum": ["kg", "m"]},
                    },
                    "required": ["key", "n"],
                },
            },
        }

    async def call(self, arguments, ctx):
        raise NotImplementedError


def check_lookup(call) -> None:
    """A parsed call is a `lookup` whose arguments fit its schema (checked by hand)."""
    assert call.name == "lookup", call
    args = call.arguments
    assert {"key", "n"} <= set(args) <= {"key", "n", "unit"}, call
    assert isinstance(args["key"], str) and len(args["key"]) <= 6, call
    assert isinstance(args["n"], int) and not isinstance(args["n"], bool) and 0 <= args["n"] <= 99, call
    assert args.get("unit", "kg") in ("kg", "m"), call


class PhasedEngine:
    """Scripted engine that honours the phase params: with `stop`, the scripted text is cut after the
    first stop string (finish stop, matched = it); with `ebnf`, the text must follow the call grammar's
    shape (the test's script does) and ends with EOS."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.calls = tok, list(script), []

    async def __call__(self, input_ids, params):
        out = []
        for p in params:
            self.calls.append(dict(p))
            text = self.script.pop(0)
            stops = p.get("stop") or []
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                cut = text[: text.index(hit) + len(hit)]
                self.script.insert(0, text[len(cut) :])
                ids, meta = self.tok.encode(cut), {"finish_reason": {"type": "stop", "matched": hit}}
            else:
                ids = self.tok.encode(text) + [self.tok.eos_token_id]
                meta = {"finish_reason": {"type": "stop", "matched": self.tok.eos_token_id}}
            out.append(
                GenerateResult(
                    output_ids=ids,
                    output_logprobs=[-0.1] * len(ids),
                    finish_reason="stop",
                    token_versions=[1] * len(ids),
                    weight_version="1",
                    prompt_tokens=0,
                    meta_info=meta,
                )
            )
        return out


def test_a_turn_stops_at_the_start_tag_and_the_call_goes_on_under_the_grammar(tok):
    loop = AgentLoop(
        tok,
        {"calculator": Calculator()},
        HermesParser(),
        Limits(max_turns=3, max_total_tokens=400, max_new_tokens=120),
        {"temperature": 1.0},
        constrain_tool_calls=True,
    )
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    engine = PhasedEngine(tok, ["Let me compute. " + call, "The answer is 42."])
    (ep,) = asyncio.run(loop.run_group(engine, "What is 6*7?", ToolContext(prompt_id="p", answer="42"), 1))
    assert ep.finish_reason == "stop" and ep.turns == 2 and ep.tool_calls == 1 and ep.tool_errors == 0
    grammar = loop.call_grammar
    assert [("stop" in c, c.get("ebnf") == grammar) for c in engine.calls] == [
        (True, False),  # free text, stopped at <tool_call>
        (False, True),  # the call's body under the grammar (same turn)
        (True, False),  # the next turn is free again
    ]
    assert engine.calls[0]["stop"] == ["<tool_call>"]
    # The turn's two requests are one assistant message; the tool's answer came back as context.
    assert ep.messages[1] == {"role": "assistant", "content": "Let me compute. " + call}
    assert ep.messages[2] == {"role": "tool", "content": "42"}
    assert len(ep.loss_mask) == len(ep.response_ids) == len(ep.logprobs)


def test_without_the_key_the_loop_sends_no_grammar(tok):
    loop = AgentLoop(tok, {"calculator": Calculator()}, HermesParser(), Limits(), {"temperature": 1.0})
    assert loop.call_grammar is None
    engine = PhasedEngine(tok, ["The answer is 42."])
    asyncio.run(loop.run_group(engine, "What is 6*7?", ToolContext(prompt_id="p"), 1))
    assert engine.calls == [{"temperature": 1.0, "max_new_tokens": 128}]


def test_call_schema_of_several_tools():
    tools = [Calculator().schema(), CheckAnswer().schema()]
    schema = call_schema(tools)
    names = [v["properties"]["name"]["const"] for v in schema["anyOf"]]
    assert names == ["calculator", "check_answer"]
    with pytest.raises(ValueError, match="at least one tool"):
        call_schema([])
    bad = {
        "type": "function",
        "function": {"name": "x", "parameters": {"type": "object", "minProperties": "z"}},
    }
    with pytest.raises(ValueError, match="parameter schemas do not make a call grammar"):
        call_grammar([bad], "</tool_call>")


@pytest.fixture(scope="module")
def engine_url(untrained_tools_model_dir):
    from generator_fleet.engine import EngineServer

    server = EngineServer(str(untrained_tools_model_dir), api_key=API_KEY, context_length=512).start()
    yield server.url
    server.stop()


def test_the_call_grammar_makes_an_untrained_model_write_valid_calls(engine_url, tok):
    grammar = call_grammar([Lookup().schema()], HermesParser.end_tag)
    prompt = tok.encode("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>")
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def sample(**sp) -> list[dict]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 120, **sp}}
        r = http_calls.post(engine_url + "/generate", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        return out if isinstance(out, list) else [out]

    parser = HermesParser()
    outs = sample(temperature=1.0, ebnf=grammar, n=8) + sample(temperature=0.0, ebnf=grammar)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        parsed = parser.parse("<tool_call>" + o["text"])
        assert not parsed.errors and len(parsed.calls) == 1, o["text"]
        check_lookup(parsed.calls[0])
    # The same model without the grammar writes no valid call.
    for o in sample(temperature=1.0, n=8):
        parsed = parser.parse("<tool_call>" + o["text"])
        assert parsed.errors or not parsed.calls, o["text"]


def test_submit_checks_name_the_key(tmp_path):
    base = {
        "name": "c",
        "model": {"path": str(tmp_path)},
        "dataset": {"name": "word_problems"},
        "agent": {"constrain_tool_calls": True},
    }
    with pytest.raises(jobspec.JobSpecError, match=r"no `tools:`.*\$\.agent\.constrain_tool_calls"):
        jobspec.from_dict(base)
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.tools\[0\]\.args"):
        jobspec.from_dict({**base, "tools": [{"name": "calculator", "args": {"max_digits": 0}}]})
    spec = jobspec.from_dict({**base, "tools": [{"name": "calculator"}]})
    assert spec.agent.constrain_tool_calls
    assert json.loads(jobspec.to_json(spec))["agent"]["constrain_tool_calls"] is True
