"""Slipstream across two nodes (network namespaces on one box: tests/harness/netns.py): the cluster that
`cluster up --host` starts on node A is reachable from node B wherever B must dial it, and a job whose
engines and rollout workers run on B (`generators.resources`) and whose trainer runs on A
(`trainer.resources`) learns over the cross-node weight bus and the head's Redis, its books balanced."""

from __future__ import annotations

import json
import shutil
import sys
import time

from multinode_cluster import ENV, NODE_B_RESOURCE, Cluster
from netns import Listener, Node

JOB_TIMEOUT_S = 300.0
"""How long the job may take to reach a state (generous: a loaded 2-core CI box); never a measured value."""
ENDED = ("succeeded", "failed", "stopped", "interrupted")


def unreachable(node: Node, listeners: list[Listener]) -> list[Listener]:
    """Listeners that another node cannot dial: on loopback only (no socket on the same port bound to the
    node's address or to every interface)."""
    reachable = {x.port for x in listeners if not x.loopback_only}
    return [x for x in listeners if x.loopback_only and x.port not in reachable]


def dial(cluster: Cluster, src: Node, dst: Node, ports: list[int]) -> dict[str, str]:
    """Open a TCP connection from node `src` to each of `dst`'s `ports`: {port: error} of those that fail."""
    code = f"""
import json, socket
bad = {{}}
for p in {sorted(set(ports))!r}:
    try:
        socket.create_connection(({dst.address!r}, p), timeout=5).close()
    except OSError as e:
        bad[p] = repr(e)
print(json.dumps(bad))
"""
    return cluster.python(src, code)


def show(node: Node, listeners: list[Listener]) -> str:
    return "\n".join(f"  {node.name} {x.address}:{x.port} {x.process} (pid {x.pid})" for x in listeners)


def test_node_b_joined_with_the_printed_line(cluster):
    assert f"ray start --address {cluster.a.address}:" in cluster.up_output, cluster.up_output
    alive = {n["address"]: n["resources"] for n in cluster.alive_nodes()}
    assert set(alive) == {cluster.a.address, cluster.b.address}, alive
    assert alive[cluster.b.address].get(NODE_B_RESOURCE, 0) > 0


def test_what_node_a_serves_is_reachable_from_node_b(cluster):
    listening = cluster.a.listeners()
    print("node A listens on:\n" + show(cluster.a, listening))
    assert not unreachable(cluster.a, listening), "loopback only on A:\n" + show(
        cluster.a, unreachable(cluster.a, listening)
    )
    info = json.loads((cluster.home / "cluster.json").read_text())
    ports = info["ports"]
    gcs = {x.address for x in listening if x.port == ports["ray"]}
    assert gcs and gcs <= {cluster.a.address, "*"}, gcs  # Ray binds its GCS to every interface
    for service in ("redis", "api"):  # Slipstream's own: every socket of theirs on the operator's address
        pids = {x.pid for x in listening if x.port == ports[service]}
        on = {x.address for x in listening if x.pid in pids}
        assert pids and on == {cluster.a.address}, (service, show(cluster.a, listening))
    failed = dial(cluster, cluster.b, cluster.a, [x.port for x in listening if not x.loopback_only])
    assert not failed, f"node B cannot dial node A's ports: {failed}"


