"""Nodes that join, fail and leave while a job runs (network namespaces: tests/harness/netns.py). One job,
its trainer on node A, its engines sized to one per node (`generators.cpus_per_engine` = a node's CPUs):

1. node B joins after the job started, and `slipstream scale --generators 2` starts an engine there, which
   gets the current weights over the bus and takes rollouts;
2. every process of node B is SIGKILLed (its engine, and its raylet): the job goes on with node A's engine,
   the lost engine's replacement waits for a node with room, saying so in the status (no retry loop), and
   starts on node B when it joins again;
3. `scale --generators 1` takes the engine on node B away after its rollout worker finished its groups;

and the books balance at the end: produced = consumed + dropped + unread + pending, no duplicates."""

from __future__ import annotations

import time

from multinode_cluster import NODE_B_RESOURCE, NODE_B_UNITS, Cluster
from test_two_nodes import JOB_TIMEOUT_S, _pids_named, _status, _wait, stop_with_balanced_books


def _until(what: str, cond, timeout_s: float = JOB_TIMEOUT_S):
    """Poll `cond` until it returns something truthy (returned), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(2)
    return got


def _engines(cluster: Cluster, name: str) -> dict[str, dict]:
    """The job's registered engines (live and joining), each with what its public /metrics says."""
    code = f"""
import json, re, urllib.request, redis
from slipstream.cluster.state import load_info
from weight_bus.registry import EngineRegistry
info = load_info({str(cluster.home)!r})
reg = EngineRegistry(redis.Redis.from_url(info.redis_url), {name!r})
out = {{}}
for state, urls in (("live", reg.live()), ("joining", reg.joining())):
    for url in urls:
        m = {{"state": state}}
        try:
            text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            for key, metric in (("version", "slipstream_engine_weight_version"), ("requests", "sglang:num_requests_total")):
                found = re.search("^" + re.escape(metric) + r"[{{ ].*?([0-9.e+]+)$", text, re.M)
                m[key] = float(found.group(1)) if found else None
        except OSError as e:
            m["error"] = repr(e)
        out[url] = m
print(json.dumps(out))
"""
    return cluster.python(cluster.a, code)


def _on(engines: dict[str, dict], address: str) -> list[str]:
    return [u for u in engines if f"//{address}:" in u]


def _alive(cluster: Cluster) -> set[str]:
    return {n["address"] for n in cluster.alive_nodes()}


def test_nodes_join_fail_and_leave_while_a_job_runs(cluster, tiny_model_dir, tmp_path):
    a, b = cluster.a, cluster.b
    b.kill_all()  # node B leaves (its raylet SIGTERMed) before the job starts
    _until("Ray to see node B gone", lambda: _alive(cluster) == {a.address})
    cpus = int(next(n for n in cluster.alive_nodes())["resources"]["CPU"])
    name = "comego"
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"""
name: {name}
model: {{path: {tiny_model_dir}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1, cpus_per_engine: {cpus}}}
trainer: {{resources: {{"node:{a.address}": 0.01}}}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 1}}
"""
    )
    assert f"submitted job {name}" in cluster.cli("submit", str(spec))
    _wait(cluster, name, "weight versions", lambda s: s.get("version", 0) >= 2)
    assert _on(_engines(cluster, name), a.address), "the first engine is not on node A"

    # 1. node B joins mid-job (the line `cluster up` printed), and the job scales onto it
    started = time.monotonic()
    cluster.join(b, {NODE_B_RESOURCE: NODE_B_UNITS}, num_cpus=cpus)
    _until("Ray to see node B", lambda: _alive(cluster) == {a.address, b.address})
    assert "generators" in cluster.cli("scale", name, "--generators", "2")
    v = _status(cluster, name)["version"]
    late = _until("an engine on node B", lambda: _on(_engines(cluster, name), b.address))[0]
    engines = _until(
        "the engine on node B to get the current weights and serve rollouts",
        lambda: (
            (e := _engines(cluster, name))[late]["state"] == "live"
            and (e[late].get("version") or 0) >= v
            and (e[late].get("requests") or 0) > 0
            and e
        ),
    )
    print(f"node B joined and served rollouts after {time.monotonic() - started:.0f} s: {engines}")
    assert _pids_named(b.listeners(), "EngineActor"), "no engine process on node B"
    st = _wait(cluster, name, "the pool of 2", lambda s: s["pools"]["generators"] == 2)

    # 2. node B fails: every process in it (engine, rollout worker if any, raylet) SIGKILLed
    lost = time.monotonic()
    b.kill_all(hard=True)
    st = _wait(
        cluster,
        name,
        "the lost engine's replacement to wait for room",
        lambda s: any("waiting for a node with room" in w for w in (s.get("waiting") or {}).values()),
    )
    print(f"node B lost; after {time.monotonic() - lost:.0f} s the status says: {st['waiting']}")
    assert list(st["waiting"]) == [late], st["waiting"]  # the lost engine's URL
    assert st["restarts"]["engines"] == 1, st["restarts"]
    v = st["version"]
    st = _wait(cluster, name, "training on node A's engine", lambda s: s.get("version", 0) >= v + 3)
    assert st["restarts"]["engines"] == 1, f"the replacement was retried: {st['restarts']}"
    assert _on(_engines(cluster, name), a.address) and not _on(_engines(cluster, name), b.address)

    # ... and joins again: the queued replacement starts there
    cluster.join(b, {NODE_B_RESOURCE: NODE_B_UNITS}, num_cpus=cpus)
    st = _wait(
        cluster,
        name,
        "the replacement to start on node B",
        lambda s: s.get("waiting") == {},
    )
    back = _until(
        "the replacement on node B to serve rollouts",
        lambda: [
            u for u, e in _engines(cluster, name).items() if b.address in u and (e.get("requests") or 0) > 0
        ],
    )
    print(f"the replacement {back} serves rollouts: {st['failure']}")
    assert st["restarts"]["engines"] == 1, st["restarts"]

    # 3. scaling down takes node B's engine away once its rollout worker finished its groups
    cluster.cli("scale", name, "--generators", "1")
    _until("node B's engine to go", lambda: not _on(_engines(cluster, name), b.address))
    st = _wait(cluster, name, "the pool of 1", lambda s: s["pools"]["generators"] == 1)
    log = (cluster.home / "jobs" / name / "logs" / "driver.log").read_text()
    assert "removed 1 rollout workers (they finished their groups" in log, log[-3000:]

    stop_with_balanced_books(cluster, name)
