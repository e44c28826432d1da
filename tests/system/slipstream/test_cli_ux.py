"""What the operator reads: `--help` texts, `cluster up`'s output, `status` phases, log files without
terminal escapes, one line per step in `slipstream run`, the sandbox's thread limit as documented; and,
on one real cluster (Redis, Ray head, control API), readable scale errors, `buffer stats` through the
cluster, a job's status while it builds its model and while it scales, its pools after a stop, `logs`
after a cluster restart (driver.log), and `slipstream rm`."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import time
from pathlib import Path

import httpx
import pytest
import redis
from cluster_helpers import JOB_TIMEOUT_S, wait_for

from slipstream import cli
from slipstream.cli import cluster as cluster_cli
from slipstream.cli.jobs import render_status
from slipstream.cluster import services as cluster
from slipstream.cluster import state as cluster_state

# ---------------------------------------------------------------- unit level


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


def test_sandbox_thread_limit_is_what_its_notes_say(record_property):
    """Measures how many threads a sandboxed program can start at the default memory_mb, and checks
    the number python_sandbox.py's notes give (they held "Threads still work" before)."""
    from generator_fleet.tools import python_sandbox
    from generator_fleet.tools.base import ToolContext

    code = (
        "import threading\nev = threading.Event()\nn = 0\ntry:\n"
        "    while n < 200:\n        threading.Thread(target=ev.wait, daemon=True).start()\n        n += 1\n"
        "except RuntimeError as e:\n    print('stopped by', e)\nprint('threads', n)\nev.set()\n"
    )
    sandbox = python_sandbox.PythonSandbox()
    result = asyncio.run(sandbox.call({"code": code}, ToolContext(prompt_id="p")))
    started = int(re.search(r"threads (\d+)", result.text).group(1))
    record_property("sandbox_threads_at_default_memory", started)
    print(f"memory_mb={sandbox.memory_mb}: {started} threads started ({result.text!r})")
    assert 0 < started < 200 and "can't start new thread" in result.text
    documented = re.search(r"memory_mb=256 only (\d+) threads start", python_sandbox.__doc__)
    assert documented, "python_sandbox.py's notes must say how many threads start at the default"
    if resource.getrlimit(resource.RLIMIT_STACK)[0] == 8 << 20:  # the notes' number is for 8 MiB stacks
        assert abs(started - int(documented.group(1))) <= 2, (started, documented.group(0))


# ---------------------------------------------------------------- one real cluster
def test_scale_errors_are_one_readable_line(info, capsys):
    assert cli.main(["scale", "nojob", "--generators", "0", "--home", info.home]) == 1
    err = capsys.readouterr().err.strip()
    print(err)
    assert len(err.splitlines()) == 1
    assert "generators: Input should be greater than or equal to 1 (got 0)" in err and "HTTP 422" in err
    assert "[{" not in err and "'loc'" not in err