def test_every_credential_applies_from_node_b(cluster):
    """From another node, each service of node A wants its credential: the control API its token, Redis a
    user and password (the control plane's user reaches only what its ACL allows), Ray its token."""
    info = json.loads((cluster.home / "cluster.json").read_text())
    secrets = cluster.secrets
    code = f"""
import json, subprocess, sys
import httpx, redis
a, ports, tok = {cluster.a.address!r}, {info["ports"]!r}, {secrets["api_token"]!r}
out = {{}}
api = f"http://{{a}}:{{ports['api']}}/jobs"
out["api_none"] = httpx.get(api, timeout=10).status_code
out["api_wrong"] = httpx.get(api, headers={{"Authorization": "Bearer wrong"}}, timeout=10).status_code
out["api_token"] = httpx.get(api, headers={{"Authorization": f"Bearer {{tok}}"}}, timeout=10).status_code
def redis_says(**kw):
    try:
        return str(redis.Redis(host=a, port=ports["redis"], socket_timeout=10, **kw).ping())
    except redis.RedisError as e:
        return type(e).__name__
out["redis_none"] = redis_says()
out["redis_wrong"] = redis_says(username="slipstream", password="wrong")
ray_code = "import ray; ray.init(address=sys.argv[1], logging_level='ERROR'); print('joined')"
# Ray's client tries the GCS about once a second, 20 times by default, before it gives up; both cases get the
# same 5 tries: the one with the token joins within them, so the one without is refused for the token alone
bare = {{k: v for k, v in __import__("os").environ.items() if not k.startswith("RAY_AUTH")}}
bare["RAY_gcs_server_port_wait_time_s"] = "5"
procs = {{case: subprocess.Popen([sys.executable, "-c", "import sys; " + ray_code, f"{{a}}:{{ports['ray']}}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
         for case, env in (("ray_none", bare), ("ray_token", {{**bare, **{cluster.ray_env!r}}}))}}  # side by side
for case, p in procs.items():
    try:
        stdout, stderr = p.communicate(timeout=90)
        out[case] = "joined" if "joined" in stdout else "refused: " + (stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        p.kill()
        out[case] = "timed out"
print(json.dumps(out))
"""
    out = cluster.python(cluster.b, code, timeout_s=150)
    print(out)
    assert (out["api_none"], out["api_wrong"], out["api_token"]) == (401, 401, 200), out
    assert out["redis_none"] in ("AuthenticationError", "ResponseError"), out
    assert out["redis_wrong"] in ("AuthenticationError", "ResponseError"), out
    assert out["ray_none"].startswith("refused") and out["ray_token"] == "joined", out


STATUS = """
import os, urllib.request
ask = urllib.request.Request(os.environ["STATUS_URL"], headers={"Authorization": "Bearer " + os.environ["API_TOKEN"]})
print(urllib.request.urlopen(ask, timeout=30).read().decode())
"""
"""The control API's GET /jobs/<name>, what `slipstream status` reads, with the standard library alone: the
tests poll it every few seconds, and a poller importing the CLI's client costs 0.58 CPU-s a call, 0.07 so."""


def _status(cluster: Cluster, name: str) -> dict:
    from slipstream.cluster.state import load_info

    info = load_info(str(cluster.home))
    env = {"STATUS_URL": f"{info.api_url}/jobs/{name}", "API_TOKEN": info.api_token}
    return cluster.python(cluster.a, STATUS, env=env)


def _wait(cluster: Cluster, name: str, what: str, cond, ended_ok: bool = False) -> dict:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        st = _status(cluster, name)
        if cond(st):
            return st
        assert ended_ok or st.get("state") not in ENDED, (what, st)
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(3)


def _books(cluster: Cluster, name: str) -> dict:
    code = f"""
import json, redis
from replay_buffer import ReplayBuffer
from slipstream.cluster.state import load_info
info = load_info({str(cluster.home)!r})
print(json.dumps(ReplayBuffer(redis.Redis.from_url(info.redis_url), {name!r}).stats()))
"""
    return cluster.python(cluster.a, code)


def stop_with_balanced_books(cluster: Cluster, name: str) -> tuple[dict, dict]:
    """`slipstream stop` the job, wait for it to end stopped, and check its books: nothing duplicated or
    dead-lettered, produced = consumed + dropped + unread + pending, two groups per step. (status, books)"""
    cluster.cli("stop", name)
    st = _wait(cluster, name, "the stop", lambda s: s.get("state") in ENDED, ended_ok=True)
    assert st["state"] == "stopped", st
    books = _books(cluster, name)
    print(f"stopped at version {st['version']}: {books}; failure: {json.dumps(st.get('failure'))}")
    assert books["duplicates"] == 0 and books["dead_letter"] == 0
    assert (
        books["produced"] == books["consumed"] + books["dropped_stale"] + books["unread"] + books["pending"]
    )
    assert books["consumed"] == 2 * books["steps"]
    return st, books


