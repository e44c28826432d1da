"""Generated arithmetic task `a+b=` -> `c<eos>`, with a correctness + format reward.

Small enough for a tiny model on CPU, and the reward is reachable by sampling once a short SFT warm-up
on noisy answers (model_zoo/tiny.py) has taught the format: RL then has a real signal to sharpen.
"""

from __future__ import annotations

import random
import re

from generator_fleet.tasks.problem import Problem, ProblemSet, Response

__all__ = ["ALPHABET", "ArithTask", "Problem", "reward", "score"]

ALPHABET = "0123456789+="
_ANSWER = re.compile(r"^\d{1,4}$")


class ArithTask(ProblemSet):
    """All problems a+b with 0 <= a, b <= max_operand, in a seeded order."""

    reward = "arith"

    def __init__(self, max_operand: int = 19, seed: int = 0) -> None:
        self.problems = [
            Problem(f"{a}+{b}", f"{a}+{b}=", a + b)
            for a in range(max_operand + 1)
            for b in range(max_operand + 1)
        ]
        random.Random(seed).shuffle(self.problems)
        self._index()

    @classmethod
    def from_spec(cls, ds) -> ArithTask:
        return cls(max_operand=ds.max_operand, seed=ds.seed)


def score(problem: Problem, response_text: str, finished_by_eos: bool, format_weight: float = 0.1) -> float:
    """format_weight for a bare number ended by EOS; the rest for the right number."""
    text = response_text.strip()
    well_formed = finished_by_eos and bool(_ANSWER.match(text))
    correct = well_formed and int(text) == problem.answer
    return format_weight * well_formed + (1.0 - format_weight) * correct


def reward(problem: Problem, response: Response, format_weight: float) -> float:
    """The registered reward `arith`: `score` of the response."""
    return score(problem, response.text, response.finished, format_weight)
