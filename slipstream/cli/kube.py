"""`slipstream cluster render-kube` (KubeRay manifests from the cluster's settings) and `slipstream cluster
kube-home` (a head pod's HOME, run by the rendered control API container): slipstream/cluster/kube.py."""

from __future__ import annotations

import argparse
import sys

from slipstream.cli import settings

COMMANDS = ("render-kube", "kube-home")
DEFAULT_OUT = "deploy/kuberay"


def add_parsers(csub, home_help: str) -> None:
    """Register `render-kube` and `kube-home` on `slipstream cluster`'s subcommand parser."""
    from slipstream.cluster.kube import DEFAULT_PORTS, KubeSettings

    d = KubeSettings()
    r = csub.add_parser(
        "render-kube",
        help="write Kubernetes manifests (KubeRay RayCluster, Redis, control API, Prometheus config)",
    )
    r.add_argument("--out", default=DEFAULT_OUT, help=f"directory to write (default {DEFAULT_OUT})")
    ports = ", ".join(f"{n} {DEFAULT_PORTS[n]}" for n in settings.PORTS)
    settings.add_cluster_settings(r, f"0: the default ({ports})")
    for flag, default, what in (
        ("namespace", d.namespace, "the namespace of every resource"),
        ("name", d.name, "the RayCluster's name, and every other resource's prefix"),
        ("image", d.image, "the image of the Ray pods and the control API (Slipstream and Ray installed)"),
        ("secret-name", d.secret_name, "the Secret holding the credentials (never rendered)"),
        (
            "storage-class",
            None,
            "the data volume's StorageClass, one with ReadWriteMany (default: the cluster's)",
        ),
        ("data-size", d.data_storage, "the data volume (HOME, jobs' outputs, models)"),
        ("redis-size", d.redis_storage, "Redis' volume (its AOF)"),
    ):
        r.add_argument(f"--{flag}", default=default, help=f"{what} (default: {default})")
    for group in ("engine", "trainer"):
        for what, default in (("replicas", 1), ("max-replicas", 8), ("gpus", 1)):
            r.add_argument(f"--{group}-{what}", type=int, default=default, help=f"{group} pods' {what}")
    h = csub.add_parser(
        "kube-home",
        help="in a head pod of render-kube's manifests: HOME's cluster.json and secrets.json from the "
        "ConfigMap and the Secret's variables",
    )
    h.add_argument("--home", required=True, help=home_help)
    h.add_argument("--state", required=True, help="the cluster.json to install (the ConfigMap's)")


def main(args: argparse.Namespace) -> int:
    from slipstream.cluster import kube

    try:
        if args.cluster_cmd == "kube-home":
            from slipstream.cluster.kube_home import write_home

            print(f"cluster state written to {write_home(args.home, args.state)}")
            return 0
        s = kube.KubeSettings(
            namespace=args.namespace,
            name=args.name,
            image=args.image,
            secret_name=args.secret_name,
            ports={k: v for k, v in settings.ports(args).items() if v},
            redis_maxmemory=args.redis_maxmemory or kube.DEFAULT_MAXMEMORY,
            redis_storage=args.redis_size,
            data_storage=args.data_size,
            storage_class=args.storage_class,
            engine_replicas=args.engine_replicas,
            engine_max_replicas=args.engine_max_replicas,
            engine_gpus=args.engine_gpus,
            trainer_replicas=args.trainer_replicas,
            trainer_max_replicas=args.trainer_max_replicas,
            trainer_gpus=args.trainer_gpus,
            tool_modules=settings.tool_modules(args),
            input_roots=args.input_root,
        )
        for path in kube.render_files(s, args.out):
            print(path)
        return 0
    except (OSError, RuntimeError, ValueError) as e:
        print(f"slipstream: cluster {args.cluster_cmd} failed: {e}", file=sys.stderr)
        return 1
