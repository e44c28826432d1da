"""The record every task hands out: one prompt, its gold answer and (for generated tasks) how to solve it."""

from __future__ import annotations

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
