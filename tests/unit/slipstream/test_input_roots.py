"""The input paths of a submitted job (model, datasets, reference and critic models, the checkpoint it
resumes from) must lie in the operator's input roots or the job's own directory, symlinks resolved: by
default the cluster's HOME, the project and the temp directory; `cluster up --input-root` names others.
Runs the real JobControl over a real Redis with no Ray behind it: an accepted spec reaches Ray's job
submission, which fails (503)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from cluster_helpers import control_with_redis

import jobspec
from slipstream.cluster.control import ControlError, JobControl

REPO = Path(__file__).resolve().parents[3]


def _refused(control: JobControl, spec: str, cwd: str | None = None) -> str:
    with pytest.raises(ControlError) as e:
        control.submit(spec, [], cwd)
    assert e.value.status == 422, (e.value.status, str(e.value))
    return str(e.value)


def _accepted(control: JobControl, spec: str, cwd: str | None = None) -> dict:
    with pytest.raises(ControlError, match="Ray job submission failed") as e:
        control.submit(spec, [], cwd)
    assert e.value.status == 503, str(e.value)
    return json.loads(control.store.spec_json(jobspec.loads(spec).name))


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def test_a_submitted_job_reads_only_from_the_default_input_roots(home, tmp_path):
    assert tmp_path.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    (tmp_path / "to-etc").symlink_to("/etc", target_is_directory=True)
    with control_with_redis(home) as (control, _):
        for spec, key in (
            ("name: a\ndataset: {name: jsonl, path: /etc/shadow}", "$.dataset.path"),
            ("name: a\nmodel: {path: /etc}", "$.model.path"),
            ("name: a\nmodel: {path: ../../../../../../etc}", "$.model.path"),
            (f"name: a\nmodel: {{path: {tmp_path / 'to-etc'}}}", "$.model.path"),  # a link out is followed
            ("name: a\nalgorithm: {kl_coef: 0.1, ref_model_path: /etc}", "$.algorithm.ref_model_path"),
            ("name: a\nalgorithm: {critic_model_path: /usr/lib}", "$.algorithm.critic_model_path"),
            ("name: a\ntrainer: {resume_from: /etc/ckpt}", "$.trainer.resume_from"),
            ("name: a\neval: {heldout: 0, dataset: {name: jsonl, path: /etc/passwd}}", "$.eval.dataset.path"),
        ):
            msg = _refused(control, spec, cwd=str(tmp_path))
            assert f"at `{key}`" in msg and "is outside the input roots [" in msg, (spec, msg)
            assert str(REPO) in msg and "--input-root" in msg, msg
        assert "/etc is outside" in _refused(control, f"name: a\nmodel: {{path: {tmp_path / 'to-etc'}}}")

        # today's workflows: the project (examples, the demo model), the temp directory, HOME
        (tmp_path / "data.jsonl").write_text("")
        ok = _accepted(
            control,
            f"name: a\nmodel: {{path: runs/demo-model}}\ndataset: {{name: jsonl, path: {tmp_path / 'data.jsonl'}}}"
            f"\nalgorithm: {{kl_coef: 0.1, ref_model_path: {home / 'models' / 'ref'}}}",
            cwd=str(REPO),
        )
        assert ok["model"]["path"] == str(REPO / "runs" / "demo-model"), ok
        _accepted(control, "name: b\ntrainer: {resume_from: latest}")


def test_the_operators_input_roots_replace_the_defaults(home, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with control_with_redis(home, input_roots=[str(data)]) as (control, _):
        msg = _refused(control, f"name: a\nmodel: {{path: {tmp_path / 'model'}}}")
        assert "`$.model.path`" in msg and str(data) in msg, msg
        assert "`$.model.path`" in _refused(control, "name: a\nmodel: {path: runs/demo-model}", cwd=str(REPO))
        _accepted(control, f"name: a\nmodel: {{path: {data / 'model'}}}")
        # the job's own directory is always a root: it may resume from its own checkpoints
        own = home / "jobs" / "c"
        _accepted(
            control,
            f"name: c\nmodel: {{path: {data / 'm'}}}\ntrainer: {{resume_from: {own / 'checkpoints'}}}",
        )


def test_cluster_up_keeps_the_input_roots_for_the_api(tmp_path, monkeypatch):
    from slipstream.cluster import services

    seen = {}
    monkeypatch.setattr(services, "spawn", lambda home, name, cmd, env: seen.setdefault("cmd", cmd))
    monkeypatch.setattr(services, "_serving", lambda *a: 0)
    state = services.ClusterState(
        host="127.0.0.1", ports={"api": 1}, ray_temp_dir="", services=[], input_roots=["/data", "/models"]
    )
    info = services.ClusterInfo(
        home=str(tmp_path), host="127.0.0.1", redis_url="", redis_admin_url="", ray_address="",
        dashboard_url="", prometheus_url=None, api_url="", api_token="", ray_auth_token="", pids={}, running=True,
    )  # fmt: skip
    services._start_api(tmp_path, state, info)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--input-root") :][:4] == ["--input-root", "/data", "--input-root", "/models"]


def test_the_input_keys_are_listed_once_and_both_resolve_and_check_them(tmp_path):
    """jobspec.resolve_paths makes each input key absolute, and job_paths.input_paths (the input-roots
    check) names exactly the same keys: one list (jobspec.spec.INPUT_PATH_KEYS) behind both."""
    from jobspec.spec import INPUT_PATH_KEYS
    from slipstream.cluster.job_paths import input_paths

    spec = jobspec.loads(
        "name: a\nmodel: {path: m}\ndataset: {name: jsonl, path: d.jsonl}\n"
        "eval: {heldout: 0, dataset: {name: jsonl, path: e.jsonl}}\n"
        "algorithm: {kl_coef: 0.1, ref_model_path: r}\ntrainer: {resume_from: ck}"
    )
    resolved = jobspec.resolve_paths(spec, tmp_path)
    paths = input_paths(resolved)
    assert list(paths) == [f"$.{k}" for k in INPUT_PATH_KEYS]
    for key, p in paths.items():
        if p is not None:
            assert Path(p).is_absolute() and Path(p).is_relative_to(tmp_path.resolve()), (key, p)
    assert paths["$.eval.dataset.path"] == str((tmp_path / "e.jsonl").resolve())
    assert paths["$.trainer.resume_from"] == str((tmp_path / "ck").resolve())
    latest = jobspec.resolve_paths(jobspec.loads("name: a\ntrainer: {resume_from: latest}"), tmp_path)
    assert latest.trainer.resume_from == "latest" and input_paths(latest)["$.trainer.resume_from"] is None
