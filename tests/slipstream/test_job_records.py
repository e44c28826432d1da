"""The control plane's records and the paths it derives: where a job's checkpoints are (one rule, the
trainer's, whether the spec is a JobSpec or the JSON stored at submit)."""

from __future__ import annotations

import json
from pathlib import Path

import jobspec
from slipstream.job.store import job_checkpoint_dir
from trainer.config import checkpoint_dir


def test_one_rule_derives_the_checkpoint_directory(tmp_path):
    assert checkpoint_dir(tmp_path) == tmp_path / "checkpoints"
    assert checkpoint_dir(tmp_path, "/ck") == Path("/ck")
    out = tmp_path.resolve()
    for extra, want in (("", out / "checkpoints"), ("\ntrainer: {checkpoint_dir: ck}", out / "ck")):
        spec = jobspec.resolve_paths(jobspec.loads(f"name: a\noutput_dir: {out}{extra}"), tmp_path)
        stored = json.loads(jobspec.to_json(spec))  # what the control plane reads back
        assert job_checkpoint_dir(spec) == job_checkpoint_dir(stored) == want
