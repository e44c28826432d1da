"""What the operator reads, in one process: `--help` texts, a non-UTF-8 spec refused by `submit` in one
line, `cluster down`'s and `cluster up`'s output, `status` phases, log files without terminal escapes, and
one line per step in `slipstream run`."""

from __future__ import annotations

import json
import logging
import re

import pytest

from slipstream import cli
from slipstream.cli import cluster as cluster_cli
from slipstream.cli.jobs import render_status
from slipstream.cluster import state as cluster_state


def _help(*argv: str) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return buf.getvalue()


def test_every_option_of_submit_scale_logs_status_rm_has_a_help_text():
    # argparse prints an option without help as its bare flag line; each of these must say what it does
    assert "override a spec key" in _help("submit")
    scale = _help("scale")
    assert "engines, each with its rollout workers" in scale and "trainer ranks" in scale
    assert "the last N lines" in _help("logs")
    assert "full status record as JSON" in _help("status")
    assert "output directory" in _help("rm")
    import argparse

    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in ("submit", "scale", "logs", "status", "rm", "stop", "checkpoint", "list"):
        bare = [a.option_strings for a in sub.choices[cmd]._actions if a.option_strings and not a.help]
        assert not bare, f"`slipstream {cmd}`: options without help: {bare}"


def test_submit_of_a_file_that_is_not_utf8_is_one_line_naming_the_file_and_byte(
    tmp_path, capsys, monkeypatch
):
    spec = tmp_path / "job.yaml"
    spec.write_bytes(b"name: ok\nmodel: {path: caf\xe9}\n")  # Latin-1 e-acute at byte 26
    monkeypatch.setenv("SLIPSTREAM_API_TOKEN", "t")
    # refused before any request: the API is never asked, so nothing needs to listen there
    assert cli.main(["submit", str(spec), "--api-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert str(spec) in err and "not UTF-8" in err and "byte 26" in err, err


def test_cluster_down_names_the_jobs_it_stopped_and_how():
    jobs = {
        "a": {"state": "stopped", "version": 12, "checkpoint": "/h/jobs/a/checkpoints/step-00000012"},
        "b": {"state": "stopped", "version": 3, "checkpoint": ""},
    }
    line = cluster_cli.jobs_line(jobs, force=False)
    assert line == (
        "jobs stopped: a (stopped at version 12, checkpoint /h/jobs/a/checkpoints/step-00000012), "
        "b (stopped at version 3, no checkpoint)"
    )
    killed = cluster_cli.jobs_line({"a": {"state": "running", "version": 7}}, force=True)
    assert "killed without a checkpoint" in killed and "a (version 7)" in killed
    assert cluster_cli.jobs_line({}, force=False) == "jobs: none was running"


def _info(host: str) -> cluster_state.ClusterInfo:
    return cluster_state.ClusterInfo(
        home="/h", host=host, redis_url="redis://slipstream:pw@127.0.0.1:1/0",
        redis_admin_url="redis://:pw@127.0.0.1:1/0", ray_address="127.0.0.1:6380",
        dashboard_url="http://127.0.0.1:2", prometheus_url=None, api_url="http://127.0.0.1:3",
        api_token="t", ray_auth_token="r", pids={"redis": 1, "ray": 2, "api": 3}, running=True,
        ray_temp_dir="/tmp/x",
    )  # fmt: skip


def test_cluster_up_prints_a_ray_start_line_only_when_other_nodes_can_use_it(capsys):
    import argparse

    args = argparse.Namespace(no_prometheus=True)
    cluster_cli._print_up(_info("127.0.0.1"), {}, args)
    loopback = capsys.readouterr().out
    assert "ray start" not in loopback  # a loopback head cannot take other nodes
    assert "cluster up --host 0.0.0.0" in loopback
    cluster_cli._print_up(_info("10.1.2.3"), {}, args)
    reachable = capsys.readouterr().out
    assert "ray start --address 10.1.2.3:6380" in reachable and "loopback" not in reachable


def test_status_shows_the_phase_of_a_job_that_is_not_running_yet():
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(
        render_status({"name": "j", "state": "starting", "phase": "building model tiny-arith at /m"})
    )
    assert "building model tiny-arith at /m" in console.export_text()


def test_log_files_hold_no_terminal_escapes_or_progress_redraws(tmp_path):
    """The formatter of the driver's and every component's file handler (slipstream/job/driver.py, actors.py)."""
    from common.logtext import PlainFormatter, plain

    fh = logging.FileHandler(tmp_path / "c.log")
    fh.setFormatter(PlainFormatter("%(levelname)s %(message)s"))
    lg = logging.getLogger("test_cli_ux.plain")
    lg.addHandler(fh)
    try:
        lg.warning("\x1b[36m(TrainerActor pid=7)\x1b[0m \r 10%|#  |\r 50%|## |\r100%|###|\r\nready")
    finally:
        lg.removeHandler(fh)
        fh.close()
    text = (tmp_path / "c.log").read_text()
    assert text == "WARNING (TrainerActor pid=7) 100%|###|\nready\n", repr(text)
    assert plain("a\x1b]0;title\x07b\x1b[2Kc\r\nd\r\n") == "abc\nd\n"


def test_slipstream_run_prints_each_step_once(redis_server, tmp_path, caplog, capsys):
    """`slipstream run` prints every progress record as its line (format_progress); the driver's own log
    line of that step must not print it a second time (the cluster's driver.log keeps it at INFO)."""
    import jobspec
    from slipstream.job.driver import JobDriver
    from slipstream.job.progress import format_progress
    from slipstream.job.store import JobStore

    spec = jobspec.loads(f"name: once\noutput_dir: {tmp_path}\nalgorithm: {{total_steps: 10}}\n")
    r = redis_server.client()
    record = {
        "step": 1, "version": 1, "reward_mean": 0.5, "staleness_mean": 0.0, "staleness_max": 0,
        "response_tokens": 8, "wait_s": 0.1, "step_s": 0.2, "pause_s": 0.0, "loss": 0.1, "elapsed_s": 1.0,
    }  # fmt: skip
    r.xadd("slipstream:once:progress", {"j": json.dumps(record)})
    store = JobStore(r)
    store.create("once", jobspec.to_json(spec), 1, 1)
    caplog.set_level(logging.INFO)
    printed = []

    def on_progress(rec):
        printed.append(format_progress(rec, 10))
        print(printed[-1])

    JobDriver(spec, redis_server.url, store, on_progress=on_progress).read_progress(block_ms=0)
    step_logs = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.INFO]
    lines = capsys.readouterr().out.splitlines() + step_logs
    print(f"lines shown for step 1: {lines}")
    assert len(printed) == 1 and [ln for ln in lines if re.search(r"version +1\b|version 1/", ln)] == printed

    caplog.clear()  # the cluster's driver (no on_progress) logs the step at INFO: its only line
    JobDriver(spec, redis_server.url, store).read_progress(block_ms=0)
    assert [rec.getMessage() for rec in caplog.records if "version 1/10" in rec.getMessage()]
    r.close()
