"""A tool the model calls to submit its answer; it scores the episode, like verl's calc_gsm8k_reward.

The reply tells the model only "Correct." or "Incorrect."; the score goes in `ToolResult.reward`.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from generator_fleet.tools.base import ToolContext, ToolResult

_NUMBER_NOISE = str.maketrans("", "", ",$ \t\n")


def parse_number(text: str) -> Fraction | None:
    """'$1,234.50' -> 2469/2, '1/2' -> 1/2, '1e3' -> 1000; None when it is not a number.

    Fractions compare exactly, so '0.5', '1/2' and '.50' are the same answer.
    """
    cleaned = text.translate(_NUMBER_NOISE)
    if not cleaned:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(given: str, reference: str) -> bool:
    """Numeric comparison when both sides are numbers, else case-insensitive text comparison."""
    given_number, reference_number = parse_number(given), parse_number(reference)
    if given_number is not None and reference_number is not None:
        return given_number == reference_number
    return " ".join(given.split()).casefold() == " ".join(reference.split()).casefold()


class CheckAnswer:
    """Rewards: `correct_reward` for the right answer; `format_reward` for a wrong answer that is well
    formed (a number when the reference is a number, any non-empty text otherwise: verl's
    `format_score`); `wrong_reward` for anything else."""

    name = "check_answer"

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, format_reward: float = 0.0):
        self.correct_reward = correct_reward
        self.wrong_reward = wrong_reward
        self.format_reward = format_reward

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Submit your final answer to the problem; replies Correct. or Incorrect.",
                "parameters": {
                    "type": "object",
                    "properties": {"answer": {"type": "string", "description": "The final answer."}},
                    "required": ["answer"],
                },
            },
        }

    async def call(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        answer = arguments.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            return ToolResult(text="error: argument 'answer' must be a string or a number", ok=False)
        if ctx.answer is None:
            return ToolResult(text="error: this problem has no reference answer", ok=False)
        given = str(answer)  # str(0.5) == '0.5': shortest repr, so parse_number sees what the model wrote
        if answers_match(given, ctx.answer):
            return ToolResult(text="Correct.", reward=self.correct_reward)
        reference_is_number = parse_number(ctx.answer) is not None
        well_formed = parse_number(given) is not None if reference_is_number else bool(given.strip())
        return ToolResult(text="Incorrect.", reward=self.format_reward if well_formed else self.wrong_reward)
