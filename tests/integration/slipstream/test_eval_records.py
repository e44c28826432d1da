"""Eval records (`kind: "eval"`) beside the trainer's in a job's progress stream: the reader keeps them
apart, a resumed trainer's truncation drops the ones of lost versions, `slipstream status` shows the last,
and the end-of-job report plots them."""

import json

from rich.console import Console

from replay_buffer import ReplayBuffer
from slipstream.cli.jobs import render_status
from slipstream.job.progress import ProgressReader, format_progress
from slipstream.job.report import write_report


def _step(r, keys, version, elapsed):
    rec = {"version": version, "elapsed_s": elapsed, "samples": 4, "response_tokens": 8, "reward_mean": 0.5}
    r.xadd(keys.progress, {"j": json.dumps(rec)})


def _eval(r, keys, version, accuracy):
    rec = {"kind": "eval", "version": version, "elapsed_s": 1.0, "attempt": 1,
           "eval": {"accuracy": accuracy, "pass@4": 0.75, "duration_s": 2.5}}  # fmt: skip
    r.xadd(keys.progress, {"j": json.dumps(rec)})


def test_reader_keeps_evals_apart_and_truncation_drops_lost_ones(redis_client, job_id):
    buf = ReplayBuffer(redis_client, job_id)
    keys = buf.keys
    _eval(redis_client, keys, 0, 0.25)
    for v in (1, 2, 3):
        _step(redis_client, keys, v, float(v))
    _eval(redis_client, keys, 2, 0.5)  # evaluations trail the steps
    _step(redis_client, keys, 4, 4.0)
    _eval(redis_client, keys, 4, 0.625)
    reader = ProgressReader(redis_client, job_id)
    steps = reader.read(block_ms=0)
    assert [r["version"] for r in steps] == [1, 2, 3, 4] and reader.records == steps
    assert [e["version"] for e in reader.evals] == [0, 2, 4] == [e["version"] for e in reader.new_evals]
    assert reader.samples == 16  # eval records add no samples
    # a trainer resumed from version 2: steps 3, 4 and the evaluation of 4 are lost, that of 2 stays
    assert buf.truncate_progress(2) == 3
    again = ProgressReader(redis_client, job_id)
    assert [r["version"] for r in again.read_all()] == [1, 2]
    assert [e["version"] for e in again.evals] == [0, 2]
    # an evaluation repeated at a version supersedes the later ones, as steps do
    _eval(redis_client, keys, 2, 0.375)
    again.read(block_ms=0)
    assert [(e["version"], e["eval"]["accuracy"]) for e in again.evals] == [(0, 0.25), (2, 0.375)]
    assert format_progress(again.evals[-1], 10) == "eval  version    2  accuracy 0.375  pass@4 0.750  (2.5 s)"


def test_status_shows_the_last_evaluation():
    console = Console(width=120, record=True)
    console.print(render_status({"name": "j", "state": "running", "eval": {"version": 20, "accuracy": 0.5,
                                 "pass@4": 0.8125, "problems": 64.0, "duration_s": 3.25}}))  # fmt: skip
    text = console.export_text()
    assert "eval" in text and "version 20: accuracy 0.500  pass@4 0.812 (3.2 s)" in text
    assert "problems" not in text
    console = Console(width=120, record=True)
    console.print(render_status({"name": "j", "state": "running"}))
    assert "eval" not in console.export_text()


def test_report_plots_the_evaluations(tmp_path):
    steps = [{"version": v, "reward_mean": 0.1 * v, "elapsed_s": float(v)} for v in (1, 2, 3)]
    evals = [{"kind": "eval", "version": v, "eval": {"accuracy": a, "pass@2": a, "duration_s": 1.0}}
             for v, a in ((0, 0.1), (3, 0.4))]  # fmt: skip
    names = sorted(p.name for p in write_report(steps + evals, tmp_path))
    assert names == ["report_eval.png", "report_reward.png"]
    assert "report_eval.png" not in [p.name for p in write_report(steps, tmp_path / "none")]
