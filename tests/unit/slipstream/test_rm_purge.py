"""`slipstream rm JOB --purge` deletes the job's own directory under $SLIPSTREAM_HOME/jobs and nothing
outside it: a job directory that is a symlink is removed as a link, its target kept (it once resolved the
link and deleted the target, which may be another job's directory or anything at all), and a link inside
the job's directory is not followed. Real Redis, the real JobControl and API over HTTP, `slipstream rm`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_helpers import control_with_redis, serving

from slipstream import cli
from slipstream.cluster.api import create_app

TOKEN = "purge-token"


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_API_TOKEN", TOKEN)
    home = tmp_path / "home"
    (home / "jobs").mkdir(parents=True)
    with control_with_redis(home, TOKEN) as (control, _):
        with serving(create_app(TOKEN, control)) as url:
            yield url, control, home


def _ended_job(control, name: str, output_dir: Path) -> None:
    """A job record as a submission leaves it (its output_dir with symlinks resolved), ended."""
    control.store.create(name, json.dumps({"name": name}), 1, 1)
    control.store.update_status(name, state="failed", output_dir=str(output_dir.resolve()))


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _rm(url: str, name: str, capsys) -> str:
    assert cli.main(["rm", name, "--purge", "--api-url", url]) == 0
    return capsys.readouterr().out


def test_purge_removes_a_symlinked_job_directory_as_a_link_only(api, tmp_path, capsys):
    url, control, home = api
    elsewhere = tmp_path / "elsewhere"  # e.g. a bigger disk the operator linked the job to
    (elsewhere / "logs").mkdir(parents=True)
    (elsewhere / "logs" / "driver.log").write_text("kept")
    (elsewhere / "precious.txt").write_text("kept")
    (home / "jobs" / "linked").symlink_to(elsewhere)
    _ended_job(control, "linked", home / "jobs" / "linked")

    out = _rm(url, "linked", capsys)
    print(out)
    assert not (home / "jobs" / "linked").is_symlink() and not (home / "jobs" / "linked").exists()
    assert _files(elsewhere) == ["logs", "logs/driver.log", "precious.txt"]
    assert "kept" in out and "link" in out and "removed" in out


def test_purge_never_reaches_another_jobs_directory_through_a_link(api, capsys):
    url, control, home = api
    other = home / "jobs" / "other"
    other.mkdir()
    (other / "job.json").write_text("{}")
    (home / "jobs" / "alias").symlink_to(other)  # alias's record names other's directory as its output
    _ended_job(control, "alias", home / "jobs" / "alias")
    _ended_job(control, "other", other)

    _rm(url, "alias", capsys)
    assert _files(other) == ["job.json"]  # the other job's directory is whole
    assert "other" in {j["name"] for j in control.list()}


def test_purge_deletes_a_real_job_directory_without_following_links_inside(api, tmp_path, capsys):
    url, control, home = api
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_text("kept")
    own = home / "jobs" / "own"
    (own / "logs").mkdir(parents=True)
    (own / "logs" / "trainer-0.log").write_text("goes")
    (own / "checkpoints").symlink_to(outside, target_is_directory=True)
    _ended_job(control, "own", own)

    out = _rm(url, "own", capsys)
    assert "deleted" in out and not own.exists()
    assert _files(outside) == ["data.bin"]
