"""The agent loop: G multi-turn, tool-using episodes of one prompt. Their first turn is one batched
/generate (the engine computes the shared prompt once); after it each episode goes on at its own pace, so a
short episode's next turn never waits for a long one's (a group then takes its longest episode's time, not
the sum over turns of each turn's longest).

Each episode is a state machine (seed 000/003):

    PENDING -> RUNNING -> (TOOL_CALLING -> RUNNING)* -> COMPLETED

Token-in/token-out: the episode keeps token ids end to end and never re-tokenizes model output. Model
tokens carry their behaviour logprob and weight version (loss_mask 1); tool results are rendered with the
model's chat template and appended as tokens with loss_mask 0, logprob 0, version -1.

Finish reasons: `stop` (the model answered without a tool call, or a tool ended the episode), `length`
(max_total_tokens reached), `tool_budget` (max_turns used up while the model still called tools), `abort`
(the worker is stopping). An engine pause that aborts a request mid-turn is resumed from the prefix.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from generator_fleet import metrics
from generator_fleet.agent.constrain import call_grammar
from generator_fleet.agent.parser import ParseResult, ToolCall
from generator_fleet.agent.render import render_delta, render_prompt
from generator_fleet.client import GenerateResult
from generator_fleet.tools.base import Tool, ToolContext, ToolResult

log = logging.getLogger(__name__)

GenerateBatch = Callable[[list[list[int]], list[dict[str, Any]]], Awaitable[list[GenerateResult]]]


class State(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    COMPLETED = "completed"


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    max_turns: int = 4
    """Model turns per episode; a tool call in the last turn ends it with finish_reason tool_budget."""
    max_total_tokens: int = 512
    """Response tokens per episode (model + tool tokens)."""
    max_new_tokens: int = 128
    """Tokens per model turn."""
    tool_timeout_s: float = 10.0


class Episode:
    """One sample: its messages (for rendering) and its token-level record (for training)."""

    def __init__(
        self, prompt_ids: list[int], messages: list[dict[str, Any]], temperature: float = 1.0
    ) -> None:
        self.state = State.PENDING
        self.messages = list(messages)
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        """Tokens of the rendered first prompt; every turn's request is prompt_ids + response_ids."""
        self.temperature = temperature
        """Sampling temperature of every model turn (the trainer's logprobs use the same)."""
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turn_start = 0
        """Index in response_ids where the current model turn began."""
        self.turns = 0
        self.in_call = False
        """The current turn wrote the tool-call start tag and goes on under the call grammar
        (agent.constrain_tool_calls)."""
        self.tool_calls = 0
        self.tool_errors = 0
        self.tool_reward: float | None = None
        self.finish_reason: str | None = None
        self.final_text = ""
        """Content of the last assistant turn (what end-of-episode rewards score)."""

    def add_model_tokens(self, res: GenerateResult) -> None:
        self.response_ids += res.output_ids
        self.loss_mask += [1] * len(res.output_ids)
        self.logprobs += res.output_logprobs
        self.versions += res.token_versions

    def add_context_tokens(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def finish(self, reason: str) -> None:
        self.state = State.COMPLETED
        self.finish_reason = reason


class AgentLoop:
    def __init__(
        self,
        tokenizer,
        tools: dict[str, Tool],
        parser,
        limits: Limits,
        sampling: dict[str, Any],
        system_prompt: str | None = None,
        constrain_tool_calls: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.parser = parser
        self.limits = limits
        self.sampling = sampling
        self.system_prompt = system_prompt
        self.schemas = [t.schema() for t in tools.values()] or None
        self.stop_ids = {tokenizer.eos_token_id}
        self.turn_suffix = _turn_suffix(tokenizer)
        self.call_grammar: str | None = None
        """EBNF of a tool call's body and end tag (constrain_tool_calls; see agent/constrain.py)."""
        if constrain_tool_calls:
            self.call_grammar = call_grammar(self.schemas or [], parser.end_tag)
            log.info(
                "tool calls constrained to the schemas of %s (%d-character grammar)",
                sorted(tools),
                len(self.call_grammar),
            )

    def initial_messages(self, question: str) -> list[dict[str, Any]]:
        """System prompt (where `{tools}` becomes the tools' JSON schemas, Hermes style, for chat
        templates without a tools section) and the user's question."""
        msgs = []
        if self.system_prompt:
            tools_json = "\n".join(json.dumps(s) for s in self.schemas or [])
            msgs.append({"role": "system", "content": self.system_prompt.replace("{tools}", tools_json)})
        return msgs + [{"role": "user", "content": question}]

    async def run_group(
        self,
        generate: GenerateBatch,
        question: str,
        ctx: ToolContext,
        n: int,
        should_stop: Callable[[], bool] = lambda: False,
        sampling: dict[str, Any] | None = None,
    ) -> list[Episode]:
        """n episodes of `question`; `sampling` (temperature, top_p) replaces the loop's own for them."""
        sampling = self.sampling if sampling is None else sampling
        messages = self.initial_messages(question)
        prompt_ids = render_prompt(self.tokenizer, messages, tools=self.schemas)
        temperature = sampling.get("temperature", 1.0)
        episodes = [Episode(prompt_ids, messages, temperature) for _ in range(n)]
        for ep in episodes:
            ep.state = State.RUNNING
        # The first turn as one call (the group's identical prompts share a prefill); then each episode
        # goes on at its own pace: a turn waits for its own tool calls, never for another episode's turn.
        await self._turn(generate, episodes, sampling, ctx, should_stop)
        await asyncio.gather(*(self._go_on(generate, ep, sampling, ctx, should_stop) for ep in episodes))
        return episodes

    async def _go_on(self, generate: GenerateBatch, ep: Episode, sampling, ctx, should_stop) -> None:
        while ep.state is State.RUNNING:
            await self._turn(generate, [ep], sampling, ctx, should_stop)

    async def _turn(
        self,
        generate: GenerateBatch,
        running: list[Episode],
        sampling: dict[str, Any],
        ctx: ToolContext,
        should_stop: Callable[[], bool],
    ) -> None:
        """One model turn of each episode in `running` (one call), then the tool calls they made."""
        params = []
        for ep in running:
            room = self.limits.max_total_tokens - len(ep.response_ids)
            turn_room = self.limits.max_new_tokens - (len(ep.response_ids) - ep.turn_start)
            params.append({**sampling, "max_new_tokens": max(1, min(room, turn_room)), **self._phase(ep)})
        results = await generate([ep.prompt_ids + ep.response_ids for ep in running], params)
        tool_work = []
        for ep, res in zip(running, results, strict=True):
            ep.add_model_tokens(res)
            if res.finish_reason == "abort":
                if should_stop():
                    ep.finish("abort")
                continue  # paused by a weight update: resume this turn from its prefix
            if self._call_starts(ep, res):
                continue  # the same turn goes on under the call grammar
            ep.in_call = False
            tool_work.append(self._end_turn(ep, res, ctx))
        await asyncio.gather(*(w for w in tool_work if w is not None))

    def _phase(self, ep: Episode) -> dict[str, Any]:
        """Sampling params of the episode's next request beyond the loop's own: with constrained tool
        calls, free text stops at the start tag; a call in progress is generated under the grammar."""
        if self.call_grammar is None:
            return {}
        if ep.in_call:
            return {"ebnf": self.call_grammar}
        return {"stop": [self.parser.start_tag]}

    def _call_starts(self, ep: Episode, res: GenerateResult) -> bool:
        """Whether `res` stopped at the tool-call start tag with room left in the turn: the episode then
        goes on with the call under the grammar (its tokens, start tag included, are already recorded)."""
        if self.call_grammar is None or ep.in_call or res.finish_reason != "stop":
            return False
        matched = (res.meta_info.get("finish_reason") or {}).get("matched")
        if matched != self.parser.start_tag:
            return False
        turn_used = len(ep.response_ids) - ep.turn_start
        if len(ep.response_ids) >= self.limits.max_total_tokens or turn_used >= self.limits.max_new_tokens:
            return False  # no room for the call: the turn ends here (as `length`)
        ep.in_call = True
        metrics.TOOL_CALLS_CONSTRAINED.inc()
        return True

    def _end_turn(self, ep: Episode, res: GenerateResult, ctx: ToolContext):
        """A model turn finished (stop or length): record it, decide the next state; returns the tool
        coroutine to await when the episode goes TOOL_CALLING, else None."""
        ep.turns += 1
        turn = ep.response_ids[ep.turn_start :]
        stopped = bool(turn) and turn[-1] in self.stop_ids and res.finish_reason == "stop"
        text = self.tokenizer.decode(turn[:-1] if stopped else turn, skip_special_tokens=False)
        ep.final_text = text
        ep.messages.append({"role": "assistant", "content": text})
        parsed: ParseResult = self.parser.parse(text)
        out_of_tokens = len(ep.response_ids) >= self.limits.max_total_tokens
        if not (parsed.calls or parsed.errors):
            ep.finish("stop" if stopped else "length")
            return None
        if not stopped or out_of_tokens:
            ep.finish("length")
            return None
        if ep.turns >= self.limits.max_turns:
            ep.finish("tool_budget")
            return None
        ep.state = State.TOOL_CALLING
        return self._call_tools(ep, parsed, ctx)

    async def _call_tools(self, ep: Episode, parsed: ParseResult, ctx: ToolContext) -> None:
        results = await asyncio.gather(*(self._call_one(c, ctx) for c in parsed.calls))
        results = [ToolResult(text=e, ok=False) for e in parsed.errors] + list(results)
        ep.tool_calls += len(parsed.calls)
        ep.tool_errors += sum(not r.ok for r in results)
        for r in results:
            if r.reward is not None:
                ep.tool_reward = r.reward
        tool_msgs = [{"role": "tool", "content": r.text} for r in results]
        if any(r.done for r in results):
            ep.finish("stop")
            return
        # Close the assistant turn as the template would (e.g. the "\n" after <|im_end|>), then the
        # tool messages and the next generation prompt: all context, loss_mask 0.
        ids = self.turn_suffix + render_delta(
            self.tokenizer, ep.messages, tool_msgs, add_generation_prompt=True
        )
        ep.messages += tool_msgs
        ep.add_context_tokens(ids)
        if len(ep.response_ids) >= self.limits.max_total_tokens:
            ep.finish("length")
            return
        ep.turn_start = len(ep.response_ids)
        ep.state = State.RUNNING

    async def _call_one(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            metrics.TOOL_ERRORS.labels(call.name).inc()
            return ToolResult(
                text=f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}", ok=False
            )
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(tool.call(call.arguments, ctx), self.limits.tool_timeout_s)
        except TimeoutError:
            result = ToolResult(
                text=f"error: {call.name} timed out after {self.limits.tool_timeout_s:g}s", ok=False
            )
        except Exception as e:  # a tool bug must not kill the episode; the model sees the error
            log.exception("tool %s failed", call.name)
            result = ToolResult(text=f"error: {call.name} failed: {type(e).__name__}: {e}", ok=False)
        metrics.TOOL_SECONDS.labels(call.name).observe(time.perf_counter() - t0)
        metrics.TOOL_CALLS.labels(call.name).inc()
        if not result.ok:
            metrics.TOOL_ERRORS.labels(call.name).inc()
        return result


def _turn_suffix(tokenizer) -> list[int]:
    """Tokens the chat template puts after an assistant turn's stop token (ChatML: "\\n")."""
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    ids = render_prompt(tokenizer, msgs, add_generation_prompt=False)
    eos = tokenizer.eos_token_id
    if eos not in ids:
        return []
    last = len(ids) - 1 - ids[::-1].index(eos)
    return ids[last + 1 :]
