"""Kubernetes manifests for a Slipstream cluster on KubeRay (`slipstream cluster render-kube`), rendered
from the settings `slipstream cluster up` takes (ports, Redis' memory limit, input roots, tool modules)
plus what only Kubernetes needs (namespace, image, worker groups, storage).

What runs where (docs/deploy.md walks through it):

- Redis: a StatefulSet of one pod with a PVC (AOF, `deploy/redis.conf`), its ACL file made from the Secret
  at every start: the admin (default) user, the control plane's user `slipstream` with the rules of
  replay_buffer/redis_server.py, and the jobs' users the control plane saved there.
- Ray: a RayCluster (KubeRay, ray.io/v1) with token auth from the Secret: a head group, and two GPU
  worker groups, one for engines and one for trainers, each offering a Ray custom resource
  (ENGINE_RESOURCE, TRAINER_RESOURCE) that a job asks for in `generators.resources` / `trainer.resources`.
- The control API: a second container of the head pod, so that it shares the head's HOME (the jobs'
  Redis credentials, which the job drivers read there) and submits jobs to Ray's job API there; a
  Service in front of it. At start it writes HOME's cluster.json (rendered here, into a ConfigMap) and
  secrets.json (from the Secret's environment): slipstream/cluster/kube_home.py.
- A ReadWriteMany PVC mounted at DATA_DIR in every Ray pod: HOME (jobs' outputs, checkpoints, logs) and
  the models (MODELS_DIR), at the same path on every node as docs/multinode.md asks.
- Prometheus: only its configuration (a ConfigMap), for a Prometheus of your own in the namespace.

No secret value is ever rendered: every credential comes from the Secret SECRET_KEYS names.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import yaml

from replay_buffer.keys import ALL_KEYS
from replay_buffer.redis_server import APP_USER, CONTROL_RULES, DEFAULT_MAXMEMORY
from slipstream.cluster.state import ClusterState
from slipstream.job.prepare import REPO_ROOT

RAY_VERSION = "2.60.0"
"""The Ray of the image (and of deploy/ray-cluster.example.yaml): KubeRay needs it for token auth."""
ENGINE_RESOURCE = "slipstream_engine"
"""The Ray custom resource of the engine group's pods: `generators.resources: {slipstream_engine: 1}`."""
TRAINER_RESOURCE = "slipstream_trainer"
"""The Ray custom resource of the trainer group's pods: `trainer.resources: {slipstream_trainer: 1}`."""
RESOURCE_UNITS = "100"
"""How much of its group's resource each pod offers (each engine, rollout worker or trainer rank takes 1)."""
SECRET_KEYS = {
    "redis_password": "SLIPSTREAM_REDIS_PASSWORD",
    "redis_control_password": "SLIPSTREAM_REDIS_CONTROL_PASSWORD",
    "api_token": "SLIPSTREAM_API_TOKEN",
    "auth_token": "RAY_AUTH_TOKEN",
}
"""The Secret's keys -> the variable each is given as. `auth_token` is the Ray token (the key KubeRay's
`authOptions.secretName` reads); the others are secrets.json's keys of the same name."""
DEFAULT_PORTS = {
    "redis": 6380,
    "ray": 6379,
    "dashboard": 8265,
    "api": 8420,
    "prometheus": 9090,
    "ray_client": 10001,
    "ray_metrics": 8080,
}
"""Fixed ports (a Service needs them): `cluster up`'s defaults of docs/deploy.md (Redis on 6380, away from
Ray's GCS on 6379), the control API's 8420, Ray's dashboard, client and metrics ports."""
DATA_DIR = "/slipstream"
HOME_DIR = f"{DATA_DIR}/home"
MODELS_DIR = f"{DATA_DIR}/models"
STATE_DIR = "/etc/slipstream"
RAY_TEMP_DIR = "/tmp/ray"
FILES = {
    "namespace": "00-namespace.yaml",
    "redis": "10-redis.yaml",
    "storage": "20-storage.yaml",
    "api": "30-control-api.yaml",  # the head pod mounts its ConfigMap: before the RayCluster
    "raycluster": "40-raycluster.yaml",
    "prometheus": "50-prometheus-config.yaml",
}
"""What render_files writes, in `kubectl apply` order (the Secret comes first, made by hand)."""


