"""Tasks (prompt sources) and the rewards that score their responses, each chosen by name in the job spec.

`dataset.name` and `reward.name` are a registered name (`TASKS`, `REWARDS`) or any callable named by
import path, `package.module:attr`, like custom tools. Both are resolved once per process
(`build_task`, `build_reward`) and checked at spec validation (`check_name`) and at submit
(`check_import_paths`), so a typo fails before any process starts.

A task is built as `factory(dataset_spec)` and has `.problems`, `.get(prompt_id)`, `.sample(rng)` and
`.reward`, the name of the reward used when the spec sets none (tasks/problem.py: ProblemSet). A reward
is called as `reward(problem, response, format_weight) -> float` (tasks/problem.py: Response).

Adding a task: a module in this folder and its line in `TASKS` (or name it by import path in the spec).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TASKS: dict[str, str] = {
    "arith": "generator_fleet.tasks.arith:ArithTask.from_spec",
    "word_problems": "generator_fleet.tasks.word_problems:WordProblemTask.from_spec",
    "jsonl": "generator_fleet.tasks.jsonl:QATask.from_spec",
}
"""Registered task name -> the `module:attr` of its factory (imported only when the task is built)."""

REWARDS: dict[str, str] = {
    "arith": "generator_fleet.tasks.arith:reward",
    "qa": "generator_fleet.tasks.jsonl:reward",
    "math_verify": "generator_fleet.rewards:math_verify_score",
    "number": "generator_fleet.rewards:stated_number_score",
    "tool": "generator_fleet.rewards:tool_score",
}
"""Registered reward name -> the `module:attr` of the reward function.
`arith`: the exact sum of the arith task, `format_weight` for a bare number ended by EOS;
`qa`: math-verify correctness plus `format_weight` for an agreed answer form, 0 for a response cut
off before its end (the default of `jsonl` and `word_problems`);
`math_verify`: math-verify correctness plus the format share, also for a response cut off;
`number`: the stated final answer (`The answer is <n>`, `#### <n>`) must be the right plain number, not an
expression that evaluates to it, plus the format share;
`tool`: the reward a tool set during the episode (check_answer), 0 if none."""


def check_name(kind: str, name: str, registry: dict[str, str]) -> str | None:
    """Why `name` cannot name a `kind` ("task", "reward") of `registry`, else None; imports nothing."""
    if name in registry:
        return None
    module, sep, attr = name.partition(":")
    if sep and all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        return None
    return f"unknown {kind} {name!r}: registered are {', '.join(sorted(registry))}, or 'package.module:attr'"


def check_import_paths(
    dataset_name: str,
    reward_name: str | None,
    allowed: Sequence[str] | None,
    path: Sequence[str] | None = None,
    eval_dataset_name: str | None = None,
) -> str | None:
    """The first problem of a task or reward named by import path, as "message - at `$.key`", else None:
    the module must be allowed (the operator's allow-list of custom tools) and its source and the named
    attribute must be found (read, not run). `eval_dataset_name`: the task of `eval.dataset`, if any."""
    from generator_fleet.tools.impl_check import check_callable

    checks = [("dataset.name", dataset_name, TASKS), ("reward.name", reward_name, REWARDS)]
    if eval_dataset_name is not None:
        checks.append(("eval.dataset.name", eval_dataset_name, TASKS))
    for key, name, registry in checks:
        if name is not None and name not in registry and (why := check_callable(name, allowed, path)):
            return f"{why} - at `$.{key}`"
    return None


def _load(kind: str, name: str, registry: dict[str, str]) -> Any:
    """The object `name` stands for: a registered one, or one imported by path (allow-list applies)."""
    from generator_fleet.tools.impl_check import allowed_from_env, import_path, module_allowed, not_allowed

    if why := check_name(kind, name, registry):
        raise ValueError(why)
    target = registry.get(name)
    if target is None:
        allowed = allowed_from_env()
        if not module_allowed(name.partition(":")[0], allowed):
            raise ValueError(f"{kind} {name!r}: {not_allowed(name.partition(':')[0], allowed or [])}")
        target = name
    obj = import_path(f"{kind} {name!r}", target)
    if not callable(obj):
        raise ValueError(f"{kind} {name!r}: {target!r} is not callable")
    return obj


def build_task(ds) -> Any:
    """The task the job spec's `dataset` section names, built from that section."""
    return _load("task", ds.name, TASKS)(ds)


def build_reward(rs, task) -> Callable[[Any, Any], float]:
    """`reward(problem, response) -> float` for the job spec's `reward` section: `reward.name`, or the
    task's own reward when it names none; `reward.format_weight` bound."""
    name = rs.name if rs.name is not None else getattr(task, "reward", None)
    if name is None:
        raise ValueError(f"task {type(task).__name__} names no reward of its own: set reward.name")
    fn = _load("reward", name, REWARDS)
    weight = rs.format_weight

    def reward(problem, response) -> float:
        return float(fn(problem, response, weight))

    reward.__qualname__ = f"reward[{name}]"
    return reward