def _pids_named(listeners: list[Listener], actor: str) -> set[int]:
    """Processes of Ray actor class `actor` (`ss` shows a process name cut to 15 characters)."""
    return {x.pid for x in listeners if x.process.startswith(f"ray::{actor}"[:15])}


def _submit_across(cluster, tmp_path, name: str, model) -> None:
    """A job whose engine and rollout worker run on node B and whose trainer runs on node A."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"""
name: {name}
model: {{path: {model}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1, resources: {{{NODE_B_RESOURCE}: 1}}}}
trainer: {{resources: {{"node:{cluster.a.address}": 0.01}}}}
algorithm: {{groups_per_step: 2, total_steps: 100000, lr: 1.0e-3}}
buffer: {{max_staleness: 1}}
"""
    )
    assert f"submitted job {name}" in cluster.cli("submit", str(spec))


def test_a_job_with_generators_on_node_b_and_the_trainer_on_node_a(cluster, tiny_model_dir, tmp_path):
    name = "across"
    _submit_across(cluster, tmp_path, name, tiny_model_dir)
    st = _wait(cluster, name, "weight versions", lambda s: s.get("version", 0) >= 3)
    assert st["state"] == "running" and st.get("reward_mean") is not None, st

    # where each process runs, and that what the other node dials is reachable
    on_a, on_b = cluster.a.listeners(), cluster.b.listeners()
    print("during the job:\n" + show(cluster.a, on_a) + "\n" + show(cluster.b, on_b))
    engines = [x for x in on_b if x.pid in _pids_named(on_b, "EngineActor")]
    trainers = _pids_named(on_a, "TrainerActor")
    assert engines and not _pids_named(on_a, "EngineActor"), "the engine is not on node B"
    assert _pids_named(on_b, "RolloutActor") and not _pids_named(on_a, "RolloutActor")
    assert trainers and not _pids_named(on_b, "TrainerActor"), "the trainer is not on node A"
    # node B's processes are all dialled from A (engines by the trainer and the driver, metrics by the
    # head's Prometheus); on A, only the driver's metrics and the one-rank trainer's own group store stay
    # on loopback: nothing on B dials them
    assert not unreachable(cluster.b, on_b), "loopback only on B:\n" + show(
        cluster.b, unreachable(cluster.b, on_b)
    )
    private = trainers | {st["driver"]["pid"]}
    local = [x for x in unreachable(cluster.a, on_a) if x.pid not in private]
    assert not local, "loopback only on A:\n" + show(cluster.a, local)
    assert {x.address for x in engines if not x.wildcard} == {cluster.b.address}, show(cluster.b, engines)
    assert not dial(cluster, cluster.a, cluster.b, [x.port for x in engines])
    # and the engine wants the job's key from another node: nothing of the model's without it
    asked = cluster.python(
        cluster.a,
        f"""
import json, httpx
out = {{}}
for p in {sorted({x.port for x in engines})!r}:
    try:
        r = httpx.get("http://{cluster.b.address}:%d/get_model_info" % p, timeout=10)
        out[p] = [r.status_code, "model_path" in r.text]
    except httpx.HTTPError as e:
        out[p] = [type(e).__name__, False]
