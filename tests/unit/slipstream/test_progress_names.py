"""Every progress-record name a reader uses is a StepRecord field (replay_buffer/progress.py): the job
status's fields, the status page's charts and job table, the end-of-job report's plots, `slipstream run`'s
line and the trainer's Prometheus metrics. A renamed or misspelt field fails here, not as an empty chart."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import msgspec

from replay_buffer.progress import STEP_FIELDS, StepRecord
from slipstream.cluster.ui import APP_JS
from slipstream.job import report
from slipstream.job.progress import STATUS_FIELDS, format_progress

STATUS_OWN = {"name", "state", "version", "total_steps", "pools", "buffer", "restarts", "failure", "error"}
"""Status fields the job driver sets itself (not copied from a step record)."""


def test_status_fields_are_step_record_fields():
    assert set(STATUS_FIELDS) <= STEP_FIELDS, set(STATUS_FIELDS) - STEP_FIELDS
    assert len(set(STATUS_FIELDS)) == len(STATUS_FIELDS)
    # the driver copies the last record's fields through this list, not one of its own
    driver = (Path(report.__file__).parent / "driver.py").read_text()
    assert "for k in STATUS_FIELDS" in driver


def test_the_status_page_reads_step_record_fields():
    charts = APP_JS[APP_JS.index("const CHARTS") :]
    charts = charts[: charts.index("];")]
    chart_keys = set(re.findall(r'key: "(\w+)"', charts))
    assert {"reward_mean", "staleness_mean", "tokens_per_s", "wait_s"} <= chart_keys  # the parse works
    assert chart_keys <= STEP_FIELDS, chart_keys - STEP_FIELDS
    # the job table (`j.`) and the job's summary (`st.`) read the job's status: its record fields must be
    # among those the driver copies into it
    status_keys = set(re.findall(r"\b(?:j|st)\.(\w+)", APP_JS))
    assert "reward_mean" in status_keys
    assert status_keys - STATUS_OWN <= set(STATUS_FIELDS), status_keys - STATUS_OWN - set(STATUS_FIELDS)


def test_the_report_plots_step_record_fields():
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(report))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_plot_lines":
            if isinstance(node.args[1], ast.Name) and node.args[1].id == "progress":
                names.add(node.args[2].value)
                names |= {pair.elts[0].value for pair in node.args[3].elts}
    assert {"reward_mean", "staleness_mean", "len_stale_mean", "elapsed_s"} <= names
    assert names <= STEP_FIELDS, names - STEP_FIELDS


def test_the_run_line_reads_step_record_fields():
    src = inspect.getsource(format_progress)
    names = set(re.findall(r"""r\[['"](\w+)['"]\]|r\.get\(['"](\w+)['"]""", src))
    names = {a or b for a, b in names}
    assert {"reward_mean", "tokens_per_s", "finish_tool_budget"} <= names
    assert names <= STEP_FIELDS, names - STEP_FIELDS


def test_metrics_observe_a_full_step_record():
    from trainer import metrics

    rec = StepRecord(version=3, **dict.fromkeys(STEP_FIELDS - {"version", "kl_ref", "mfu"}, 2.0))
    metrics.observe_step(rec)  # reads fields by attribute: a name the record lacks fails here
    assert metrics.MEMORY_PEAK._value.get() == 2.0 * (1 << 30) and metrics.VERSION._value.get() == 3
    metrics.observe_step(msgspec.structs.replace(rec, kl_ref=0.5, mfu=0.25))
    assert metrics.KL_REF._value.get() == 0.5 and metrics.MFU._value.get() == 0.25


def test_the_trainers_computed_names_are_step_record_fields():
    from replay_buffer.schema import FINISH_REASONS, Sample
    from trainer.trainer import episode_stats, length_stats

    sample = Sample.build(prompt_ids=[1], response_ids=[2], loss_mask=[1], behavior_logprobs=[0.0],
                          token_versions=[0], reward=1.0, finish_reason="stop")  # fmt: skip
    group = type("Group", (), {"samples": [sample]})
    names = (
        set(episode_stats([group]))
        | set(length_stats("len_trained", [3]))
        | set(length_stats("len_stale", []))
    )
    assert {f"finish_{r}" for r in FINISH_REASONS} | {"len_stale_p90", "turns_mean"} <= names
    assert names <= STEP_FIELDS, names - STEP_FIELDS


def test_trackings_identity_keys_are_step_record_fields():
    from slipstream.job.tracking import _NOT_SCALARS

    assert set(_NOT_SCALARS) <= STEP_FIELDS


def test_slipstream_status_reads_record_fields_the_driver_copies():
    from slipstream.cli.jobs import render_status

    src = inspect.getsource(render_status)
    names = set(re.findall(r"""\bst\.(\w+)""", src))  # a Status (slipstream/job/records.py)
    assert {"staleness_mean", "memory_peak_gib"} <= names
    driver_own = {"version", "run_id", "attempt", "samples_per_s", "elapsed_s"}  # set by the driver itself
    record_names = (names & STEP_FIELDS) - driver_own
    assert record_names <= set(STATUS_FIELDS), record_names - set(STATUS_FIELDS)
