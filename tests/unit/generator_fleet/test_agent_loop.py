"""The agent loop's state machine and token bookkeeping, driven by a scripted engine (pure unit test: the
real-engine path is covered by tests/system/slipstream/test_tools_job.py)."""

import asyncio

import pytest

from generator_fleet.agent.loop import AgentLoop, Limits
from generator_fleet.agent.parser import HermesParser
from generator_fleet.agent.render import render_prompt
from generator_fleet.client import GenerateResult
from generator_fleet.tools.base import ToolContext
from generator_fleet.tools.calculator import Calculator
from model_zoo.tiny_tools import build_tokenizer, tool_call_text


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class ScriptedEngine:
    """Answers each /generate with the next scripted assistant text (as tokens + EOS), tagging tokens with
    the current version; "ABORT:k" returns only k tokens of the next text with finish_reason abort."""

    def __init__(self, tok, script: list[str]):
        self.tok, self.script, self.version, self.calls = tok, list(script), 3, []

    async def __call__(self, input_ids, params):
        self.calls.append((input_ids, params))
        out = []
        for _ in input_ids:
            text = self.script.pop(0)
            if text.startswith("ABORT:"):
                k = int(text.split(":")[1])
                ids = self.tok.encode(self.script[0])[:k]
                self.script[0] = self.tok.decode(self.tok.encode(self.script[0])[k:])
                out.append(self._res(ids, "abort"))
                continue
            ids, finish = self.tok.encode(text) + [self.tok.eos_token_id], "stop"
            limit = params[len(out)]["max_new_tokens"]
            if len(ids) > limit:
                ids, finish = ids[:limit], "length"
            out.append(self._res(ids, finish))
        return out

    def _res(self, ids, finish):
        return GenerateResult(
            output_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            finish_reason=finish,
            token_versions=[self.version] * len(ids),
            weight_version=str(self.version),
            prompt_tokens=0,
        )


def _loop(tok, **limits):
    return AgentLoop(
        tok, {"calculator": Calculator()}, HermesParser(), Limits(**limits), {"temperature": 1.0}
    )


def _run(loop, engine, n=1):
    return asyncio.run(
        loop.run_group(engine, "What is 347*29?", ToolContext(prompt_id="p", answer="10063"), n)
    )


def test_tool_call_episode_tokens_masks_and_logprobs_line_up(tok):
    engine = ScriptedEngine(tok, [tool_call_text("347*29"), "The answer is 10063."])
    (ep,) = _run(_loop(tok), engine)
    assert ep.finish_reason == "stop" and ep.turns == 2 and ep.tool_calls == 1 and ep.tool_errors == 0
    n = len(ep.response_ids)
    assert len(ep.loss_mask) == len(ep.logprobs) == len(ep.versions) == n
    # Model tokens: mask 1, their logprob and version; tool/template tokens: mask 0, logprob 0, version -1.
    for m, lp, v in zip(ep.loss_mask, ep.logprobs, ep.versions, strict=True):
        assert (m, lp, v) in ((1, -0.5, 3), (0, 0.0, -1))
    masked_in = tok.decode(
        [t for t, m in zip(ep.response_ids, ep.loss_mask, strict=True) if m], skip_special_tokens=False
    )
    assert masked_in == tool_call_text("347*29") + "<|im_end|>" + "The answer is 10063.<|im_end|>"
    context = tok.decode(
        [t for t, m in zip(ep.response_ids, ep.loss_mask, strict=True) if not m], skip_special_tokens=False
    )
    assert "10063" in context and "<|im_start|>tool" in context  # the calculator's result, as the tool turn
    # Incremental token building equals re-tokenizing the whole conversation with the chat template.
    full = render_prompt(tok, ep.messages, tools=[Calculator().schema()], add_generation_prompt=False)
    assert ep.prompt_ids + ep.response_ids == full[:-1]  # minus the template's final "\n" (never generated)
    # The second turn was generated from exactly prompt + first turn + tool tokens.
    assert (
        engine.calls[1][0][0]
        == ep.prompt_ids + ep.response_ids[: len(engine.calls[1][0][0]) - len(ep.prompt_ids)]
    )


def test_malformed_tool_call_gets_an_error_message_not_a_crash(tok):
    engine = ScriptedEngine(tok, ["<tool_call>{not json}</tool_call>", "The answer is 1."])
    (ep,) = _run(_loop(tok), engine)
    assert ep.finish_reason == "stop" and ep.tool_errors == 1 and ep.tool_calls == 0
    assert ep.messages[2]["role"] == "tool" and "error" in ep.messages[2]["content"]


def test_unknown_tool_and_tool_budget(tok):
    call = '<tool_call>{"name": "web_search", "arguments": {}}</tool_call>'
    engine = ScriptedEngine(tok, [call, call])
    (ep,) = _run(_loop(tok, max_turns=2), engine)
    assert ep.finish_reason == "tool_budget" and ep.turns == 2 and ep.tool_errors == 1
    assert "unknown tool" in ep.messages[2]["content"]


def test_length_limit_ends_the_episode(tok):
    engine = ScriptedEngine(tok, ["x" * 100])
    (ep,) = _run(_loop(tok, max_new_tokens=20, max_total_tokens=20), engine)
    assert ep.finish_reason == "length" and len(ep.response_ids) == 20


def test_aborted_turn_is_resumed_from_its_prefix(tok):
    engine = ScriptedEngine(tok, ["ABORT:4", "The answer is 10063.", "unused"])
    engine_versions = iter([3, 4])

    async def gen(ids, params):
        engine.version = next(engine_versions)
        return await engine(ids, params)

    (ep,) = _run(_loop(tok), gen)
    assert ep.finish_reason == "stop" and ep.turns == 1
    assert ep.final_text == "The answer is 10063."
    assert ep.versions[:4] == [3] * 4 and set(ep.versions[4:]) == {4}  # one turn spanning two versions


def test_a_groups_first_turn_is_one_call_then_each_episode_goes_on_at_its_own_pace(tok):
    """Two episodes call a tool in their first turn (one batched call); then one episode's next turn is
    held until the other has finished two more turns: in lock-step that would never happen (the held
    turn would share a call with the other's)."""
    calls: list[int] = []
    fast_done = asyncio.Event()

    async def gen(ids, params):
        calls.append(len(ids))
        if len(calls) == 1:
            texts = [tool_call_text("2+2"), tool_call_text("3+3")]
        else:
            (one,) = ids
            convo = tok.decode(one)
            if "2+2" in convo:  # the slow episode: answers only once the fast one is done
                await asyncio.wait_for(fast_done.wait(), 30)
                texts = ["The answer is 4."]
            elif convo.count("<tool_call>") < 2:
                texts = [tool_call_text("6*7")]
            else:
                texts = ["The answer is 42."]
                fast_done.set()
        return [
            GenerateResult(
                output_ids=(o := tok.encode(t) + [tok.eos_token_id]),
                output_logprobs=[-0.5] * len(o),
                finish_reason="stop",
                token_versions=[3] * len(o),
                weight_version="3",
                prompt_tokens=0,
            )
            for t in texts
        ]

    eps = _run(_loop(tok), gen, n=2)
    assert [e.turns for e in eps] == [2, 3]
    assert [e.final_text for e in eps] == ["The answer is 4.", "The answer is 42."]
    assert calls == [2, 1, 1, 1]  # the first turn together, then one call per episode turn
