"""Learning-rate schedule: linear warmup, then constant / cosine / linear decay to a floor, per optimizer step.

`lr_factor(step, ...)` is a pure function of the optimizer step index (0 for the first step): the
multiplier of the configured lr for that step. The learner sets each optimizer's lr to base * factor
right before its step (as torch's LambdaLR would, without LambdaLR's own step counter), and the number
of steps taken lives in the checkpoint (trainer_state.json `lr_step`), so a resumed job continues the
schedule where it stopped, whatever the number of ranks.

    warmup (step < W):  (step + 1) / W               (the first step already learns; verl/HF start at 0)
    constant:           1
    cosine:             m + (1 - m) * (1 + cos(pi * p)) / 2,   p = (step - W) / max(1, total - W)
    linear:             m + (1 - m) * (1 - p)

m = min_lr_ratio, total = algorithm.total_steps. The decay formulas are verl's
get_cosine_schedule_with_warmup (num_cycles 0.5) and AReaL's linear schedule; past `total` the factor
stays at the floor.
"""

from __future__ import annotations

import math

from trainer.config import SCHEDULES


def lr_factor(
    step: int, total_steps: int, schedule: str, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
