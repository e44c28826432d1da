"""The control plane end to end, on a real cluster started by the test (Redis, Ray head with token auth,
control API): submit through the CLI, watch progress, scale generators 1 -> 2 -> 1 and trainers 1 -> 2
(gloo, resumed from a checkpoint) while the job runs, checkpoint on request, stop; no group lost or
trained twice. Bad specs and missing tokens are refused with precise errors."""

import time
from pathlib import Path

import http_calls
import pytest
import redis
from cluster_helpers import JOB_TIMEOUT_S, QUICK_POLL_S, spec_text, wait_for

from slipstream import cli


def _spec_file(tmp_path, model_dir, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(spec_text(model_dir, name))
    return path


def test_api_requires_the_token(info):
    assert http_calls.get(f"{info.api_url}/jobs").status_code == 401
    bad = http_calls.get(f"{info.api_url}/jobs", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and "token" in bad.json()["detail"]
    ok = http_calls.get(f"{info.api_url}/jobs", headers={"Authorization": f"Bearer {info.api_token}"})
    assert ok.status_code == 200
    assert http_calls.get(f"{info.api_url}/openapi.json").status_code == 200  # the docs are public
    big = http_calls.post(
        f"{info.api_url}/jobs",
        headers={"Authorization": f"Bearer {info.api_token}"},
        json={"spec": "x" * (2 << 20)},
    )
    assert big.status_code == 413


def test_bad_specs_fail_at_submit_with_the_key_path(info, client, tmp_path, capsys):
    from slipstream.cli.jobs import ApiError

    with pytest.raises(ApiError, match=r"unknown key - at `\$\.algorithm\.lrr`.*HTTP 422"):
        client.submit("algorithm: {lrr: 1}", [], str(tmp_path))
    with pytest.raises(ApiError, match=r"\$\.name"):
        client.submit("name: Bad/Name", [], str(tmp_path))
    with pytest.raises(ApiError, match=r"\$\.buffer\.max_staleness"):
        client.submit("buffer: {max_staleness: fast}", [], str(tmp_path))
    # the CLI: same message, exit 1, nothing submitted
    spec = tmp_path / "bad.yaml"
    spec.write_text("rollout: {group_size: 0}\n")
    assert cli.main(["submit", str(spec), "--home", info.home]) == 1
    assert "$.rollout.group_size" in capsys.readouterr().err
    assert client.list() == []


def test_submit_scale_checkpoint_stop(info, client, tmp_path, tiny_model_dir, capsys):
    name = "scaled"
    spec = _spec_file(tmp_path, tiny_model_dir, name)
    assert cli.main(["submit", str(spec), "--home", info.home]) == 0
    out = capsys.readouterr().out
    assert f"submitted job {name}" in out
    # the spec's relative `output_dir: out` is not used, and submit says so
    assert "note: output_dir 'out' is relative" in out and str(Path(info.home) / "jobs" / name) in out, out
    st = wait_for(client, name, "first steps", lambda s: s.get("version", 0) >= 3, poll_s=QUICK_POLL_S)
    assert st["state"] == "running" and st["pools"] == {"generators": 1, "rollout_workers": 1, "trainers": 1}
    assert Path(st["output_dir"]) == Path(info.home) / "jobs" / name  # relative output_dir: under HOME
    print(f"running: version {st['version']}, reward {st['reward_mean']:.3f}")

    # A second job shares the cluster: it runs to its end beside the first (while the first scales its
    # generators), on keys and files of its own.
    from slipstream.cli.jobs import ApiError

    with pytest.raises(ApiError, match="is running; stop it first.*HTTP 409"):
        client.submit(spec.read_text(), [], str(tmp_path))
    other = client.submit(
        _spec_file(tmp_path, tiny_model_dir, "neighbour").read_text(),
        ["algorithm.total_steps=4"],
        str(tmp_path),
    )

    # generators 1 -> 2: the new engine joins through the bus (current weights first), then takes traffic
    client.scale(name, generators=2, trainers=None)
    trainer_log = Path(st["output_dir"]) / "logs" / "trainer-0.log"
    # joined: the bus admitted the new engine at an update (it was in the registry's joining set till then)
    st = wait_for(
        client,
        name,
        "2 generators, the new one given the weights",
        lambda s: s["pools"]["generators"] == 2 and "joined ['http://" in trainer_log.read_text(),
        poll_s=QUICK_POLL_S,
    )
    engine1 = (Path(st["output_dir"]) / "logs" / "engine-1.log").read_text()
    assert "weights updated" in engine1
    v0 = st["version"]
    st = wait_for(
        client, name, "steps with 2 generators", lambda s: s["version"] > v0 + 2, poll_s=QUICK_POLL_S
    )

    # ... and back to 1
    client.scale(name, generators=1, trainers=None)
    v0 = st["version"]
    st = wait_for(
        client,
        name,
        "1 generator",
        lambda s: s["pools"]["generators"] == 1 and s["version"] > v0 + 2,
        poll_s=QUICK_POLL_S,
    )

    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (nb := client.get(other["name"]))["state"] not in ("succeeded", "failed", "stopped"):
        assert time.monotonic() < deadline, nb
        time.sleep(QUICK_POLL_S)
    assert nb["state"] == "succeeded" and nb["version"] == 4, nb
    assert nb["buffer"]["steps"] == 4 and nb["output_dir"] != st["output_dir"]
    assert client.get(name)["state"] == "running"

    # trainers 1 -> 2: checkpoint, restart with 2 gloo ranks resharded from it, carry on
    client.scale(name, generators=None, trainers=2)
    v0 = st["version"]
    st = wait_for(
        client,
        name,
        "2 trainers",
        lambda s: s["pools"]["trainers"] == 2 and s["version"] > v0 + 2,
        poll_s=QUICK_POLL_S,
    )
    driver_log = Path(st["output_dir"]) / "logs" / "driver.log"
    assert "trainer pool: 2 ranks, resumed from" in driver_log.read_text()

    client.checkpoint(name)
    ckpts = Path(st["output_dir"]) / "checkpoints"
    before = set(ckpts.iterdir())
    wait_for(
        client, name, "a requested checkpoint", lambda s: set(ckpts.iterdir()) - before, poll_s=QUICK_POLL_S
    )

    assert cli.main(["logs", name, "--home", info.home, "--tail", "5"]) == 0
    assert "components: driver" in capsys.readouterr().out
    assert cli.main(["status", name, "--home", info.home]) == 0
    assert "trainers" in capsys.readouterr().out

    client.stop(name)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (st := client.get(name))["state"] not in ("stopped", "failed", "succeeded"):
        assert time.monotonic() < deadline, st
        time.sleep(QUICK_POLL_S)
    assert st["state"] == "stopped", st
    # nothing lost or trained twice across the scalings and the trainer restart
    buf = st["buffer"]
    r = redis.Redis.from_url(info.redis_url)
    from replay_buffer import ReplayBuffer

    final = ReplayBuffer(r, name).stats()
    print(f"stopped at version {st['version']}: {final}")
    assert final["duplicates"] == 0 and final["dead_letter"] == 0
    assert final["produced"] == final["consumed"] + final["dropped_stale"] + final["depth"]
    assert final["consumed"] == 2 * final["steps"] and buf["consumed"] <= final["consumed"]
    # the cluster's driver tracked every version once, across the scalings and the trainer pool restart
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(st["output_dir"]) / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward_mean")] == list(range(1, st["version"] + 1))
    assert st["tracking"]["version"] == st["version"] and st["tracking"]["errors"] == {}
    assert [j["name"] for j in client.list()] == ["neighbour", name]
