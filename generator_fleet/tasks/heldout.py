"""The held-out split of a task: evaluation's problems (generator_fleet/evaluation.py) and the rest, which
rollouts sample (`training_task`). Chosen by a seeded hash of the prompt ids, so every process computes the
same split whatever order the task lists its problems in."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from generator_fleet.tasks.problem import Problem

if TYPE_CHECKING:
    from generator_fleet.config import EvalSpec

log = logging.getLogger(__name__)


def _rank(seed: int, prompt_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()


def split_heldout(problems: Sequence[Problem], n: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(training problems in their order, `n` held-out problems): the n whose seeded hash of the prompt id
    is smallest. Deterministic and independent of the problems' order; the two parts are disjoint.
    ValueError (naming `$.eval.heldout`) when n leaves nothing to train on."""
    if n >= len(problems):
        raise ValueError(
            f"{n} held-out problems leave none of the dataset's {len(problems)} to train on - at `$.eval.heldout`"
        )
    held = sorted(problems, key=lambda p: _rank(seed, p.prompt_id))[:n]
    ids = {p.prompt_id for p in held}
    return [p for p in problems if p.prompt_id not in ids], held


def training_task(task, ev: EvalSpec | None):
    """`task` without the held-out problems of `ev` (in place; `task` returned): what rollouts sample."""
    if ev is None or ev.dataset is not None or ev.heldout == 0:
        return task
    train, held = split_heldout(task.problems, ev.heldout, ev.seed)
    task.problems = train
    task._index()
    log.info("%d problems held out for evaluation; rollouts sample the other %d", len(held), len(train))
    return task
