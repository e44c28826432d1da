"""A scale up to more engines than the Ray cluster has room for, on a real cluster: the job's engines and
rollout workers each take 0.4 of the head's `node:__internal_head__` resource (1 in all), so a second
engine cannot be placed. `scale --generators 2` returns at once, the driver's loop goes on (versions
advance, the status is `scaling` and says what the new engine waits for), a scale back to 1 cancels it (its Ray actor
is gone), a scale to 2 again and a stop during that wait end the job `stopped` with its books balanced."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import http_calls
import redis
from cluster_helpers import ENDED, QUICK_POLL_S, spec_text, wait_for

from replay_buffer import ReplayBuffer
from slipstream.cluster.state import ray_env

ROOM = '{"node:__internal_head__": 0.4}'
"""Each engine's and rollout worker's share of the head (1): an engine and its worker fit, a second
engine does not."""

ENGINE_ACTORS = """
import json, sys
import ray
from ray._private.state import actors

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
states = [a["State"] for a in actors().values() if a["ActorClassName"].endswith("EngineActor")]
print(json.dumps(sorted(s for s in states if s != "DEAD")))
"""


def _engine_actors(info) -> list[str]:
    """The states of the cluster's engine actors that are not dead (alive, or queued for room)."""
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_ACTORS, info.ray_address],
        env={**os.environ, **ray_env(info)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _driver_metrics(info, name: str) -> str:
    """The job driver's /metrics, where Prometheus finds it (the job's metrics targets in Redis)."""

    from replay_buffer.keys import JobKeys

    r = redis.Redis.from_url(info.redis_url)
    address = r.hget(JobKeys(name).metrics_targets, "driver")
    assert address is not None, r.hgetall(JobKeys(name).metrics_targets)  # a new run once wiped it
    return http_calls.get(f"http://{address.decode()}/metrics", timeout=10).text


def test_a_scale_up_without_room_waits_in_the_background(info, client, tmp_path, tiny_model_dir):
    name = "roomless"
    spec = spec_text(tiny_model_dir, name).replace(
        "generators: {num_engines: 1, num_workers: 1}",
        f"generators: {{num_engines: 1, num_workers: 1, resources: {ROOM}}}",
    )
    client.submit(spec, [], str(tmp_path))
    st = wait_for(client, name, "the first step", lambda s: s.get("version", 0) >= 1, poll_s=QUICK_POLL_S)
    driver_log = Path(st["output_dir"]) / "logs" / "driver.log"

    t0 = time.monotonic()
    client.scale(name, generators=2, trainers=None)
    assert time.monotonic() - t0 < 10  # the request is recorded; the driver does the rest
    st = wait_for(
        client,
        name,
        "the waiting note",
        lambda s: "engine-1" in (s.get("waiting") or {}),
        timeout_s=120,
        poll_s=QUICK_POLL_S,
    )
    note = st["waiting"]["engine-1"]
    assert note.startswith("added by a scale up; it has not started after 1"), note
    assert (
        "waiting for a node with room (it needs {'node:__internal_head__': 0.4}, the cluster has " in note
    ), note
    assert "the job goes on with 1 engines; a scale down cancels it first" in note, note
    assert st["state"] == "scaling" and st["pools"]["generators"] == 1, st
    assert st["scaling"] == "generators 1 -> 2: 1 engine(s) starting", st
    metrics = _driver_metrics(info, name)  # the gauge says the same, for dashboards and alerts
    assert 'slipstream_job_engines{state="waiting"} 1.0' in metrics, metrics
    assert 'slipstream_job_engines{state="running"} 1.0' in metrics, metrics
    v0 = st["version"]  # the loop goes on: the trainer trains on the engine there is
    st = wait_for(
        client, name, "versions while the engine waits", lambda s: s["version"] >= v0 + 2, poll_s=QUICK_POLL_S
    )
    assert "engine-1" in st["waiting"], st

    client.scale(name, generators=1, trainers=None)
    st = wait_for(client, name, "the cancel", lambda s: not s.get("waiting"), poll_s=QUICK_POLL_S)
    assert st["state"] == "running" and st["pools"] == {
        "generators": 1,
        "rollout_workers": 1,
        "trainers": 1,
    }, st
    assert "engine-1 cancelled before it started" in driver_log.read_text()
    assert _engine_actors(info) == ["ALIVE"]  # engine-0; engine-1's actor is gone, not queued
    v0 = st["version"]
    wait_for(client, name, "a version after the cancel", lambda s: s["version"] > v0, poll_s=QUICK_POLL_S)

    client.scale(name, generators=2, trainers=None)  # waits again, and the job is stopped meanwhile
    deadline = time.monotonic() + 60
    while "starting engines ['engine-2'] in the background" not in driver_log.read_text():
        assert time.monotonic() < deadline, driver_log.read_text()[-3000:]
        time.sleep(QUICK_POLL_S)
    client.stop(name)
    st = wait_for(
        client, name, "the stop", lambda s: s.get("state") in ENDED, ended_ok=True, poll_s=QUICK_POLL_S
    )
    assert st["state"] == "stopped", st
    books = ReplayBuffer(redis.Redis.from_url(info.redis_url), name).stats()
    print(f"stopped at version {st['version']}: {books}")
    assert books["duplicates"] == 0 and books["dead_letter"] == 0
    assert (
        books["produced"] == books["consumed"] + books["dropped_stale"] + books["unread"] + books["pending"]
    )
