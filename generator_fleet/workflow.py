"""How a rollout worker turns one prompt into a scored group: the `Workflow` protocol and its two
implementations, chosen once per worker from the job spec (`build_workflow`).

`SingleTurn`: G samples of one model turn each. `AgentEpisodes`: G multi-turn, tool-using episodes
(generator_fleet/agent/loop.py). Both score every response with the one reward the spec resolves to
(generator_fleet/tasks/__init__.py: `build_reward`).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from generator_fleet import metrics
from generator_fleet.agent.loop import Episode, GenerateBatch
from generator_fleet.tasks.problem import Problem, Response
from generator_fleet.tools.base import ToolContext
from replay_buffer import Sample

if TYPE_CHECKING:
    from generator_fleet.config import RolloutConfig


class Workflow(Protocol):
    async def run(
        self, problem: Problem, generate: GenerateBatch, should_stop: Callable[[], bool]
    ) -> list[Sample]:
        """The group of one prompt: its samples, each with its reward. `generate` is one batched
        /generate (the worker's engine pool, with retries); `should_stop` is true once the worker stops."""
        ...


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens with budget `max_len` and buffer
    `buffer_len` (tokens): 0 up to max_len - buffer_len, then falling linearly to -factor at max_len,
    -factor beyond. `buffer_len` 0: no penalty."""
    if buffer_len <= 0:
        return 0.0
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    if length <= max_len:
        return factor * (start - length) / buffer_len
    return -factor


@dataclass(frozen=True)
class Shaping:
    """What the rollout config does to each sample after scoring: the overlong penalty (added to the
    reward) and overlong filtering (a `length`-finished response gets loss_mask all zeros)."""

    max_len: int = 0
    buffer_len: int = 0
    penalty_factor: float = 1.0
    filter_overlong: bool = False

    def reward(self, reward: float, length: int) -> float:
        return reward + overlong_penalty(length, self.max_len, self.buffer_len, self.penalty_factor)


NO_SHAPING = Shaping()


def _sample(
    prompt_ids, ids, mask, logprobs, versions, reward, finish_reason, shaping=NO_SHAPING, **stats
) -> Sample:
    reward = shaping.reward(reward, len(ids))
    if shaping.filter_overlong and finish_reason == "length":
        mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
    metrics.TOKENS.inc(sum(mask))
    metrics.REWARD.observe(reward)
    return Sample.build(
        prompt_ids=prompt_ids,
        response_ids=ids,
        loss_mask=mask,
        behavior_logprobs=logprobs,
        token_versions=versions,
        reward=reward,
        finish_reason=finish_reason,
        **stats,
    )


class SingleTurn:
    """All G samples of one prompt through one batched /generate per round. Samples aborted by a pause
    are resumed from their token prefix in the next round."""

    def __init__(
        self,
        tokenizer,
        sampling,
        group_size: int,
        reward: Callable[[Problem, Response], float],
        shaping: Shaping = NO_SHAPING,
    ):
        self.tokenizer, self.sampling, self.group_size, self.reward = tokenizer, sampling, group_size, reward
        self.shaping = shaping

    async def run(
        self, problem: Problem, generate: GenerateBatch, should_stop: Callable[[], bool]
    ) -> list[Sample]:
        sp, g = self.sampling, self.group_size
        prompt_ids = [self.tokenizer.bos_token_id] + self.tokenizer.encode(problem.prompt)
        ids: list[list[int]] = [[] for _ in range(g)]
        logprobs: list[list[float]] = [[] for _ in range(g)]
        versions: list[list[int]] = [[] for _ in range(g)]
        finish: list[str | None] = [None] * g
        while todo := [i for i in range(g) if finish[i] is None]:
            params = [
                {
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "max_new_tokens": sp.max_new_tokens - len(ids[i]),
                    **({"ignore_eos": True} if sp.ignore_eos else {}),
                }
                for i in todo
            ]
            results = await generate([prompt_ids + ids[i] for i in todo], params)
            for i, res in zip(todo, results, strict=True):
                ids[i] += res.output_ids
                logprobs[i] += res.output_logprobs
                versions[i] += res.token_versions
                # Aborted by a pause: resume from the prefix (tokens so far keep their versions/logprobs).
                if res.finish_reason == "abort" and len(ids[i]) < sp.max_new_tokens and not should_stop():
                    metrics.RESUMED.inc()
                    continue
                finish[i] = res.finish_reason if res.finish_reason in ("stop", "length") else "abort"
        eos = self.tokenizer.eos_token_id
        out = []
        for i in range(g):
            finished_by_eos = bool(ids[i]) and ids[i][-1] == eos and finish[i] == "stop"
            text = self.tokenizer.decode(ids[i][:-1] if finished_by_eos else ids[i])
            reward = self.reward(problem, Response(text=text, finished=finished_by_eos))
            out.append(
                _sample(
                    prompt_ids,
                    ids[i],
                    [1] * len(ids[i]),
                    logprobs[i],
                    versions[i],
                    reward,
                    finish[i],
                    self.shaping,
                    temperature=sp.temperature,
                    prompt_len=len(prompt_ids),
                )
            )
        return out


class AgentEpisodes:
    """G multi-turn tool-using episodes (generator_fleet/agent/loop.py), each in its own
    working directory for the tools; the reward scores the last assistant turn."""

    def __init__(
        self,
        agent,
        group_size: int,
        reward: Callable[[Problem, Response], float],
        shaping: Shaping = NO_SHAPING,
    ):
        self.agent, self.group_size, self.reward, self.shaping = agent, group_size, reward, shaping

    async def run(
        self, problem: Problem, generate: GenerateBatch, should_stop: Callable[[], bool]
    ) -> list[Sample]:
        out = []
        for ep, reward in await self.episodes(problem, generate, should_stop):
            metrics.TURNS.observe(ep.turns)
            out.append(
                _sample(
                    ep.prompt_ids,
                    ep.response_ids,
                    ep.loss_mask,
                    ep.logprobs,
                    ep.versions,
                    reward,
                    ep.finish_reason,
                    self.shaping,
                    num_turns=ep.turns,
                    tool_calls=ep.tool_calls,
                    tool_errors=ep.tool_errors,
                    temperature=ep.temperature,
                    prompt_len=ep.prompt_len,
                )
            )
        return out

    async def episodes(
        self,
        problem: Problem,
        generate: GenerateBatch,
        should_stop: Callable[[], bool],
        n: int | None = None,
        sampling: dict | None = None,
    ) -> list[tuple[Episode, float]]:
        """The episodes of one prompt (`n`, default the group size) with each one's reward as the job's
        reward scores it (unshaped); `sampling` (temperature, top_p) replaces the agent's. No rollout
        metrics: the evaluator runs episodes through here too."""
        with tempfile.TemporaryDirectory(prefix="slipstream-episode-") as workdir:
            ctx = ToolContext(prompt_id=problem.prompt_id, answer=str(problem.answer), workdir=workdir)
            episodes = await self.agent.run_group(
                generate,
                problem.prompt,
                ctx,
                n or self.group_size,
                should_stop=should_stop,
                sampling=sampling,
            )
        out = []
        for ep in episodes:
            response = Response(
                text=ep.final_text, finished=ep.finish_reason == "stop", tool_reward=ep.tool_reward
            )
            reward = await asyncio.to_thread(self.reward, problem, response)  # math-verify: CPU, may be slow
            out.append((ep, reward))
        return out


def build_workflow(config: RolloutConfig, tokenizer, task) -> Workflow:
    """The workflow the rollout config asks for (`agent:` set: agent episodes, else single turn), with
    the reward it names resolved once."""
    from generator_fleet.tasks import build_reward

    reward = build_reward(config.reward, task)
    sampling = config.rollout.sampling
    shaping = Shaping(
        max_len=config.response_budget or sampling.max_new_tokens,
        buffer_len=config.reward.overlong_buffer_len,
        penalty_factor=config.reward.overlong_penalty_factor,
        filter_overlong=config.rollout.overlong_filter,
    )
    if config.agent is not None:
        from generator_fleet.agent import build_agent

        agent = build_agent(config.agent, config.tools, sampling, tokenizer)
        return AgentEpisodes(agent, config.rollout.group_size, reward, shaping)
    return SingleTurn(tokenizer, sampling, config.rollout.group_size, reward, shaping)