@dataclass
class KubeSettings:
    """Everything the manifests are rendered from. Port 0 takes DEFAULT_PORTS'."""

    namespace: str = "slipstream"
    name: str = "slipstream"
    image: str = "slipstream:latest"
    secret_name: str = "slipstream-secrets"
    ports: dict[str, int] = field(default_factory=dict)
    redis_maxmemory: str = DEFAULT_MAXMEMORY
    redis_storage: str = "20Gi"
    data_storage: str = "200Gi"
    storage_class: str | None = None
    """The data PVC's class: one that offers ReadWriteMany (NFS, CephFS, a cloud filestore); None: default."""
    engine_replicas: int = 1
    engine_max_replicas: int = 8
    engine_gpus: int = 1
    trainer_replicas: int = 1
    trainer_max_replicas: int = 8
    trainer_gpus: int = 1
    tool_modules: list[str] | None = None
    input_roots: list[str] | None = None
    """None: the models directory (jobs also read their own directory)."""

    def port(self, name: str) -> int:
        return self.ports.get(name) or DEFAULT_PORTS[name]

    @property
    def head_service(self) -> str:
        return f"{self.name}-head-svc"  # KubeRay's name for the head's Service

    @property
    def redis_service(self) -> str:
        return f"{self.name}-redis"

    @property
    def api_service(self) -> str:
        return f"{self.name}-api"

    @property
    def roots(self) -> list[str]:
        return self.input_roots if self.input_roots is not None else [MODELS_DIR]


def _meta(s: KubeSettings, name: str, component: str) -> dict:
    labels = {"app.kubernetes.io/name": "slipstream", "app.kubernetes.io/instance": s.name}
    return {
        "name": name,
        "namespace": s.namespace,
        "labels": {**labels, "app.kubernetes.io/component": component},
    }


def _secret_env(s: KubeSettings, keys) -> list[dict]:
    return [
        {"name": SECRET_KEYS[k], "valueFrom": {"secretKeyRef": {"name": s.secret_name, "key": k}}}
        for k in keys
    ]


# ---------------------------------------------------------------- Redis


def acl_script(s: KubeSettings) -> str:
    """The Redis init container's script: the ACL file from the Secret's passwords (their SHA-256 only,
    as ManagedRedis.acl_text writes it), keeping the jobs' users saved there."""
    return "\n".join(
        [
            "set -eu",
            "umask 077",
            "acl=/data/users.acl",
            'admin=$(printf %s "$SLIPSTREAM_REDIS_PASSWORD" | sha256sum | cut -d" " -f1)',
            'control=$(printf %s "$SLIPSTREAM_REDIS_CONTROL_PASSWORD" | sha256sum | cut -d" " -f1)',
            "{",
            '  echo "user default on #$admin ~* &* +@all"',
            f'  echo "user {APP_USER} on #$control ~{ALL_KEYS} {CONTROL_RULES}"',
            '  if [ -f "$acl" ]; then grep "^user job-" "$acl" || true; fi',
            '} > "$acl.new"',
            'mv "$acl.new" "$acl"',
        ]
    )


def redis_args(s: KubeSettings) -> list[str]:
    """redis-server's arguments: deploy/redis.conf (from the ConfigMap) plus what ManagedRedis.config_text
    appends per instance (bind, port, dir, appendfsync, maxmemory, the ACL file)."""
    return [
        "/usr/local/etc/redis/redis.conf",
        "--bind",
        "0.0.0.0",
        "--port",
        str(s.port("redis")),
        "--dir",
        "/data",
        "--appendfsync",
        "everysec",
        "--maxmemory",
        s.redis_maxmemory,
        "--maxmemory-policy",
        "noeviction",
        "--aclfile",
        "/data/users.acl",
    ]


