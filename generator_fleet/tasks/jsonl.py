"""Question/answer datasets from a .jsonl or .parquet file (GSM8K and anything shaped like it).

Field names are configurable; with `answer_parser="gsm8k"` the gold answer is the text after the last
'####' of the answer field (GSM8K writes its worked solution first). Rewards are end-of-episode checks of
the final assistant text with math-verify (generator_fleet/rewards.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from generator_fleet.rewards import format_reward, math_verify_reward
from generator_fleet.tasks.problem import Problem, ProblemSet, Response

AnswerParser = Literal["gsm8k", "raw"]
GSM8K_MARKER = "####"


def parse_gsm8k_answer(answer: str) -> str:
    """'Natalia sold 48/2 = 24 clips ...\\n#### 72' -> '72'; thousands separators dropped ('1,000' -> '1000')."""
    if GSM8K_MARKER not in answer:
        raise ValueError(f"no {GSM8K_MARKER!r} in the answer")
    gold = answer.rsplit(GSM8K_MARKER, 1)[1].strip()
    if not gold:
        raise ValueError(f"nothing after {GSM8K_MARKER!r} in the answer")
    plain = gold.replace(",", "")
    return plain if _is_number(plain) else gold


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_jsonl(path: Path, fields: list[str], limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for each non-blank line, up to `limit` records."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            for field in fields:
                if record.get(field) is None:
                    raise ValueError(
                        f"{path}:{line_no}: missing field {field!r} (fields there: {sorted(record)})"
                    )
            rows.append((line_no, record))
    return rows


def _read_parquet(path: Path, fields: list[str], limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """(row number from 1, record) for each row, up to `limit` rows."""
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    for field in fields:
        if field not in columns:
            raise ValueError(f"{path}: missing field {field!r} (columns: {columns})")
    table = pq.read_table(path, columns=fields)
    if limit is not None:
        table = table.slice(0, limit)
    rows = []
    for row_no, record in enumerate(table.to_pylist(), start=1):
        for field in fields:
            if record[field] is None:
                raise ValueError(f"{path}: row {row_no}: field {field!r} is null")
        rows.append((row_no, record))
    return rows


class QATask(ProblemSet):
    """Problems read from `path` (.jsonl or .parquet), in a seeded order.

    `limit` keeps the first `limit` records of the file (the same subset for every seed). A problem's
    prompt_id is `<file stem>:<line or row number>`, stable across seeds and limits.
    """

    reward = "qa"

    def __init__(
        self,
        path: str | Path,
        question_field: str = "question",
        answer_field: str = "answer",
        answer_parser: AnswerParser = "gsm8k",
        seed: int = 0,
        limit: int | None = None,
    ) -> None:
        path = Path(path)
        if answer_parser not in ("gsm8k", "raw"):
            raise ValueError(f"unknown answer_parser {answer_parser!r}; use 'gsm8k' or 'raw'")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if not path.is_file():
            raise FileNotFoundError(f"dataset file not found: {path}")
        fields = [question_field, answer_field]
        if path.suffix == ".jsonl":
            rows = _read_jsonl(path, fields, limit)
        elif path.suffix == ".parquet":
            rows = _read_parquet(path, fields, limit)
        else:
            raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
        if not rows:
            raise ValueError(f"{path}: no problems in the dataset")

        where = "row" if path.suffix == ".parquet" else "line"
        self.problems = []
        for n, record in rows:
            answer = str(record[answer_field])
            if answer_parser == "gsm8k":
                try:
                    answer = parse_gsm8k_answer(answer)
                except ValueError as e:
                    raise ValueError(f"{path}: {where} {n}: field {answer_field!r}: {e}") from None
            self.problems.append(Problem(f"{path.stem}:{n}", str(record[question_field]), answer))
        random.Random(seed).shuffle(self.problems)
        self._index()

    @classmethod
    def from_spec(cls, ds) -> QATask:
        if not ds.path:
            raise ValueError("dataset.path is required for dataset.name: jsonl")
        return cls(
            ds.path,
            question_field=ds.question_field,
            answer_field=ds.answer_field,
            answer_parser=ds.answer_parser,
            seed=ds.seed,
        )


def score(problem: Problem, response_text: str, finished_by_eos: bool, format_weight: float = 0.1) -> float:
    """format_weight for an answer in an agreed form ('#### 42', '\\boxed{42}', 'The answer is 42');
    the rest for the right answer per math-verify. A response cut off before its end scores 0."""
    if not finished_by_eos:
        return 0.0
    correct = math_verify_reward(response_text, str(problem.answer))
    return format_weight * format_reward(response_text) + (1.0 - format_weight) * correct


def reward(problem: Problem, response: Response, format_weight: float) -> float:
    """The registered reward `qa`: `score` of the response."""
    return score(problem, response.text, response.finished, format_weight)
