"""The settings a cluster is made of, as options shared by `slipstream cluster up` (processes on this
host) and `slipstream cluster render-kube` (Kubernetes manifests): one definition, so both take the same
flags with the same meaning."""

from __future__ import annotations

import argparse

PORTS = ("redis", "ray", "dashboard", "api", "prometheus")
"""The services whose port `--NAME-port` sets."""


def add_cluster_settings(p: argparse.ArgumentParser, port_help: str) -> None:
    """--NAME-port for every PORTS, --redis-maxmemory, --input-root, --tool-modules | --builtin-tools-only."""
    for name in PORTS:
        p.add_argument(f"--{name}-port", type=int, default=0, help=port_help)
    p.add_argument(
        "--redis-maxmemory",
        help="Redis memory limit, e.g. 4gb (default: the last one, else 2gb); at the limit writes fail "
        "with a clear error, nothing is evicted",
    )
    p.add_argument(
        "--input-root",
        action="append",
        metavar="DIR",
        help="submitted jobs may read their inputs (model, dataset, checkpoint to resume from) only here or "
        "in their own directory (repeatable; default: $SLIPSTREAM_HOME, the project, the temp directory)",
    )
    tools = p.add_mutually_exclusive_group()
    tools.add_argument(
        "--tool-modules",
        metavar="MOD[,MOD...]",
        help="jobs' custom tools (tools[].impl) may come only from these modules and their submodules "
        "(default: any importable module; the API token is admin-equivalent either way)",
    )
    tools.add_argument("--builtin-tools-only", action="store_true", help="jobs may use builtin tools only")


def tool_modules(args: argparse.Namespace) -> list[str] | None:
    """The modules custom tools may come from ([]: builtin tools only; None: any)."""
    if args.builtin_tools_only:
        return []
    if args.tool_modules is None:
        return None
    return [m.strip() for m in args.tool_modules.split(",") if m.strip()]


def ports(args: argparse.Namespace) -> dict[str, int]:
    """--NAME-port of every PORTS (0: not given)."""
    return {name: getattr(args, f"{name}_port") for name in PORTS}