# Long: one StatefulSet, its ConfigMap and Service, spelled out as Kubernetes has them
def redis_manifests(s: KubeSettings, redis_conf: str) -> list[dict]:
    labels = {"app.kubernetes.io/instance": s.name, "app.kubernetes.io/component": "redis"}
    port = s.port("redis")
    probe = {
        "exec": {"command": ["sh", "-c", f"redis-cli -p {port} ping | grep -q PONG"]},
        "periodSeconds": 10,
        "timeoutSeconds": 3,
    }
    pod = {
        "metadata": {"labels": {**_meta(s, "", "redis")["labels"]}},
        "spec": {
            "securityContext": {"runAsUser": 999, "runAsGroup": 999, "fsGroup": 999},
            "initContainers": [
                {
                    "name": "acl",
                    "image": "redis:7",
                    "command": ["sh", "-c", acl_script(s)],
                    "env": _secret_env(s, ["redis_password", "redis_control_password"]),
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }
            ],
            "containers": [
                {
                    "name": "redis",
                    "image": "redis:7",
                    "args": redis_args(s),
                    "ports": [{"name": "redis", "containerPort": port}],
                    # redis-cli's password, for the probes
                    "env": [{**_secret_env(s, ["redis_password"])[0], "name": "REDISCLI_AUTH"}],
                    "readinessProbe": probe,
                    "livenessProbe": {**probe, "failureThreshold": 6},
                    "volumeMounts": [
                        {"name": "data", "mountPath": "/data"},
                        {"name": "config", "mountPath": "/usr/local/etc/redis", "readOnly": True},
                    ],
                }
            ],
            # SIGTERM: Redis flushes its AOF and exits
            "terminationGracePeriodSeconds": 30,
            "volumes": [{"name": "config", "configMap": {"name": f"{s.name}-redis-config"}}],
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(s, f"{s.name}-redis-config", "redis"),
            "data": {"redis.conf": redis_conf},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(s, s.redis_service, "redis"),
            "spec": {
                "selector": labels,
                "ports": [{"name": "redis", "port": port, "targetPort": "redis"}],
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(s, f"{s.name}-redis", "redis"),
            "spec": {
                "serviceName": s.redis_service,
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": pod,
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "data"},
                        "spec": {
                            "accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": s.redis_storage}},
                        },
                    }
                ],
            },
        },
    ]


# ---------------------------------------------------------------- the head's HOME


def cluster_state(s: KubeSettings) -> ClusterState:
    """cluster.json of the head's HOME: the addresses every pod dials (the Services' names), no secrets."""
    ports = {name: s.port(name) for name in DEFAULT_PORTS}
    h = s.head_service
    return ClusterState(
        host=h,
        ports=ports,
        ray_temp_dir=RAY_TEMP_DIR,
        services=["redis", "ray", "api"],
        running=True,
        redis_host=s.redis_service,
        redis_address=f"{s.redis_service}:{ports['redis']}",
        ray_address=f"{h}:{ports['ray']}",
        dashboard_url=f"http://{h}:{ports['dashboard']}",
        api_url=f"http://{s.api_service}:{ports['api']}",
        tool_modules=s.tool_modules,
        input_roots=s.roots,
        redis_maxmemory=s.redis_maxmemory,
    )


def api_command(s: KubeSettings) -> str:
    """The control API container's command: HOME from the ConfigMap and the Secret, then the API."""
    api = ["python", "-m", "slipstream.cluster.api", "--home", HOME_DIR, "--host", "0.0.0.0"]
    api += ["--port", str(s.port("api"))]
    if s.tool_modules is not None:
        api += ["--tool-modules", ",".join(s.tool_modules)]
    for root in s.roots:
        api += ["--input-root", root]
    home = ["python", "-m", "slipstream", "cluster", "kube-home", "--home", HOME_DIR]
    home += ["--state", f"{STATE_DIR}/cluster.json"]
    return shlex.join(home) + " && exec " + shlex.join(api)


# ---------------------------------------------------------------- Ray


