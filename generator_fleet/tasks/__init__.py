"""Prompt sources (datasets) and their rewards, built from the job spec's `dataset` section."""

from __future__ import annotations

from generator_fleet.tasks.arith import ArithTask


def build_task(ds):
    """The task a DatasetSpec names; each has .problems, .get(prompt_id), .sample(rng), .score(...)."""
    if ds.name == "arith":
        return ArithTask(max_operand=ds.max_operand, seed=ds.seed)
    if ds.name == "word_problems":
        from generator_fleet.tasks.word_problems import WordProblemTask

        return WordProblemTask(num_problems=ds.num_problems, seed=ds.seed, difficulty=ds.difficulty)
    if ds.name == "jsonl":
        from generator_fleet.tasks.jsonl import QATask

        if not ds.path:
            raise ValueError("dataset.path is required for dataset.name: jsonl")
        return QATask(
            ds.path,
            question_field=ds.question_field,
            answer_field=ds.answer_field,
            answer_parser=ds.answer_parser,
            seed=ds.seed,
        )
    raise ValueError(f"unknown dataset {ds.name!r}")


__all__ = ["ArithTask", "build_task"]
