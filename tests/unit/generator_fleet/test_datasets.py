"""Prompt sources: GSM8K-style files (.jsonl, .parquet) with their errors, and the generated word
problems (deterministic, distinct, each solved by its own calculator expression)."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobspec
from generator_fleet.tasks import build_reward
from generator_fleet.tasks.arith import ArithTask
from generator_fleet.tasks.jsonl import QATask, parse_gsm8k_answer
from generator_fleet.tasks.problem import Problem, Response
from generator_fleet.tasks.word_problems import WordProblemTask
from generator_fleet.tools.base import ToolContext
from generator_fleet.tools.calculator import Calculator

GSM8K_ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72",
    },
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "12/60*50 = 10\n#### 10"},
    {"question": "A tank holds 1,250 liters...", "answer": "so 1,250 liters\n#### 1,250"},
]


def own_reward(task, problem, text, finished):
    """The task's own reward (a job spec that names none), at format_weight 0.1."""
    return build_reward(jobspec.RewardSpec(), task)(problem, Response(text=text, finished=finished))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_jsonl_round_trip(tmp_path):
    task = QATask(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert len(task) == 3
    by_question = {p.prompt: p for p in task.problems}
    assert [by_question[r["question"]].answer for r in GSM8K_ROWS] == ["72", "10", "1250"]
    assert task.get("gsm8k:2").answer == "10"
    assert task.sample(random.Random(0)) in task.problems


def test_custom_fields_parquet_and_raw_answers(tmp_path):
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2*3?"], "solution": ["2", "6"], "extra": [1, 2]}), path)
    task = QATask(path, question_field="problem", answer_field="solution", answer_parser="raw")
    assert sorted((p.prompt, p.answer, p.prompt_id) for p in task.problems) == [
        ("1+1?", "2", "mine:1"),
        ("2*3?", "6", "mine:2"),
    ]


def test_jsonl_and_parquet_give_the_same_problems(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), tmp_path / "d.parquet")
    assert QATask(tmp_path / "d.jsonl", seed=3).problems == QATask(tmp_path / "d.parquet", seed=3).problems


def test_seed_orders_and_limit_keeps_the_first_records(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    a, b, c = QATask(path, seed=0), QATask(path, seed=0), QATask(path, seed=1)
    assert a.problems == b.problems and a.problems != c.problems
    assert sorted(p.prompt for p in QATask(path, limit=5).problems) == [f"q{i}" for i in range(5)]


def test_gsm8k_answer_parser():
    assert parse_gsm8k_answer("work\n####  -3.5 ") == "-3.5"
    assert parse_gsm8k_answer("#### 1,000,000") == "1000000"
    assert parse_gsm8k_answer("a #### b #### 7") == "7"
    with pytest.raises(ValueError, match="no '####'"):
        parse_gsm8k_answer("42")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        QATask(tmp_path / "nope.jsonl")


def test_missing_field_names_field_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:3: missing field 'answer'"):
        QATask(path)
    with pytest.raises(ValueError, match=r"d.jsonl:1: missing field 'prompt'"):
        QATask(path, question_field="prompt")


def test_missing_parquet_column_and_bad_gsm8k_answer(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 1", "two"]}), path)
    with pytest.raises(ValueError, match=r"missing field 'solution' \(columns: \['question', 'answer'\]\)"):
        QATask(path, answer_field="solution")
    with pytest.raises(ValueError, match=r"row 2: field 'answer': no '####'"):
        QATask(path)


def test_empty_dataset_bad_json_and_unknown_suffix(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no problems"):
        QATask(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        QATask(tmp_path / "bad.jsonl")
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        QATask(tmp_path / "d.csv")


def test_qa_score_pays_format_and_correctness(tmp_path):
    task = QATask(write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS))
    p = task.get("d:1")
    assert own_reward(task, p, "24 + 48 = 72. The answer is 72.", True) == pytest.approx(1.0)
    assert own_reward(task, p, "The answer is 70.", True) == pytest.approx(0.1)
    assert own_reward(task, p, "it is 72", True) == pytest.approx(0.9)
    assert own_reward(task, p, "The answer is 72.", False) == 0.0


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_word_problems_are_deterministic_distinct_and_solved_by_their_expression(difficulty):
    task = WordProblemTask(num_problems=300, seed=7, difficulty=difficulty)
    assert task.problems == WordProblemTask(num_problems=300, seed=7, difficulty=difficulty).problems
    assert task.problems != WordProblemTask(num_problems=300, seed=8, difficulty=difficulty).problems
    assert len(task) == 300 and len({p.prompt for p in task.problems}) == 300
    calculator = Calculator()
    for p in task.problems:
        result = asyncio.run(
            calculator.call({"expression": p.expression}, ToolContext(prompt_id=p.prompt_id))
        )
        assert result.ok and result.text == p.answer, p
        assert int(p.answer) > 0
        assert task.get(p.prompt_id) is p


def test_word_problems_need_a_calculator():
    """Default difficulty: every problem multiplies or divides a 3-digit-or-more number by a 2-digit one."""
    task = WordProblemTask(num_problems=500, seed=0)
    for p in task.problems:
        a, b = map(int, re.search(r"(\d+) [*/] (\d+)", p.expression).groups())
        assert max(a, b) >= 100 and min(a, b) >= 11, p
    assert sum(int(p.answer) >= 1000 for p in task.problems) / len(task) > 0.6
    assert any(" - " in p.expression for p in task.problems)  # multi-step variants are in the mix
    assert any(" + " in p.expression for p in task.problems)
    with pytest.raises(ValueError, match="unknown difficulty"):
        WordProblemTask(difficulty="impossible")


def test_arith_task_still_uses_int_answers():
    task = ArithTask(max_operand=3)
    p = task.get("2+3")
    assert isinstance(p, Problem) and p.answer == 5 and p.expression is None
    assert own_reward(task, p, "5", True) == pytest.approx(1.0)
