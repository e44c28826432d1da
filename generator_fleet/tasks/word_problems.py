"""Generated arithmetic word problems whose numbers are too big to multiply in one's head: a task where
calling the calculator tool pays.

Each problem carries the calculator expression that solves it (`Problem.expression`), from which SFT
warm-up transcripts are built (model_zoo/tiny_tools.py). Rewards are math-verify checks of the final
assistant text, like any QA dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

import msgspec

from generator_fleet.tasks.problem import Problem, ProblemSet

Difficulty = Literal["easy", "medium", "hard"]

NAMES = [("Maria", "she"), ("Ahmed", "he"), ("Lena", "she"), ("Tom", "he"), ("Priya", "she"), ("Kenji", "he")]
ITEMS = ["apples", "pencils", "marbles", "cookies", "stickers", "books", "bolts", "bottles"]
MAX_TRIES_PER_PROBLEM = 100
"""Draws allowed to find a prompt not generated already, before giving up (num_problems too large)."""


class Ranges(msgspec.Struct, frozen=True):
    big: tuple[int, int]
    """Inclusive range of the first factor (e.g. crates)."""
    small: tuple[int, int]
    """Inclusive range of the second factor (e.g. apples per crate)."""
    days: tuple[int, int] = (3, 12)
    """Inclusive range of the third factor of three-step problems."""


class _Draw:
    """Random numbers and names for one problem."""

    def __init__(self, rng: random.Random, ranges: Ranges) -> None:
        self.rng = rng
        self.ranges = ranges
        self.name, self.pronoun = rng.choice(NAMES)
        self.item = rng.choice(ITEMS)

    def big(self) -> int:
        return self.rng.randint(*self.ranges.big)

    def small(self) -> int:
        return self.rng.randint(*self.ranges.small)

    def part_of(self, n: int) -> int:
        """A number to take away from n that leaves at least half of it (no trivially small answers)."""
        return self.rng.randint(min(11, n // 2), n // 2)


# Each template returns (prompt, calculator expression, answer).
Template = Callable[[_Draw], tuple[str, str, int]]


def _crates(d: _Draw):
    a, b = d.big(), d.small()
    return (
        f"{d.name} has {a} crates with {b} {d.item} each. How many {d.item} does {d.pronoun} have?",
        f"{a} * {b}",
        a * b,
    )


def _theater(d: _Draw):
    a, b = d.big(), d.small()
    return f"A theater has {a} rows of {b} seats. How many seats are there in total?", f"{a} * {b}", a * b


def _factory(d: _Draw):
    a, b = d.big(), d.small()
    return (
        f"A factory makes {a} {d.item} every hour. How many {d.item} does it make in {b} hours?",
        f"{a} * {b}",
        a * b,
    )


def _share(d: _Draw):
    a, b = d.big(), d.small()
    return (
        f"{a * b} {d.item} are packed equally into {b} boxes. How many {d.item} go in each box?",
        f"{a * b} / {b}",
        a,
    )


def _buy_give(d: _Draw):
    a, b = d.big(), d.small()
    c = d.part_of(a * b)
    return (
        f"{d.name} buys {a} boxes of {b} {d.item} and gives away {c} {d.item}. "
        f"How many {d.item} does {d.pronoun} have left?",
        f"{a} * {b} - {c}",
        a * b - c,
    )


def _school(d: _Draw):
    a, b, c = d.big(), d.small(), d.big()
    return (
        f"A school has {a} classes with {b} students each. Then {c} new students join. "
        "How many students are there now?",
        f"{a} * {b} + {c}",
        a * b + c,
    )


def _has_buys(d: _Draw):
    a, b, c = d.big(), d.small(), d.big()
    return (
        f"{d.name} has {c} {d.item}. {d.pronoun.capitalize()} buys {a} packs of {b} {d.item}. "
        f"How many {d.item} does {d.pronoun} have now?",
        f"{c} + {a} * {b}",
        c + a * b,
    )


def _share_sell(d: _Draw):
    a, b = d.big(), d.small()
    c = d.part_of(a)
    return (
        f"{a * b} {d.item} are shared equally among {b} shops, and each shop sells {c} of them. "
        f"How many {d.item} does each shop have left?",
        f"{a * b} / {b} - {c}",
        a - c,
    )


def _warehouse(d: _Draw):
    a, b, n = d.big(), d.small(), d.rng.randint(*d.ranges.days)
    c = d.part_of(a * b * n)
    return (
        f"A warehouse receives {a} boxes of {b} {d.item} every day for {n} days, then ships out {c} {d.item}. "
        f"How many {d.item} are left?",
        f"{a} * {b} * {n} - {c}",
        a * b * n - c,
    )


def _tickets(d: _Draw):
    a, p, c, q = d.big(), d.small(), d.big(), d.small()
    return (
        f"Adult tickets cost {p} dollars and child tickets cost {q} dollars. A group buys {a} adult "
        f"tickets and {c} child tickets. How many dollars do they pay in total?",
        f"{a} * {p} + {c} * {q}",
        a * p + c * q,
    )


def _packing(d: _Draw):
    a, b, c, e = d.big(), d.small(), d.big(), d.small()
    return (
        f"{d.name} packs {a} boxes with {b} {d.item} each and {c} bags with {e} {d.item} each. "
        f"How many {d.item} does {d.pronoun} pack?",
        f"{a} * {b} + {c} * {e}",
        a * b + c * e,
    )


ONE_STEP: list[Template] = [_crates, _theater, _factory, _share]
TWO_STEP: list[Template] = [_buy_give, _school, _has_buys, _share_sell]
THREE_STEP: list[Template] = [_warehouse, _tickets, _packing]

LEVELS: dict[str, tuple[list[Template], Ranges]] = {
    "easy": (ONE_STEP, Ranges(big=(12, 99), small=(12, 99))),
    "medium": (ONE_STEP + TWO_STEP, Ranges(big=(101, 999), small=(11, 99))),
    "hard": (TWO_STEP + THREE_STEP, Ranges(big=(101, 999), small=(11, 99))),
}
"""easy: one step, 2-digit x 2-digit; medium: one or two steps, 3-digit x 2-digit; hard: two or three."""


class WordProblemTask(ProblemSet):
    """`num_problems` distinct word problems, the same for the same (seed, difficulty)."""

    reward = "qa"

    def __init__(self, num_problems: int = 1000, seed: int = 0, difficulty: Difficulty = "medium") -> None:
        if difficulty not in LEVELS:
            raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(LEVELS)}")
        if num_problems < 1:
            raise ValueError(f"num_problems must be >= 1, got {num_problems}")
        templates, ranges = LEVELS[difficulty]
        rng = random.Random(f"word_problems:{difficulty}:{seed}")
        self.problems: list[Problem] = []
        seen: set[str] = set()
        for i in range(num_problems):
            for _ in range(MAX_TRIES_PER_PROBLEM):
                prompt, expression, answer = rng.choice(templates)(_Draw(rng, ranges))
                if prompt not in seen:
                    break
            else:
                raise ValueError(f"could not generate {num_problems} distinct {difficulty} problems")
            seen.add(prompt)
            self.problems.append(Problem(f"wp-{seed}-{i}", prompt, str(answer), expression=expression))
        self._index()

    @classmethod
    def from_spec(cls, ds) -> WordProblemTask:
        return cls(num_problems=ds.num_problems, seed=ds.seed, difficulty=ds.difficulty)
