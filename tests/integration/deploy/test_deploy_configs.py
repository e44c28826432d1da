"""deploy/ configs: they parse, agree with each other and with what Slipstream writes, keep every port on
127.0.0.1, and the parts that can run here do: Redis with compose's arguments, Ray's own validation of the
cluster YAML, promtool, and a real Prometheus reading the targets file Slipstream writes."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import http_calls
import httpx
import pytest
import redis
import yaml
from prom import start_prometheus
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.net import free_port
from replay_buffer.redis_server import find_redis_server
from slipstream.cluster.targets import FILE_NAME, write_file_sd

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
WAIT_S = 60.0
"""Upper bound on waiting for a server started here; a timeout only, never a performance threshold."""


def _load(rel: str) -> dict:
    return yaml.safe_load((DEPLOY / rel).read_text())


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} substitution."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value)


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of every volume of a compose service, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out.append((source, target))
    return out


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


def test_every_yaml_parses():
    files = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])
    assert len(files) >= 5
    for f in files:  # the rendered Kubernetes manifests hold several documents each
        docs = list(yaml.safe_load_all(f.read_text()))
        assert docs and all(isinstance(d, dict) for d in docs), f


def test_prometheus_reads_the_file_slipstream_writes(tmp_path, redis_client):
    config = _load("prometheus.yml")
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    (pattern,) = jobs["slipstream"]["file_sd_configs"][0]["files"]
    # The layout `make cluster-up` and compose use: targets/ next to prometheus.yml.
    write_file_sd(redis_client, tmp_path / "targets")
    assert list(tmp_path.glob(pattern)) == [tmp_path / "targets" / FILE_NAME]
    assert jobs["ray"]["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]


def test_compose_services_ports_and_mounts(compose):
    services = compose["services"]
    assert {"redis", "prometheus", "grafana"} <= services.keys()
    for name, svc in services.items():
        for mapping in svc.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), (name, mapping)
        for source, _ in _mounts(svc):
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
    # Host networking ignores `ports:`, so these two bind 127.0.0.1 themselves.
    assert services["prometheus"]["network_mode"] == "host"
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    grafana_env = services["grafana"]["environment"]
    assert services["grafana"]["network_mode"] == "host"
    assert grafana_env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1" and grafana_env["GF_SERVER_HTTP_PORT"] == "3000"
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "${GRAFANA_ADMIN_PASSWORD:?" in grafana_env["GF_SECURITY_ADMIN_PASSWORD"]


def test_compose_paths_agree_with_the_configs(compose):
    prom = dict((t, s) for s, t in _mounts(compose["services"]["prometheus"]))
    config_file = next(
        a for a in compose["services"]["prometheus"]["command"] if a.startswith("--config.file=")
    )
    config_path = config_file.split("=", 1)[1]
    assert prom[config_path] == "./prometheus.yml"
    # file_sd's relative pattern resolves against the config's directory: the targets must be mounted there.
    pattern = _load("prometheus.yml")["scrape_configs"][0]["file_sd_configs"][0]["files"][0]
    assert str(Path(config_path).parent / Path(pattern).parent) in prom
    assert prom["/etc/prometheus/targets"] == "${SLIPSTREAM_HOME:-~/.slipstream}/prometheus/targets"

    grafana = dict((t, s) for s, t in _mounts(compose["services"]["grafana"]))
    provider = _load("grafana/provisioning/dashboards/slipstream.yml")["providers"][0]
    assert grafana[provider["options"]["path"]] == "./grafana/dashboards"
    assert grafana["/etc/grafana/provisioning"] == "./grafana/provisioning"


def test_grafana_datasource():
    (ds,) = _load("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert (ds["name"], ds["uid"], ds["type"]) == ("Prometheus", "prometheus", "prometheus")
    assert ds["url"] == "http://127.0.0.1:9090" and ds["isDefault"] is True


def test_compose_redis_arguments_run(compose, tmp_path):
    """The compose Redis command, run by a real redis-server: the password is required, and the app's ACL
    user reaches its own keys only, without KEYS."""
    password, port = "pw-compose-test", free_port()
    svc = compose["services"]["redis"]
    args = [_interpolate(a, {"REDIS_PASSWORD": password}) for a in svc["command"]]
    assert args[:2] == ["redis-server", "/usr/local/etc/redis/redis.conf"]
    assert dict((t, s) for s, t in _mounts(svc))[args[1]] == "./redis.conf"
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        _interpolate(svc["command"][svc["command"].index("--requirepass") + 1], {})
    cmd = [find_redis_server(), str(DEPLOY / "redis.conf"), *args[2:]]
    cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # No retries: redis-py's default backs off for ~3.5 s on a refused connection while Redis starts.
        app = redis.Redis(port=port, username="slipstream", password=password, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                app.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        app.set("slipstream:job:version", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.set("other:key", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.keys("*")
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.script_flush()
        assert (
            app.register_script("return redis.call('GET', KEYS[1])")(keys=["slipstream:job:version"]) == b"1"
        )
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()
        admin = redis.Redis(port=port, password=password)
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
        assert admin.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert admin.config_get("maxmemory") == {"maxmemory": str(2 << 30)}
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        app.close()
        admin.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_ray_cluster_example_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(_load("ray-cluster.example.yaml"))
    validate_config(config)
    assert config["provider"]["type"] == "local"
    for cmd in (*config["head_start_ray_commands"], *config["worker_start_ray_commands"]):
        if "ray start" in cmd:
            assert "RAY_AUTH_MODE=token" in cmd and "RAY_AUTH_TOKEN=" in cmd, cmd


def test_docs_external_engines_spec_is_valid():
    """The job spec docs/deploy.md shows for engines on other nodes passes the job spec's validation."""
    from jobspec import from_dict

    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "docs" / "deploy.md").read_text(), re.S)
    (block,) = [b for b in blocks if "engine: external" in b]
    spec = from_dict(yaml.safe_load(block))
    assert spec.generators.engine == "external" and len(spec.generators.urls) == 2
    assert spec.generators.api_key_env == "SLIPSTREAM_ENGINE_KEY"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not on PATH")
