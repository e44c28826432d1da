"""The record every task hands out: one prompt, its gold answer and (for generated tasks) how to solve it."""

from __future__ import annotations

import random

import msgspec


class Problem(msgspec.Struct, frozen=True):
    prompt_id: str
    """Stable across runs and seeds: recycled prompts are looked up again with `task.get(prompt_id)`."""
    prompt: str
    """The question as shown to the model (the user turn, or the raw prompt for single-turn tasks)."""
    answer: int | str
    """Gold answer: the exact sum (int) for `arith`; the answer as written (str) for text datasets."""
    expression: str | None = None
    """A calculator expression that evaluates to `answer` (generated word problems; for SFT warm-ups)."""


class Response(msgspec.Struct, frozen=True, kw_only=True):
    """What a reward scores: the model's answer to one problem (tasks/__init__.py: REWARDS)."""

    text: str
    """The response without its end-of-sequence token; the last assistant turn's content in an agent
    episode."""
    finished: bool
    """The model ended it itself (EOS, or an agent episode that finished with `stop`), not a limit."""
    tool_reward: float | None = None
    """The reward a tool set during an agent episode (check_answer), if any."""


class ProblemSet:
    """What every task shares: an ordered list of problems, lookup by id (recycled prompts), sampling.
    Subclasses fill `self.problems`, call `_index()`, and name their own reward in `reward`."""

    problems: list[Problem]
    reward: str
    """The registered reward (tasks/__init__.py: REWARDS) used when the job spec's `reward.name` is unset."""

    def _index(self) -> None:
        self._by_id = {p.prompt_id: p for p in self.problems}

    def __len__(self) -> int:
        return len(self.problems)

    def get(self, prompt_id: str) -> Problem:
        return self._by_id[prompt_id]

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)
