"""The Kubernetes manifests `slipstream cluster render-kube` writes (slipstream/cluster/kube.py): valid
against Kubernetes' own schemas (kubernetes-validate's bundled OpenAPI schemas, strict: no unknown field)
and KubeRay's RayCluster CRD (its openAPIV3Schema, vendored, unknown fields refused as the API server's
strict field validation does); deploy/kuberay/ is a fresh render; settings reach the output; no secret
value is rendered; every Service port is one its pods listen on; a head pod's HOME works; Redis runs
with the rendered arguments and ACL script.

The vendored schema (tests/deploy/schemas/) is KubeRay v1.7.0's; to refresh it, take the new
ray-operator/config/crd/bases/ray.io_rayclusters.yaml, keep `spec.versions[name=v1].schema.openAPIV3Schema`
with every `description` key removed, and name the tag and commit in its `$comment`."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import http_calls
import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from replay_buffer.redis_server import APP_USER, find_redis_server, job_user, set_job_user
from slipstream.cluster import kube
from slipstream.cluster.kube_home import write_home
from slipstream.cluster.state import load_info

REPO = Path(__file__).resolve().parents[3]
CHECKED_IN = REPO / "deploy" / "kuberay"
SCHEMA = Path(__file__).resolve().parents[2] / "data" / "kuberay-v1.7.0-raycluster.schema.json"
K8S_VERSION = "1.30.0"
"""The Kubernetes version the core kinds are validated against (KubeRay 1.7 supports 1.30 and later)."""


def _render(**kw) -> dict[str, list[dict]]:
    return kube.render(kube.KubeSettings(**kw))


def _docs(rendered: dict[str, list[dict]]) -> list[dict]:
    return [d for docs in rendered.values() for d in docs]


def _strict(schema):
    """The CRD's schema refusing unknown fields where it lists the known ones (kubectl's default field
    validation is Strict since Kubernetes 1.27, for custom resources too)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validate(doc: dict) -> None:
    if doc["apiVersion"] == "ray.io/v1":
        jsonschema.validate(doc, _strict(json.loads(SCHEMA.read_text())))
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _pods(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(labels, pod spec) of every pod template: the StatefulSet's and each Ray group's."""
    out = []
    for d in docs:
        if d["kind"] == "StatefulSet":
            t = d["spec"]["template"]
            out.append((t["metadata"]["labels"], t["spec"]))
        if d["kind"] == "RayCluster":
            head = d["spec"]["headGroupSpec"]["template"]
            labels = {"ray.io/cluster": d["metadata"]["name"], "ray.io/node-type": "head"}
            out.append(({**head["metadata"]["labels"], **labels}, head["spec"]))
            for g in d["spec"]["workerGroupSpecs"]:
                out.append(
                    (
                        {"ray.io/cluster": d["metadata"]["name"], "ray.io/group": g["groupName"]},
                        g["template"]["spec"],
                    )
                )
    return out


# ---------------------------------------------------------------- schemas


def test_the_vendored_crd_schema_is_the_one_named_and_small():
    schema = json.loads(SCHEMA.read_text())
    assert "v1.7.0" in schema["$comment"] and "59d663aeec13760646da3db9c1cf8cfe883e30b7" in schema["$comment"]
    assert SCHEMA.stat().st_size < 1_000_000
    assert {"headGroupSpec", "workerGroupSpecs", "authOptions"} <= set(
        schema["properties"]["spec"]["properties"]
    )


@pytest.mark.parametrize(
    "settings",
    [{}, {"storage_class": "nfs", "tool_modules": [], "input_roots": ["/data/in"], "engine_replicas": 3}],
    ids=["defaults", "other-settings"],
)
def test_every_manifest_is_valid_against_its_schema(settings):
    docs = _docs(_render(**settings))
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "PersistentVolumeClaim",
        "RayCluster",
    }
    for doc in docs:
        _validate(doc)


def test_the_validators_refuse_what_they_should():
    """Each validator catches a wrong type and an unknown field, so a pass above means something."""
    rendered = _render()
    ray = json.loads(json.dumps(rendered["raycluster"][0]))
    ray["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _validate(ray)
    ray = json.loads(json.dumps(rendered["raycluster"][0]))
    ray["spec"]["headGroupSpec"]["rayStartParam"] = {}  # a typo
    with pytest.raises(jsonschema.ValidationError):
        _validate(ray)
    sts = json.loads(json.dumps(_by_kind(_docs(rendered), "StatefulSet")[0]))
    sts["spec"]["template"]["spec"]["containers"][0]["port"] = 6380  # a typo of `ports`
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(sts)


# ---------------------------------------------------------------- the checked-in render


def test_deploy_kuberay_is_a_fresh_render(tmp_path):
    """deploy/kuberay/ is what `slipstream cluster render-kube` writes with its defaults (re-render it
    with `.venv/bin/slipstream cluster render-kube` from the repository root after changing kube.py)."""
    out = tmp_path / "kuberay"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slipstream",
            "cluster",
            "render-kube",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    fresh = {p.name: p.read_text() for p in out.iterdir()}
    assert set(fresh) == set(kube.FILES.values())
    checked_in = {p.name: p.read_text() for p in CHECKED_IN.glob("*.yaml")}
    assert checked_in == fresh, "deploy/kuberay/ is stale: run `slipstream cluster render-kube`"


# ---------------------------------------------------------------- settings, secrets, ports


def test_settings_flow_into_the_manifests():
    ports = {"redis": 7001, "ray": 7002, "dashboard": 7003, "api": 7004}
    rendered = _render(
        namespace="rl",
        name="rlc",
        image="registry.example/slipstream:1.2",
        secret_name="rl-creds",
        ports=ports,
        redis_maxmemory="9gb",
        tool_modules=["my_tools"],
        input_roots=["/data/models"],
        engine_gpus=2,
        trainer_replicas=4,
    )
    docs = _docs(rendered)
    text = yaml.safe_dump_all(docs)
    assert all(d["metadata"].get("namespace", "rl") == "rl" for d in docs)
    ray = rendered["raycluster"][0]
    assert ray["metadata"]["name"] == "rlc" and ray["spec"]["authOptions"]["secretName"] == "rl-creds"
    containers = [c for _, pod in _pods(docs) for c in pod["containers"]]
    assert {c["image"] for c in containers if c["name"] != "redis"} == {"registry.example/slipstream:1.2"}
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for c in containers
        for e in c.get("env", [])
        if "valueFrom" in e
    }
    assert refs == {"rl-creds"}
    assert "--maxmemory\n" in "\n".join(kube.redis_args(kube.KubeSettings(redis_maxmemory="9gb"))) + "\n"
    assert "9gb" in text and "2gb" not in text
    api = kube.api_command(
        kube.KubeSettings(tool_modules=["my_tools"], input_roots=["/data/models"], ports=ports)
    )
    assert "--tool-modules my_tools" in api and "--input-root /data/models" in api and "--port 7004" in api
    state = json.loads(rendered["api"][0]["data"]["cluster.json"])
    assert (
        state["ports"]["redis"] == 7001
        and state["redis_host"] == "rlc-redis"
        and state["host"] == "rlc-head-svc"
    )
    assert state["tool_modules"] == ["my_tools"] and state["input_roots"] == ["/data/models"]
    engines, trainers = ray["spec"]["workerGroupSpecs"]
    assert engines["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert trainers["replicas"] == 4
    assert engines["resources"] == {kube.ENGINE_RESOURCE: kube.RESOURCE_UNITS}
    assert trainers["resources"] == {kube.TRAINER_RESOURCE: kube.RESOURCE_UNITS}


def test_the_cli_takes_cluster_ups_settings(tmp_path):
    """render-kube and cluster up share their settings' flags (slipstream/cli/settings.py)."""
    from slipstream.cli import _parser

    out = tmp_path / "k"
    args = _parser().parse_args(
        [
            "cluster",
            "render-kube",
            "--out",
            str(out),
            "--api-port",
            "9999",
            "--builtin-tools-only",
            "--redis-maxmemory",
            "3gb",
            "--image",
            "img:1",
            "--secret-name",
            "s1",
        ]  # fmt: skip
    )
    from slipstream.cli import kube as kube_cli

    assert kube_cli.main(args) == 0
    ray = yaml.safe_load((out / kube.FILES["raycluster"]).read_text().split("\n", 3)[3])
    api = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    assert api["ports"] == [{"name": "api", "containerPort": 9999}]
    assert "--tool-modules '' " in api["command"][2]  # builtin tools only, quoted for sh
    up = _parser().parse_args(["cluster", "up", "--api-port", "9999", "--builtin-tools-only"])
    assert up.api_port == 9999 and up.builtin_tools_only


def test_no_secret_value_is_rendered():
    """Every credential variable comes from the Secret, none is a literal; a head pod's HOME made from
    the Secret's values holds them, the manifests never do."""
    docs = _docs(_render())
    for _, pod in _pods(docs):
        for c in pod.get("initContainers", []) + pod["containers"]:
            for name, e in _env(c).items():
                if re.search(r"TOKEN|PASSWORD|AUTH$", name):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (c["name"], name)
    text = yaml.safe_dump_all(docs)
    assert not re.search(r"(?m)^\s*requirepass|--requirepass|>[A-Za-z0-9]{16,}|#[0-9a-f]{64}", text)
    assert "kind: Secret\n" not in text


def test_every_service_port_is_one_its_pods_listen_on():
    s = kube.KubeSettings(ports={"redis": 7001, "api": 7004, "ray": 7002})
    rendered = kube.render(s)
    docs = _docs(rendered)
    pods = _pods(docs)
    for svc in _by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matching = [pod for labels, pod in pods if sel.items() <= labels.items()]
        assert len(matching) == 1, svc["metadata"]["name"]
        named = {p["name"]: p["containerPort"] for c in matching[0]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert named[port["targetPort"]] == port["port"], (svc["metadata"]["name"], port)
    # ... and what the processes are told to listen on is that port
    redis_ports = {
        p["containerPort"]
        for _, pod in pods
        for c in pod["containers"]
        if c["name"] == "redis"
        for p in c["ports"]
    }
    args = kube.redis_args(s)
    assert redis_ports == {int(args[args.index("--port") + 1])} == {7001}
    head = rendered["raycluster"][0]["spec"]["headGroupSpec"]
    params = head["rayStartParams"]
    ray_ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ray_ports == {
        "gcs-server": int(params["port"]),
        "dashboard": int(params["dashboard-port"]),
        "client": int(params["ray-client-server-port"]),
        "metrics": int(params["metrics-export-port"]),
    }
    assert ray_ports["gcs-server"] == 7002 and params["dashboard-host"] == "0.0.0.0"
    assert "--port 7004" in kube.api_command(s) and "--host 0.0.0.0" in kube.api_command(s)
    # the addresses a pod's HOME hands out are the Services' and the ports they serve
    state = json.loads(rendered["api"][0]["data"]["cluster.json"])
    assert state["ports"]["redis"] == 7001 and state["ports"]["ray"] == 7002 and state["ports"]["api"] == 7004
    prom = yaml.safe_load(rendered["prometheus"][0]["data"]["prometheus.yml"])
    control = next(j for j in prom["scrape_configs"] if j["job_name"] == "slipstream-control")
    assert control["static_configs"][0]["targets"] == ["slipstream-api.slipstream.svc:7004"]


def test_a_head_pods_home_is_what_the_control_plane_reads(tmp_path):
    s = kube.KubeSettings(ports={"redis": 7001})
    state_file = tmp_path / "cluster.json"
    state_file.write_text(kube.render(s)["api"][0]["data"]["cluster.json"])
    env = {var: secrets.token_hex(16) for var in kube.SECRET_KEYS.values()}
    with pytest.raises(RuntimeError, match="RAY_AUTH_TOKEN"):
        write_home(tmp_path / "h0", state_file, {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"})
    home = write_home(tmp_path / "home", state_file, env)
    assert stat.S_IMODE((home / "secrets.json").stat().st_mode) == 0o600
    info = load_info(home)
    assert (
        info.redis_url
        == f"redis://{APP_USER}:{env['SLIPSTREAM_REDIS_CONTROL_PASSWORD']}@slipstream-redis:7001/0"
    )
    assert info.redis_admin_url.endswith(f":{env['SLIPSTREAM_REDIS_PASSWORD']}@slipstream-redis:7001/0")
    assert info.dashboard_url == "http://slipstream-head-svc:8265"
    assert info.api_token == env["SLIPSTREAM_API_TOKEN"] and info.ray_auth_token == env["RAY_AUTH_TOKEN"]


def test_the_control_api_serves_its_metrics_behind_the_token():
    from fastapi.testclient import TestClient

    from slipstream.cluster.api import create_app

    client = TestClient(create_app("t0k"))
    assert client.get("/metrics").status_code == 401
    r = client.get("/metrics", headers={"Authorization": "Bearer t0k"})
    assert r.status_code == 200 and "python_info" in r.text


# ---------------------------------------------------------------- Redis as rendered


class RenderedRedis:
    """The Redis pod as rendered, run here: the init container's script, then redis-server with the
    rendered arguments, /data and the ConfigMap's path moved to a temporary directory, on 127.0.0.1."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        try:
            self.server = find_redis_server()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"no redis-server: {e}")
        if not shutil.which("sha256sum"):
            pytest.skip("no sha256sum")
        from common.net import free_port

        self.port = free_port("127.0.0.1")
        self.env = env
        s = kube.KubeSettings(ports={"redis": self.port})
        self.data, conf = tmp_path / "data", tmp_path / "conf"
        self.data.mkdir()
        conf.mkdir()
        (conf / "redis.conf").write_text(kube.render(s)["redis"][0]["data"]["redis.conf"])
        self.script = kube.acl_script(s).replace("/data", str(self.data))
        self.args = [
            a.replace("/data", str(self.data)).replace("/usr/local/etc/redis", str(conf))
            for a in kube.redis_args(s)
        ]
        self.args[self.args.index("0.0.0.0")] = "127.0.0.1"  # no need to open it to the box's network
        self.proc = None

    def start(self) -> redis.Redis:
        """Start it (the ACL script first, as the pod does at every start); an admin client."""
        subprocess.run(["sh", "-c", self.script], env={**os.environ, **self.env}, check=True, timeout=30)
        self.proc = subprocess.Popen(
            [self.server, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        admin = redis.Redis(
            port=self.port, password=self.env["SLIPSTREAM_REDIS_PASSWORD"], socket_connect_timeout=1
        )
        while True:
            try:
                admin.ping()
                return admin
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _secret_env() -> dict[str, str]:
    return {var: secrets.token_hex(16) for var in kube.SECRET_KEYS.values()}


def test_redis_runs_with_the_rendered_arguments_and_acl(tmp_path):
    """Both users log in with the Secret's passwords, the control plane's user has its rules, and a job's
    user saved by the control plane survives a restart."""
    env = _secret_env()
    server = RenderedRedis(tmp_path, env)
    admin = server.start()
    try:
        assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert admin.config_get("appendonly")["appendonly"] == "yes"
        control = redis.Redis(
            port=server.port, username=APP_USER, password=env["SLIPSTREAM_REDIS_CONTROL_PASSWORD"]
        )
        control.set("slipstream:x", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            control.set("other", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            control.flushall()
        set_job_user(admin, "j1", "pw-of-j1")
        server.stop()
        admin = server.start()
        assert job_user("j1") in admin.acl_users()
        assert redis.Redis(port=server.port, username=job_user("j1"), password="pw-of-j1").ping()
        assert "pw-of-j1" not in (server.data / "users.acl").read_text()
    finally:
        server.stop()


def test_the_control_api_container_starts_with_the_rendered_command(tmp_path):
    """The control API container's command, run here (paths, host and port moved here; Redis at
    127.0.0.1 instead of its Service's name): it makes HOME from the ConfigMap and the Secret's variables,
    serves /healthz, lists jobs from the rendered Redis with the control plane's user, and serves its
    /metrics with the token."""
    import httpx

    from common.net import free_port

    env = _secret_env()
    server = RenderedRedis(tmp_path, env)
    server.start()
    api_port = free_port("127.0.0.1")
    s = kube.KubeSettings(ports={"redis": server.port, "api": api_port})
    state = json.loads(kube.render(s)["api"][0]["data"]["cluster.json"])
    state["redis_host"] = "127.0.0.1"  # the Service's name resolves only in the cluster
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    home = tmp_path / "home"
    command = (
        kube.api_command(s)
        .replace(kube.HOME_DIR, str(home))
        .replace(f"{kube.STATE_DIR}/cluster.json", str(tmp_path / "cluster.json"))
        .replace("0.0.0.0", "127.0.0.1")
        .replace("python -m", f"{sys.executable} -m")
    )
    log = open(tmp_path / "api.log", "wb")
    proc = subprocess.Popen(
        ["sh", "-c", command],
        cwd=REPO,
        env={**os.environ, **env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{api_port}"
    auth = {"Authorization": f"Bearer {env['SLIPSTREAM_API_TOKEN']}"}
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if http_calls.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()[-3000:]
            time.sleep(0.3)
        assert stat.S_IMODE((home / "secrets.json").stat().st_mode) == 0o600
        assert http_calls.get(f"{url}/jobs", timeout=10).status_code == 401
        r = http_calls.get(f"{url}/jobs", headers=auth, timeout=30)
        assert r.status_code == 200 and r.json() == [], r.text
        r = http_calls.get(f"{url}/metrics", headers=auth, timeout=10)
        assert r.status_code == 200 and "slipstream_control_scrape_targets" in r.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        server.stop()


def test_prometheus_config_scrapes_what_the_pods_serve():
    """The jobs' processes as deploy/prometheus.yml reads them (the same file_sd job), the control API
    at its Service, and Ray's pods on the port every Ray container names `metrics`."""
    rendered = _render()
    prom = yaml.safe_load(rendered["prometheus"][0]["data"]["prometheus.yml"])
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    host = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    assert jobs["slipstream"] == next(j for j in host["scrape_configs"] if j["job_name"] == "slipstream")
    assert prom["global"] == host["global"]
    keep = [r for r in jobs["ray"]["relabel_configs"] if r.get("action") == "keep"]
    assert {r["regex"] for r in keep} == {"slipstream", "metrics"}
    for labels, pod in _pods(_docs(rendered)):
        if "ray.io/cluster" in labels:
            ray_container = pod["containers"][0]
            assert {"name": "metrics", "containerPort": kube.DEFAULT_PORTS["ray_metrics"]} in ray_container[
                "ports"
            ]


def test_render_kube_takes_every_setting_of_cluster_up():
    import argparse

    from slipstream.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    csub = next(a for a in sub.choices["cluster"]._actions if isinstance(a, argparse._SubParsersAction))

    def options(cmd: str) -> set[str]:
        return {o for a in csub.choices[cmd]._actions for o in a.option_strings}

    shared = argparse.ArgumentParser()
    from slipstream.cli import settings

    settings.add_cluster_settings(shared, "")
    wanted = {o for a in shared._actions for o in a.option_strings} - {"-h", "--help"}
    assert wanted <= options("up") and wanted <= options("render-kube")