def test_promtool_check_config(tmp_path):
    shutil.copy(DEPLOY / "prometheus.yml", tmp_path / "prometheus.yml")
    (tmp_path / "targets").mkdir()
    out = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not on PATH")
def test_real_prometheus_discovers_written_targets(tmp_path, redis_client, job_id):
    """A real Prometheus with deploy/prometheus.yml finds the targets write_file_sd wrote, with our labels
    (the Slipstream job name replaces the scrape job's name). Takes ~5 s: Prometheus batches discovery."""
    shutil.copy(DEPLOY / "prometheus.yml", tmp_path / "prometheus.yml")
    redis_client.hset(f"slipstream:{job_id}:metrics_targets", "engine-3", "127.0.0.1:1")
    write_file_sd(redis_client, tmp_path / "targets")
    redis_client.delete(f"slipstream:{job_id}:metrics_targets")
    port = free_port()
    proc = start_prometheus(tmp_path / "prometheus.yml", tmp_path / "data", port, tmp_path)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None, "prometheus exited"
            try:
                active = http_calls.get(f"http://127.0.0.1:{port}/api/v1/targets").json()["data"][
                    "activeTargets"
                ]
            except (httpx.HTTPError, ValueError):  # not up yet, or not ready (a plain-text answer)
                active = []
            labels = [t["labels"] for t in active if t["labels"].get("job") == job_id]
            if labels:
                break
            assert time.monotonic() < deadline, "prometheus did not discover the target"
            time.sleep(0.1)
        assert labels == [
            {"instance": "127.0.0.1:1", "job": job_id, "replica": "engine-3", "component": "engine"}
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
