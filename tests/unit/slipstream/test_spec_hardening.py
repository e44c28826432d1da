"""Hostile and sloppy job specs, refused at validate and submit with a clear error: a YAML alias bomb,
non-UTF-8, deeply nested, oversized, empty specs and keys given twice; a job name with a trailing newline;
paths that would write outside the job's own directory; non-finite numbers, absurd counts and pools over
the scale cap. `--set name=123` is the name "123", a resumed job shows the version it resumes from,
relative paths follow one rule (the command's working directory) in validate and submit, and no example
builds its model inside examples/.

The submit path runs on the real JobControl over a real Redis with no Ray behind it (as in
test_api_fuzz.py): a spec that passes every check reaches Ray's job submission, which fails (503)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from cluster_helpers import control_without_ray

import jobspec
from jobspec.spec import check_name
from slipstream import cli
from slipstream.cluster.control import ControlError, JobControl, output_dir_note

REPO = Path(__file__).resolve().parents[3]
NO_RAY = "Ray job submission failed"

# The 487-byte spec, in spirit: nine levels of nine aliases each under tools[].args (9**9 leaves).
BOMB = "name: bomb\ntools:\n- name: calculator\n  args:\n    a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
    f"*a{i - 1}, *a{i - 1}]\n"
    for i in range(1, 9)
)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """The real JobControl over a real Redis, with nothing listening where Ray would be."""
    with control_without_ray(tmp_path_factory.mktemp("home")) as control:
        yield control


def _refused(
    control: JobControl, spec: str, overrides: list[str] | None = None, cwd: str | None = None
) -> str:
    with pytest.raises(ControlError) as e:
        control.submit(spec, overrides or [], cwd)
    assert e.value.status == 422, (e.value.status, str(e.value))
    return str(e.value)


def _accepted(
    control: JobControl, spec: str, overrides: list[str] | None = None, cwd: str | None = None
) -> dict:
    """Submit a spec that passes every check: it reaches Ray, which is not there (503)."""
    with pytest.raises(ControlError, match=NO_RAY) as e:
        control.submit(spec, overrides or [], cwd)
    assert e.value.status == 503
    name = jobspec.loads(spec, overrides or []).name
    return json.loads(control.store.spec_json(name))


# ---- YAML: aliases, encoding, depth, size ----------------------------------------------------------------


def test_an_alias_bomb_is_refused_at_once_naming_the_line(control, tmp_path, capsys):
    assert len(BOMB) < 1024
    t0 = time.monotonic()
    msg = _refused(control, BOMB)
    assert "aliases (*name) are not allowed" in msg and "line 6" in msg, msg
    assert not control.store.exists("bomb")
    # the CLI's validate (and run) too: exit 2 and the message, no traceback
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "aliases (*name) are not allowed" in err and "Traceback" not in err
    # and an override's value
    msg = _refused(control, "name: ok", ["tools=[{name: calculator, args: {a: &a [1, 2], b: *a}}]"])
    assert "override" in msg and "aliases" in msg, msg
    print(f"alias bomb refused in {time.monotonic() - t0:.3f} s: {msg.splitlines()[0]}")


def test_a_non_utf8_spec_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and str(path) in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "text",
    [
        "tools: [{name: calculator, args: {a: " + "[" * 5000 + "]" * 5000 + "}}]",
        "tools: [{name: calculator, args: " + "{a: " * 200 + "1" + "}" * 200 + "}]",
        json.dumps({"tools": [{"name": "calculator", "args": json.loads("[" * 900 + "]" * 900)}]}),
    ],
    ids=["flow-lists", "flow-maps", "json"],
)
def test_a_deeply_nested_spec_is_a_clear_error(control, tmp_path, capsys, text):
    assert "nested too deeply" in _refused(control, text)
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err, err


def test_a_spec_over_the_size_limit_is_refused():
    with pytest.raises(jobspec.JobSpecError, match="over 1048576 bytes"):
        jobspec.loads("name: big\n# " + "x" * jobspec.MAX_SPEC_BYTES)


# ---- job names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nl\n", "nl\n\n", "a\nb", "\nx", "ok ", "x" * 64])
def test_a_job_name_must_match_whole(control, name):
    assert check_name(name) is not None
    msg = _refused(control, json.dumps({"name": name}))
    assert "`$.name`" in msg, msg
    assert not control.store.exists(name) and not (Path(control.home) / "jobs" / name).exists()


@pytest.mark.parametrize("name", ["../x", "a/b", "x" * 300, "nl\n", "Upper", "control"])
def test_validate_refuses_the_names_submit_refuses(control, tmp_path, capsys, name):
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps({"name": name}))
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "`$.name`" in err and "Traceback" not in err, err
    assert "`$.name`" in _refused(control, json.dumps({"name": name}))


def test_digit_names_are_valid_through_set(control, tmp_path, capsys):
    # Was: `--set name=123` failed with "Expected `str`, got `int`".
    assert jobspec.loads("", ["name=123"]).name == "123"
    spec = tmp_path / "s.yaml"
    spec.write_text("model: {path: m}\n")
    assert cli.main(["validate", str(spec), "--set", "name=007", "--set", "model.path=2024-01-01"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "007" and out["model"]["path"].endswith("/2024-01-01")
    assert jobspec.loads("", ["trainer.resume_from=null"]).trainer.resume_from is None
    assert jobspec.loads("", ["algorithm.total_steps=7"]).algorithm.total_steps == 7  # numbers stay numbers
    assert _accepted(control, "", ["name=123"])["name"] == "123"


# ---- paths of submitted jobs -----------------------------------------------------------------------------


def test_a_submitted_job_writes_only_inside_its_own_directory(control, tmp_path):
    home = Path(control.home)
    jobs = home / "jobs"
    victim = _accepted(control, "name: victim")
    victim_json = Path(victim["output_dir"]) / "job.json"
    before = victim_json.read_text()
    outside = tmp_path / "etc-x"
    cases = [
        ("name: a\noutput_dir: " + str(outside), "`$.output_dir`"),
        ("name: a\ntrainer: {checkpoint_dir: ../../../../etc/x}", "`$.trainer.checkpoint_dir`"),
        ("name: a\ntrainer: {checkpoint_dir: " + str(outside) + "}", "`$.trainer.checkpoint_dir`"),
        ("name: a\noutput_dir: " + str(jobs / "victim"), "`$.output_dir`"),  # another job's directory
        ("name: a\noutput_dir: " + str(jobs / "a" / ".." / "victim"), "`$.output_dir`"),
        ("name: ab\noutput_dir: " + str(jobs / "a"), "`$.output_dir`"),  # a prefix is not inside
    ]
    for spec, key in cases:
        msg = _refused(control, spec, cwd=str(tmp_path))
        assert key in msg and "outside the job's directory" in msg, (spec, msg)
    # a symlink inside the job's directory that leads out of it is followed, and refused
    (jobs / "a").mkdir(parents=True, exist_ok=True)
    (jobs / "a" / "link").symlink_to(outside, target_is_directory=True)
    msg = _refused(control, "name: a\noutput_dir: " + str(jobs / "a" / "link" / "out"))
    assert "`$.output_dir`" in msg, msg
    assert not outside.exists()
    # a path no filesystem name can hold is refused, not a 500
    assert "path" in _refused(control, 'name: a\nmodel: {path: "m\\ud800"}')
    assert victim_json.read_text() == before  # the other job's record is untouched

    # inside its own directory is fine, normalised; a relative checkpoint_dir goes under output_dir
    ok = _accepted(
        control,
        f"name: a\noutput_dir: {jobs / 'a' / 'x' / '..' / 'out'}\ntrainer: {{checkpoint_dir: ck}}",
    )
    assert ok["output_dir"] == str((jobs / "a" / "out").resolve())
    assert ok["trainer"]["checkpoint_dir"] == str((jobs / "a" / "out" / "ck").resolve())
    assert (jobs / "a" / "out" / "job.json").exists()
    # a relative output_dir is the job's own directory, whatever it says
    assert _accepted(control, "name: b\noutput_dir: ../../elsewhere")["output_dir"] == str(
        (jobs / "b").resolve()
    )
    # ... and the submitter is told so, with the key and where the job writes instead
    note = output_dir_note(jobspec.loads("name: b\noutput_dir: ../../elsewhere"), home)
    assert "`$.output_dir`" in note and "'../../elsewhere'" in note and str((jobs / "b").resolve()) in note
    assert output_dir_note(jobspec.loads(f"name: a\noutput_dir: {jobs / 'a'}"), home) is None


# ---- numbers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, overrides, key",
    [
        ("", ["algorithm.lr=.inf"], "$.algorithm.lr"),
        ("algorithm: {lr: .nan}", [], "$.algorithm.lr"),
        ("algorithm: {clip_eps: .inf}", [], "$.algorithm.clip_eps"),
        ("tools: [{name: calculator, args: {x: -.inf}}]\nagent: {}", [], "$.tools[0].args.x"),
        ("", ["bus.timeout_s=1e308"], "$.bus.timeout_s"),
        ("", ["agent.tool_timeout_s=1e9"], "$.agent.tool_timeout_s"),
        ("", ["algorithm.total_steps=99999999999999999999999"], "$.algorithm.total_steps"),
        ("", ["dataset.seed=99999999999999999999999"], "$.dataset.seed"),
        ("generators: {num_engines: 100000}", [], "$.generators.num_engines"),
        ("generators: {num_workers: 4097}", [], "$.generators.num_workers"),
        ("trainer: {num_trainers: 100000}", [], "$.trainer.num_trainers"),
        ("", ["algorithm.groups_per_step=1e9"], "$.algorithm.groups_per_step"),
        ("", ["algorithm.groups_per_step=65537"], "$.algorithm.groups_per_step"),
        ("rollout: {sampling: {max_new_tokens: 1000000000}}", [], "$.rollout.sampling.max_new_tokens"),
        ("", ["rollout.sampling.max_new_tokens=131073"], "$.rollout.sampling.max_new_tokens"),
        ("eval: {max_new_tokens: 131073}", [], "$.eval.max_new_tokens"),
    ],
)
def test_values_that_would_fail_later_are_refused_at_submit(control, spec, overrides, key):
    msg = _refused(control, spec, overrides)
    assert f"`{key}`" in msg, msg


def test_the_largest_step_and_response_allowed_are_accepted(control, tmp_path):
    # In an empty working directory: a model built at the default model.path (runs/demo/model, 64 tokens of
    # context) would refuse this budget (jobspec.check_context).
    spec = _accepted(
        control,
        "name: big\nalgorithm: {groups_per_step: 65536}\nrollout: {sampling: {max_new_tokens: 131072}}",
        cwd=str(tmp_path),
    )
    assert spec["algorithm"]["groups_per_step"] == 65536
    assert spec["rollout"]["sampling"]["max_new_tokens"] == 131072


@pytest.mark.parametrize("text", ["", "\n\n", "# just a comment\n"])
def test_an_empty_spec_is_refused_not_run_as_the_default_job(control, tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "empty spec" in err and str(path) in err and "Traceback" not in err, err
    assert "empty spec" in _refused(control, text)
    assert not control.store.exists("demo")  # no default job was created
    # defaults plus overrides is a spec the user wrote out on the command line
    assert _accepted(control, text, ["name=from-set"])["name"] == "from-set"


@pytest.mark.parametrize(
    "text, key, line, first",
    [
        ("name: a\nalgorithm:\n  lr: 1.0e-4\n  lr: 2.0e-4\n", "lr", 4, 3),
        ("name: a\nrollout: {group_size: 4}\nname: b\n", "name", 3, 1),
        ('{"name": "a", "name": "b"}', "name", 1, 1),
    ],
)
def test_a_key_given_twice_is_refused_naming_the_key_and_line(
    control, tmp_path, capsys, text, key, line, first
):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"duplicate key '{key}' (first on line {first})" in err and f"line {line}" in err, err
    assert "Traceback" not in err, err
    assert f"duplicate key '{key}'" in _refused(control, text)


def _checkpoint(ckpts: Path, version: int) -> Path:
    """A complete checkpoint as trainer/checkpoint.py leaves it (its state file and the `latest` pointer)."""
    path = ckpts / f"step-{version:08d}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"version": version, "step": version}))
    (ckpts / "latest").write_text(path.name)
    return path


def test_a_resumed_job_shows_the_version_it_resumes_from_while_it_starts(control):
    ckpts = Path(control.home) / "jobs" / "again" / "checkpoints"
    _checkpoint(ckpts, 5)
    seven = _checkpoint(ckpts, 7)
    _accepted(control, "name: again\ntrainer: {resume_from: latest}")
    assert control.store.status("again").version == 7
    _accepted(control, f"name: again\ntrainer: {{resume_from: {ckpts / 'step-00000005'}}}")
    assert control.store.status("again").version == 5
    _accepted(control, f"name: again\ntrainer: {{resume_from: {seven}}}")
    assert control.store.status("again").version == 7
    _accepted(control, "name: again")  # a fresh job starts at 0
    assert control.store.status("again").version == 0


def test_submit_and_scale_share_one_pool_cap(control):
    assert jobspec.MAX_POOL == 4096
    from slipstream.cluster.api import MAX_POOL

    assert MAX_POOL is jobspec.MAX_POOL
    _accepted(control, "name: pools\ngenerators: {num_engines: 4096, num_workers: 4096}")
    control.store.update_status("pools", state="running")
    before = control.store.desired("pools")
    for key in ("generators", "trainers"):
        with pytest.raises(ControlError, match="1 to 4096") as e:
            control.scale("pools", **{key: 4097})
        assert e.value.status == 422
    assert control.store.desired("pools") == before
    _refused(control, "name: pools2\ngenerators: {num_engines: 4097}")


# ---- one rule for relative paths; no model built into examples/ -----------------------------------------


def test_relative_paths_are_the_working_directorys_in_validate_and_submit(
    control, tmp_path, monkeypatch, capsys
):
    import uvicorn

    from slipstream.cluster.api import create_app

    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "rel.yaml").write_text(
        "name: rel\nmodel: {path: models/m}\ndataset: {name: jsonl, path: d.jsonl}\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["validate", str(specs / "rel.yaml")]) == 0
    validated = json.loads(capsys.readouterr().out)
    assert validated["model"]["path"] == str(work / "models" / "m")
    assert validated["dataset"]["path"] == str(work / "d.jsonl")

    # `slipstream submit` sends the working directory (was: the spec file's): the same paths result
    token = "spec-" + os.urandom(4).hex()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(token, control), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "control API did not start"
            time.sleep(0.02)
        monkeypatch.setenv("SLIPSTREAM_API_TOKEN", token)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        assert cli.main(["submit", str(specs / "rel.yaml"), "--api-url", url]) == 1  # no Ray behind it
        assert NO_RAY in capsys.readouterr().err
    finally:
        server.should_exit = True
        thread.join(10)
    stored = json.loads(control.store.spec_json("rel"))
    assert stored["model"]["path"] == validated["model"]["path"]
    assert stored["dataset"]["path"] == validated["dataset"]["path"]


def test_the_examples_never_build_a_model_inside_examples(monkeypatch, capsys):
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        spec = jobspec.resolve_paths(jobspec.load(path), REPO)  # from the project root, as documented
        assert spec.model.build is not None
        assert not Path(spec.model.path).is_relative_to(REPO / "examples"), spec.model.path
    # run from inside examples/, a build there is refused with the key, before anything starts
    monkeypatch.chdir(REPO / "examples")
    assert cli.main(["validate", "demo.yaml"]) == 2
    err = capsys.readouterr().err
    assert "examples/" in err and "`$.model.path`" in err, err
    assert not (REPO / "examples" / "runs").exists()