print(json.dumps(out))
""",
    )
    assert any(code == 401 for code, _ in asked.values()), asked
    assert not any(leaked for _, leaked in asked.values()), asked
    # the trainer's other ports: the weight bus's store and gloo transport, which the engine dials
    bus = [x.port for x in on_a if x.pid in trainers and not x.loopback_only]
    assert bus and not dial(cluster, cluster.b, cluster.a, bus)

    v0 = st["version"]
    st = _wait(cluster, name, "more versions", lambda s: s.get("version", 0) >= v0 + 2)
    _, books = stop_with_balanced_books(cluster, name)
    assert books["steps"] >= v0 + 2
    log = (cluster.home / "jobs" / name / "logs" / "driver.log").read_text()
    assert "Traceback" not in log, log[-4000:]


def test_a_node_without_the_model_gets_its_files_from_the_head_and_its_weights_over_the_bus(
    cluster, tiny_model_dir, tmp_path
):
    """The model is in a directory only node A's processes can read: the engine and rollout worker on
    node B start from the config and tokenizer the driver shipped through Redis, the engine with random
    weights, taking rollouts only once the weight bus gave it the trainer's; the job learns and its books
    balance. A trainer rank placed on node B would still need the model there, and says so."""
    model = cluster.private / "model"
    shutil.copytree(tiny_model_dir, model)
    name = "blind"
    _submit_across(cluster, tmp_path, name, model)
    st = _wait(cluster, name, "weight versions", lambda s: s.get("version", 0) >= 3, ended_ok=True)
    assert st["state"] == "running" and st.get("reward_mean") is not None, st
    logs = cluster.home / "jobs" / name / "logs"
    engine_log = (logs / "engine-0.log").read_text()
    assert f"model.path {model} is not on node {cluster.b.address}" in engine_log, engine_log[-3000:]
    assert "starts with random weights" in engine_log
    rollout_log = (logs / "rollout-0.log").read_text()
    assert f"model.path {model} is not on node {cluster.b.address}" in rollout_log, rollout_log[-3000:]
    _, books = stop_with_balanced_books(cluster, name)
    assert books["steps"] >= 3

    name = "blind-trainer"
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"""
name: {name}
model: {{path: {model}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 1, num_workers: 1, resources: {{"node:{cluster.a.address}": 0.01}}}}
trainer: {{resources: {{{NODE_B_RESOURCE}: 1}}}}
algorithm: {{groups_per_step: 2, total_steps: 3, lr: 1.0e-3}}
"""
    )
    assert f"submitted job {name}" in cluster.cli("submit", str(spec))
    st = _wait(cluster, name, "the job's end", lambda s: s.get("state") in ENDED, ended_ok=True)
    assert st["state"] == "failed", st
    assert f"model.path {model} does not exist on node {cluster.b.address}" in st["error"], st["error"]
    assert "a trainer rank loads it" in st["error"], st["error"]


def test_a_cluster_on_every_interface_hands_jobs_an_address_other_nodes_reach(cluster):
    """`cluster up --host 0.0.0.0`: the URLs jobs get (Redis's) name the host's address on its default
    route, not 127.0.0.1, which an actor on another node would dial on itself."""
    code = "import json; from slipstream.cluster.state import connect_host; print(json.dumps(connect_host('0.0.0.0')))"
    assert cluster.python(cluster.a, code) == "127.0.0.1"  # no default route: nothing better to say
    cluster.a.run(["ip", "route", "add", "default", "dev", "eth0"])
    try:
        assert cluster.python(cluster.a, code) == cluster.a.address
    finally:
        cluster.a.run(["ip", "route", "del", "default", "dev", "eth0"])


def test_resources_no_node_offers_fail_the_job_at_start_and_bad_ones_at_submit(
    cluster, tiny_model_dir, tmp_path
):
    spec = tmp_path / "nowhere.yaml"
    text = f"""
name: nowhere
model: {{path: {tiny_model_dir}}}
generators: {{resources: {{node_c: 1}}}}
algorithm: {{total_steps: 3}}
"""
    spec.write_text(text.replace("node_c: 1", "CPU: 1"))
    refused = cluster.a.run(
        [sys.executable, "-m", "slipstream.cli", "submit", str(spec), "--home", str(cluster.home)],
        env=ENV,
        check=False,
    )
    assert refused.returncode == 1 and "$.generators.resources.CPU" in refused.stderr, refused
    spec.write_text(text)
    assert "submitted job nowhere" in cluster.cli("submit", str(spec))
    st = _wait(cluster, "nowhere", "the job's end", lambda s: s.get("state") in ENDED, ended_ok=True)
    assert (
        st["state"] == "failed" and "generators.resources: no node of the Ray cluster has" in st["error"]
    ), st