def _ray_env(s: KubeSettings) -> list[dict]:
    token = [{"name": "RAY_AUTH_MODE", "value": "token"}, *_secret_env(s, ["auth_token"])]
    return [*token, {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]


def _shm(size: str) -> dict:
    """/dev/shm for Ray's object store and NCCL (a container's default is 64 MiB)."""
    return {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": size}}


def _worker_group(
    s: KubeSettings, group: str, resource: str, replicas: int, max_replicas: int, gpus: int
) -> dict:
    mounts = [
        {"name": "shm", "mountPath": "/dev/shm"},
        # at the head's path: the jobs' outputs and checkpoints (under HOME/jobs) and the models. The whole
        # volume, as a host cluster's nodes share a file system: a subPath would have the kubelet make
        # HOME as root before the head does, and job code runs with the cluster's rights anyway.
        {"name": "data", "mountPath": DATA_DIR},
    ]
    limits = {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": str(gpus)}
    return {
        "groupName": group,
        "replicas": replicas,
        "minReplicas": 0,
        "maxReplicas": max_replicas,
        "rayStartParams": {"metrics-export-port": str(s.port("ray_metrics"))},
        "resources": {resource: RESOURCE_UNITS},
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "ray-worker",
                        "image": s.image,
                        "env": _ray_env(s),
                        "ports": [{"name": "metrics", "containerPort": s.port("ray_metrics")}],
                        "resources": {"limits": limits, "requests": limits},
                        "volumeMounts": mounts,
                        # Ray's own stop: its actors end cleanly (a SIGKILL loses nothing either)
                        "lifecycle": {"preStop": {"exec": {"command": ["ray", "stop"]}}},
                    }
                ],
                "volumes": [
                    _shm("16Gi"),
                    {"name": "data", "persistentVolumeClaim": {"claimName": f"{s.name}-data"}},
                ],
            }
        },
    }


# Long: the RayCluster resource spelled out as KubeRay's CRD has it (head pod with the API, two groups)
def raycluster(s: KubeSettings) -> dict:
    p = s.port
    head_ports = [
        {"name": "gcs-server", "containerPort": p("ray")},
        {"name": "dashboard", "containerPort": p("dashboard")},
        {"name": "client", "containerPort": p("ray_client")},
        {"name": "metrics", "containerPort": p("ray_metrics")},
    ]
    data = {"name": "data", "mountPath": DATA_DIR}
    api_env = [
        *_ray_env(s),
        *_secret_env(s, ["redis_password", "redis_control_password", "api_token"]),
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    head = {
        "rayStartParams": {
            "port": str(p("ray")),
            "dashboard-host": "0.0.0.0",
            "dashboard-port": str(p("dashboard")),
            "ray-client-server-port": str(p("ray_client")),
            "metrics-export-port": str(p("ray_metrics")),
            "num-gpus": "0",
        },
        "template": {
            "metadata": {
                "labels": {"app.kubernetes.io/instance": s.name, "app.kubernetes.io/component": "head"}
            },
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": s.image,
                        "env": _ray_env(s),
                        "ports": head_ports,
                        "resources": {
                            "limits": {"cpu": "4", "memory": "16Gi"},
                            "requests": {"cpu": "4", "memory": "16Gi"},
                        },
                        # the job drivers run here: HOME (their Redis credentials, outputs), the models
                        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, data],
                    },
                    {
                        "name": "control-api",
                        "image": s.image,
                        "command": ["sh", "-c", api_command(s)],
                        "env": api_env,
                        "ports": [{"name": "api", "containerPort": p("api")}],
                        "readinessProbe": {
                            "httpGet": {"path": "/healthz", "port": "api"},
                            "periodSeconds": 10,
                        },
                        "resources": {
                            "limits": {"cpu": "1", "memory": "2Gi"},
                            "requests": {"cpu": "1", "memory": "2Gi"},
                        },
                        "volumeMounts": [
                            data,
                            {"name": "cluster-state", "mountPath": STATE_DIR, "readOnly": True},
                        ],
                    },
                ],
                "volumes": [
                    _shm("4Gi"),
                    {"name": "data", "persistentVolumeClaim": {"claimName": f"{s.name}-data"}},
                    {"name": "cluster-state", "configMap": {"name": f"{s.name}-cluster"}},
                ],
            },
        },
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta(s, s.name, "ray"),
        "spec": {
            "rayVersion": RAY_VERSION,
            # KubeRay gives every Ray container RAY_AUTH_MODE=token and the Secret's `auth_token`
            "authOptions": {"mode": "token", "secretName": s.secret_name},
            "headGroupSpec": head,
            "workerGroupSpecs": [
                _worker_group(
                    s, "engines", ENGINE_RESOURCE, s.engine_replicas, s.engine_max_replicas, s.engine_gpus
                ),
                _worker_group(
                    s,
                    "trainers",
                    TRAINER_RESOURCE,
                    s.trainer_replicas,
                    s.trainer_max_replicas,
                    s.trainer_gpus,
                ),
            ],
        },
    }