def test_status_buffer_stats_logs_and_rm_of_a_real_job(info, client, tmp_path, capsys, monkeypatch):
    name = "ux"
    model = tmp_path / "model"  # not built yet: the job builds it first
    spec = tmp_path / "ux.yaml"
    spec.write_text(f"""
name: {name}
model: {{path: {model}, build: tiny-arith, warmup_steps: 60}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 1}}
""")
    assert cli.main(["submit", str(spec), "--home", info.home]) == 0
    capsys.readouterr()

    # while it builds its model, status says so (it showed "starting" and zeros)
    st = wait_for(client, name, "the model build phase", lambda s: "building model" in (s.get("phase") or ""),
               poll_s=0.2)  # fmt: skip
    print(f"phase while starting: {st['phase']}")
    assert st["state"] == "starting" and "tiny-arith" in st["phase"] and str(model) in st["phase"]
    st = wait_for(client, name, "first steps", lambda s: s.get("version", 0) >= 3)
    assert st["state"] == "running" and not st.get("phase")

    # `buffer stats JOB` finds the job through the cluster: no SLIPSTREAM_REDIS_URL, no runs/JOB/redis.url
    monkeypatch.delenv("SLIPSTREAM_REDIS_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["buffer", "stats", name, "--home", info.home, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["steps"] >= 3 and stats["consumed"] >= 6, stats
    assert cli.main(["buffer", "stats", "nosuchjob", "--home", info.home]) == 2
    assert "no job 'nosuchjob' in the cluster" in capsys.readouterr().err

    # a running job cannot be removed
    assert cli.main(["rm", name, "--home", info.home]) == 1
    err = capsys.readouterr().err
    assert "is running; stop it first" in err and "HTTP 409" in err

    # while generators scale, status follows the trainer's version (it froze until the scale ended)
    capsys.readouterr()
    client.scale(name, generators=2, trainers=None)
    seen = []
    while (st := client.get(name))["pools"]["generators"] != 2 or st["state"] == "scaling":
        assert st["state"] in ("running", "scaling"), st
        if st["state"] == "scaling":
            seen.append(st["version"])
        time.sleep(0.3)
    print(f"versions shown while scaling generators 1 -> 2: {seen}")
    assert len(set(seen)) > 1, f"status froze at version {seen[:1]} while the generators scaled"

    # Ray's log of the job carries the actors' colours; `slipstream logs` shows it without them
    raw = httpx.get(
        f"{info.dashboard_url}/api/jobs/{st['ray_job_id']}/logs",
        headers={"Authorization": f"Bearer {info.ray_auth_token}"},
        timeout=30,
    ).json()["logs"]
    assert cli.main(["logs", name, "--home", info.home, "--tail", "0"]) == 0
    shown = capsys.readouterr().out
    print(f"Ray's log: {raw.count(chr(27))} escapes; shown: {shown.count(chr(27))}")
    assert "\x1b[" in raw  # the actors' prefixes, e.g. "\x1b[36m(RolloutActor pid=...)\x1b[0m"
    assert "\x1b[" not in shown and "\r" not in shown and "driver pid" in shown

    client.stop(name)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (st := client.get(name))["state"] not in ("stopped", "failed", "succeeded"):
        assert time.monotonic() < deadline, st
        time.sleep(1)
    assert st["state"] == "stopped", st
    assert st["pools"] == {"generators": 0, "rollout_workers": 0, "trainers": 0}, st["pools"]
    assert not st.get("phase"), st["phase"]  # "the trainer ends after its current step" is over

    # after a cluster restart Ray no longer knows the job: `logs` shows its driver.log instead
    cluster.down(info.home)
    cluster.up(info.home, start_prometheus=False)
    assert cli.main(["logs", name, "--home", info.home]) == 0
    out = capsys.readouterr()
    print(f"logs after the restart: {out.err.strip()}")
    assert "driver pid" in out.out and "job ux stopped" in out.out
    assert "driver.log" in out.err and "unavailable" in out.err

    # rm: keys and record gone, output kept (no --purge)
    r = redis.Redis.from_url(info.redis_url)
    assert list(r.scan_iter(match=f"slipstream:{name}:*"))
    assert cli.main(["rm", name, "--home", info.home]) == 0
    assert f"job {name} removed" in capsys.readouterr().out
    assert not list(r.scan_iter(match=f"slipstream:{name}:*"))
    assert name not in [j["name"] for j in client.list()]
    assert Path(st["output_dir"]).is_dir()
    assert cli.main(["rm", name, "--home", info.home]) == 1
    assert "no job 'ux'" in capsys.readouterr().err


def test_rm_purge_deletes_only_the_jobs_own_directory_under_home(info, client, tmp_path, capsys):
    from slipstream.job.store import JobStore

    store = JobStore(redis.Redis.from_url(info.redis_url))
    own = Path(info.home) / "jobs" / "ended"
    (own / "logs").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for name, out in (("ended", own), ("outside", outside)):
        store.create(name, "{}", 1, 1)
        store.update_status(name, state="failed", output_dir=str(out))
    assert cli.main(["rm", "ended", "--purge", "--home", info.home]) == 0
    assert "deleted" in capsys.readouterr().out and not own.exists()
    assert cli.main(["rm", "outside", "--purge", "--home", info.home]) == 0
    assert "kept" in capsys.readouterr().out and outside.is_dir()
    assert not {"ended", "outside"} & {j["name"] for j in client.list()}
