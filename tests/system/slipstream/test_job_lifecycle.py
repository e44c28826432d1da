"""Jobs under operator actions, on a real cluster (Redis, Ray head, control API) restarted by the tests:
a scale request the job's spec does not allow is refused with the reason; `stop` writes a checkpoint
where the trainer stops whatever checkpoint_every says (or, with --no-checkpoint, says that nothing was
saved) and says "nothing to do" on an ended job; `cluster down` stops running jobs with their checkpoint
(refusing, with the job named, when they do not end in time), and a job whose driver a forced cluster
restart killed is marked `interrupted` with its latest checkpoint, after which stop answers and the same
name resumes from that checkpoint."""

from pathlib import Path

import pytest
from cluster_helpers import ENDED, QUICK_POLL_S, spec_text, wait_for

from slipstream import cli
from slipstream.cli.jobs import ApiError
from slipstream.cluster import services as cluster


@pytest.fixture(scope="module")
def home(info):  # down/up on the same HOME keeps the ports and the token: `client` stays valid
    return Path(info.home)


def test_scale_is_checked_against_the_spec_and_stop_says_what_it_does(
    home, client, tmp_path, tiny_model_dir, capsys
):
    name = "plain"
    client.submit(spec_text(tiny_model_dir, name, trainer="{fsdp: false}"), [], str(tmp_path))
    st = wait_for(client, name, "a first step", lambda s: s.get("version", 0) >= 1, poll_s=QUICK_POLL_S)
    out_dir = Path(st["output_dir"])

    # two trainer ranks need fsdp: refused with the spec's own reason, nothing recorded for the driver
    with pytest.raises(
        ApiError, match=r"cannot run with trainers 2: more than one trainer rank needs fsdp.*HTTP 422"
    ):
        client.scale(name, None, 2)
    assert client.get(name)["desired"]["trainers"] == 1
    assert cli.main(["scale", name, "--trainers", "2", "--home", str(home)]) == 1
    assert "fsdp" in capsys.readouterr().err
    assert client.get(name)["state"] == "running"

    # stop --no-checkpoint: says nothing is saved, and the job's final status says so too
    assert cli.main(["stop", name, "--no-checkpoint", "--home", str(home)]) == 0
    assert "no checkpoint is written" in capsys.readouterr().out
    st = wait_for(client, name, "the stop", lambda s: s["state"] in ENDED, ended_ok=True, poll_s=QUICK_POLL_S)
    assert st["state"] == "stopped", st
    assert st["checkpoint"] == "" and "no checkpoint written at the stop" in st["note"], st
    assert not (out_dir / "checkpoints").exists()

    # a stop on an ended job says so instead of "stop requested"
    again = client.stop(name)
    assert again["stop"] is False and "already ended (stopped" in again["message"], again
    assert cli.main(["stop", name, "--force", "--home", str(home)]) == 0
    assert "already ended" in capsys.readouterr().out


def test_cluster_down_stops_jobs_with_a_checkpoint_and_a_restart_leaves_none_stuck(
    home, client, tmp_path, tiny_model_dir
):
    name = "longrun"  # checkpoint_every is 0 (the default): only the stops write checkpoints
    spec = spec_text(tiny_model_dir, name)
    client.submit(spec, [], str(tmp_path))
    st = wait_for(client, name, "first steps", lambda s: s.get("version", 0) >= 2, poll_s=QUICK_POLL_S)
    out_dir = Path(st["output_dir"])
    trainer_log = out_dir / "logs" / "trainer-0.log"

    # a job that does not end in time: down refuses, names it and --force, and stops nothing
    with pytest.raises(RuntimeError, match=rf"job\(s\) {name} did not stop.*cluster down --force"):
        cluster.down(home, job_timeout_s=0)
    assert all(cluster.status(home).values())

    # down waits for the job's stop (requested above) and its checkpoint, then stops the services, and
    # answers which jobs it stopped
    stopped = cluster.down(home)
    assert list(stopped) == [name] and stopped[name]["state"] == "stopped", stopped
    assert not any(cluster.status(home).values())
    cluster.up(home, start_prometheus=False)
    st = client.get(name)
    assert st["state"] == "stopped", st
    v1, ckpt1 = st["checkpoint_version"], Path(st["checkpoint"])
    assert v1 >= st["version"] >= 2 and ckpt1 == out_dir / "checkpoints" / f"step-{v1:08d}", st
    assert (ckpt1 / "trainer_state.json").exists() and f"version {v1}" in st["note"]
    assert "stop requested (cluster down)" in (out_dir / "logs" / "driver.log").read_text()

    # the same name resumes from it
    client.submit(spec, ["trainer.resume_from=latest"], str(tmp_path))
    wait_for(client, name, "resumed steps", lambda s: s.get("version", 0) >= v1 + 2, poll_s=QUICK_POLL_S)
    assert f"resumed from {ckpt1} " in trainer_log.read_text()
    client.checkpoint(name)
    wait_for(
        client,
        name,
        "a requested checkpoint",
        lambda s: _latest(out_dir) not in (None, ckpt1),
        poll_s=QUICK_POLL_S,
    )
    ckpt2 = _latest(out_dir)
    wait_for(
        client,
        name,
        "a step after it",
        lambda s: s["version"] > int(ckpt2.name.split("-")[1]),
        poll_s=QUICK_POLL_S,
    )

    # a forced cluster restart kills the driver without a checkpoint: the job is marked interrupted at
    # the control API's start, with the reason and its latest checkpoint, instead of `running` forever
    assert list(cluster.down(home, force=True)) == [name]  # the job it killed
    cluster.up(home, start_prometheus=False)
    listed = {j["name"]: j["state"] for j in client.list()}
    assert listed == {"plain": "stopped", name: "interrupted"}, listed
    st = client.get(name)
    assert st["state"] == "interrupted" and "driver is gone" in st["error"], st
    assert st["checkpoint"] == str(ckpt2) and str(ckpt2) in st["error"], st
    out = client.stop(name)
    assert (
        out["stop"] is False
        and "already ended (interrupted" in out["message"]
        and str(ckpt2) in out["message"]
    )
    assert client.stop(name, force=True)["stop"] is False  # not Ray's 404 as a 503

    # and the name is free again: resubmitted, it resumes from that checkpoint
    client.submit(spec, ["trainer.resume_from=latest"], str(tmp_path))
    v2 = int(ckpt2.name.split("-")[1])
    wait_for(
        client, name, "steps after the second resume", lambda s: s.get("version", 0) > v2, poll_s=QUICK_POLL_S
    )
    assert f"resumed from {ckpt2} " in trainer_log.read_text()
    client.stop(name)
    st = wait_for(
        client, name, "the last stop", lambda s: s["state"] in ENDED, ended_ok=True, poll_s=QUICK_POLL_S
    )
    assert st["state"] == "stopped" and st["checkpoint_version"] == st["version"], st


def _latest(out_dir: Path) -> Path | None:
    from slipstream.job.store import latest_checkpoint

    ck = latest_checkpoint(out_dir / "checkpoints")
    return Path(ck["path"]) if ck else None
