"""What the operator reads, on one real cluster (Redis, Ray head, control API): readable scale errors,
`buffer stats` through the cluster, a job's status while it builds its model and while it scales, its pools
after a stop, `logs` after a cluster restart (driver.log), and `slipstream rm` (with and without --purge)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import http_calls
import redis
from cluster_helpers import JOB_TIMEOUT_S, wait_for

from slipstream import cli
from slipstream.cluster import services as cluster


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
    raw = http_calls.get(
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
