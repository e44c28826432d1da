"""`slipstream cluster up | down | status`: the command line of the persistent local cluster."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path

from common.net import default_route_address
from slipstream.cli import kube as kube_cli
from slipstream.cli import settings
from slipstream.cluster.services import down, status, up
from slipstream.cluster.state import (
    JOB_STOP_TIMEOUT_S,
    PROMETHEUS_SKIPPED,
    SERVICES,
    ClusterInfo,
    load_info,
    resolve_home,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- CLI (`slipstream cluster ...`)


def add_parser(sub) -> None:
    """Register `cluster up|down|status` on slipstream's subcommand parser."""
    p = sub.add_parser(
        "cluster", help="the persistent local cluster (Redis, Ray head, Prometheus, control API)"
    )
    csub = p.add_subparsers(dest="cluster_cmd", required=True)
    home_help = "state directory (default: $SLIPSTREAM_HOME, else ~/.slipstream)"
    u = csub.add_parser("up", help="start the cluster's services (those already running are left alone)")
    u.add_argument("--home", help=home_help)
    u.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind: for other nodes, this host's address they dial (0.0.0.0: every interface)",
    )
    settings.add_cluster_settings(u, "0: remembered, else a free port")
    u.add_argument("--num-cpus", type=int)
    u.add_argument("--num-gpus", type=int)
    u.add_argument("--no-prometheus", action="store_true")
    u.add_argument("--no-api", action="store_true")
    for name, help_ in (
        ("down", "stop running jobs (each with a checkpoint), then every service; data is kept"),
        ("status", "each service alive or dead"),
    ):
        csub.add_parser(name, help=help_).add_argument("--home", help=home_help)
    kube_cli.add_parsers(csub, home_help)
    d = csub.choices["down"]
    d.add_argument(
        "--force",
        action="store_true",
        help="do not wait for running jobs to stop with a checkpoint: they are killed (marked interrupted)",
    )
    d.add_argument(
        "--job-timeout",
        type=float,
        default=JOB_STOP_TIMEOUT_S,
        help="seconds to wait for running jobs to stop (then refuse, naming them)",
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _print_up(info: ClusterInfo, before: dict[str, bool], args) -> None:
    home = Path(info.home)
    secrets_file = home / "secrets.json"

    def state(service: str) -> str:
        pid = info.pids.get(service)
        return f"already running, pid {pid}" if before.get(service) else f"started, pid {pid}"

    redis_public = info.redis_url.split("@", 1)[1]
    print(f"Slipstream cluster at {home}")
    print(f"  redis       redis://slipstream@{redis_public}  ({state('redis')})")
    print(
        f"              password: {secrets_file} [redis_control_password] (user `slipstream`; the default "
        "user is admin, [redis_password])"
    )
    print(f"  ray         {info.ray_address}  ({state('ray')})")
    print(f"              dashboard + job API {info.dashboard_url}, token: {secrets_file} [ray_auth_token]")
    if info.prometheus_url:
        print(f"  prometheus  {info.prometheus_url}  ({state('prometheus')})")
        print(f"              targets: {home / 'prometheus' / 'targets'}/*.json")
    elif args.no_prometheus:
        print("  prometheus  not started (--no-prometheus)")
    else:
        print(f"  prometheus  {PROMETHEUS_SKIPPED}")
    if "api" in info.pids:
        print(f"  api         {info.api_url}  ({state('api')}), docs {info.api_url}/docs")
        print(f"              token: {secrets_file} [api_token]")
    print(f"  logs        {home / 'logs'}")
    port = info.ray_address.rsplit(":", 1)[1]
    if _is_loopback(info.host):  # other machines cannot reach a head that listens on loopback only
        print("More nodes: this head listens on loopback only; to add nodes, `slipstream cluster down`,")
        print("  then `slipstream cluster up --host 0.0.0.0` (or this host's IP)")
    else:
        ip = info.host if info.host != "0.0.0.0" else (default_route_address() or "<this host's IP>")
        print("Connect more nodes (same Ray and Python versions):")
        print(
            f"  RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<ray_auth_token from {secrets_file}> ray start --address {ip}:{port}"
        )
    print("Submit a job:  slipstream submit JOB.yaml")
    print("Stop:          make cluster-down  (data is kept)")


def jobs_line(jobs: dict[str, dict], force: bool) -> str:
    """Which running jobs `cluster down` ended, and how: each at its version, with its checkpoint (or
    none: --force kills them; they show `interrupted` when the cluster comes back)."""
    if not jobs:
        return "jobs: none was running"
    if force:
        killed = ", ".join(f"{n} (version {st.get('version', 0)})" for n, st in jobs.items())
        return f"jobs killed without a checkpoint (interrupted when the cluster is up again): {killed}"
    parts = []
    for name, st in jobs.items():
        ckpt = st.get("checkpoint")
        parts.append(
            f"{name} ({st.get('state')} at version {st.get('version', 0)}, "
            + (f"checkpoint {ckpt})" if ckpt else "no checkpoint)")
        )
    return f"jobs stopped: {', '.join(parts)}"


def main(args: argparse.Namespace) -> int:
    """`slipstream cluster up|down|status`."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)  # one line per state change; not httpx's requests
    if args.cluster_cmd in kube_cli.COMMANDS:
        return kube_cli.main(args)
    home = resolve_home(args.home)
    try:
        if args.cluster_cmd == "up":
            before = status(home) if (home / "cluster.json").exists() else {}
            info = up(
                home,
                args.host,
                redis_port=args.redis_port,
                ray_port=args.ray_port,
                dashboard_port=args.dashboard_port,
                api_port=args.api_port,
                prometheus_port=args.prometheus_port,
                num_cpus=args.num_cpus,
                num_gpus=args.num_gpus,
                start_api=not args.no_api,
                start_prometheus=not args.no_prometheus,
                tool_modules=settings.tool_modules(args),
                redis_maxmemory=args.redis_maxmemory,
                input_roots=args.input_root,
            )
            _print_up(info, before, args)
            return 0
        if args.cluster_cmd == "down":
            alive = status(home)
            info = load_info(home)
            jobs = down(home, force=args.force, job_timeout_s=args.job_timeout)
            print(jobs_line(jobs, args.force))
            stopped = [f"{s} (pid {info.pids.get(s)})" for s in reversed(SERVICES) if alive.get(s)]
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
            print(f"data kept in {home} (`slipstream cluster up` starts it again, same ports and secrets)")
            return 0
        alive = status(home)
        info = load_info(home)
        for service, ok in alive.items():
            print(
                f"{service:<11} {'alive' if ok else 'dead'}" + (f"  pid {info.pids[service]}" if ok else "")
            )
        return 0 if all(alive.values()) else 1
    except FileNotFoundError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:
        print(f"slipstream: cluster {args.cluster_cmd} failed: {e}", file=sys.stderr)
        return 1