# ---------------------------------------------------------------- the rest


def storage(s: KubeSettings) -> list[dict]:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": s.data_storage}}}
    if s.storage_class:
        spec["storageClassName"] = s.storage_class
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": _meta(s, f"{s.name}-data", "data"),
            "spec": spec,
        }
    ]


def control_api(s: KubeSettings) -> list[dict]:
    state = msgspec.json.format(msgspec.json.encode(cluster_state(s)), indent=2).decode() + "\n"
    head = {"ray.io/cluster": s.name, "ray.io/node-type": "head"}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(s, f"{s.name}-cluster", "control-api"),
            "data": {"cluster.json": state},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(s, s.api_service, "control-api"),
            "spec": {
                "selector": head,
                "ports": [{"name": "api", "port": s.port("api"), "targetPort": "api"}],
            },
        },
    ]


PROMETHEUS_NOTE = (
    "# For a Prometheus in the namespace. Mount the data volume's `home/prometheus/targets` (the jobs'\n"
    "# processes, written by the control API) at /etc/prometheus/targets read-only, and the Secret's\n"
    "# `api_token` at /etc/prometheus/secrets/api_token; the `ray` job lists pods (RBAC: get/list/watch).\n"
)


def prometheus_config(s: KubeSettings) -> dict:
    """prometheus.yml for a Prometheus in the namespace: the jobs' processes (file_sd, the targets file the
    control API writes on the data volume: mount its `home/prometheus/targets` at /etc/prometheus/targets),
    the control API's /metrics (its token from the Secret, mounted as a file) and Ray's pods."""
    ray_pods = {
        "role": "pod",
        "namespaces": {"names": [s.namespace]},
    }
    return {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "scrape_configs": [
            {"job_name": "slipstream", "file_sd_configs": [{"files": ["targets/*.json"]}]},
            {
                "job_name": "slipstream-control",
                "authorization": {"credentials_file": "/etc/prometheus/secrets/api_token"},
                "static_configs": [{"targets": [f"{s.api_service}.{s.namespace}.svc:{s.port('api')}"]}],
            },
            {
                "job_name": "ray",
                "kubernetes_sd_configs": [ray_pods],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                        "regex": s.name,
                        "action": "keep",
                    },
                    {
                        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                        "regex": "metrics",
                        "action": "keep",
                    },
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            },
        ],
    }


def render(s: KubeSettings, redis_conf: str | None = None) -> dict[str, list[dict]]:
    """Every manifest, by FILES' key. `redis_conf`: deploy/redis.conf's text unless given."""
    if redis_conf is None:
        redis_conf = (REPO_ROOT / "deploy" / "redis.conf").read_text()
    prom = PROMETHEUS_NOTE + yaml.safe_dump(prometheus_config(s), sort_keys=False)
    return {
        "namespace": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": s.namespace}}],
        "redis": redis_manifests(s, redis_conf),
        "storage": storage(s),
        "raycluster": [raycluster(s)],
        "api": control_api(s),
        "prometheus": [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(s, f"{s.name}-prometheus-config", "prometheus"),
                "data": {"prometheus.yml": prom},
            }
        ],
    }


HEADER = (
    "# Rendered by `slipstream cluster render-kube` (slipstream/cluster/kube.py): edit the settings and\n"
    "# render again rather than this file. docs/deploy.md says in which order to apply what, after the\n"
    "# Secret `{secret}` (keys: {keys}).\n"
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (scripts, config files) as literal blocks, and no anchors: readable manifests."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None),
)


def render_files(s: KubeSettings, out: str | Path, redis_conf: str | None = None) -> list[Path]:
    """Write every manifest file to `out` (FILES' names); the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, docs in render(s, redis_conf).items():
        path = out / FILES[key]
        header = HEADER.format(secret=s.secret_name, keys=", ".join(SECRET_KEYS))
        path.write_text(header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=110))
        written.append(path)
    return written
