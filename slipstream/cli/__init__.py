"""`slipstream` command line: validate and run jobs. The job spec is parsed and validated before any
heavy import, so a bad spec is reported in well under a second."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jobspec
from common import tls
from slipstream.cli import cluster as cluster_cli
from slipstream.cli import jobs as jobs_cli
from slipstream.cluster import state as cluster_state


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("run", "run a job on a local Ray instance with a private Redis"),
        ("validate", "check a job spec and print it resolved"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("spec", help="job spec YAML")
        jobs_cli.add_overrides(s)
    buf = sub.add_parser("buffer", help="inspect a job's replay buffer")
    bsub = buf.add_subparsers(dest="buffer_cmd", required=True)
    st = bsub.add_parser("stats", help="depth, pending, dead letters, staleness distribution of a job")
    st.add_argument("job")
    st.add_argument(
        "--redis-url",
        default=os.environ.get("SLIPSTREAM_REDIS_URL"),
        help="Redis of the job (default: $SLIPSTREAM_REDIS_URL, else <output-dir>/redis.url of a running "
        "`slipstream run`, else the cluster's)",
    )
    st.add_argument("--output-dir", help="the job's output_dir (default runs/JOB)")
    st.add_argument("--home", help="cluster state directory (default: $SLIPSTREAM_HOME, else ~/.slipstream)")
    st.add_argument("--json", action="store_true", help="print JSON")
    cluster_cli.add_parser(sub)
    jobs_cli.add_parsers(sub)
    return p


def _buffer_stats(args) -> int:
    import json
    from pathlib import Path

    import redis

    from replay_buffer import ReplayBuffer

    url = args.redis_url
    url_file = Path(args.output_dir or f"runs/{args.job}") / "redis.url"
    if url is None and (args.output_dir or url_file.exists()):  # a local `slipstream run`
        if not url_file.exists():
            print(f"slipstream: no --redis-url and no {url_file} (is the job running?)", file=sys.stderr)
            return 2
        url = url_file.read_text().strip()
    if url is None:  # a job of the cluster
        from slipstream.job.store import JobStore

        try:
            info = cluster_state.load_info(args.home)
        except FileNotFoundError as e:
            print(f"slipstream: no --redis-url, no {url_file} of a local run, and {e}", file=sys.stderr)
            return 2
        url = info.redis_url
        try:
            known = JobStore(
                redis.Redis.from_url(url, socket_connect_timeout=5, **tls.redis_kwargs(url))
            ).exists(args.job)
        except redis.RedisError as e:
            print(f"slipstream: cannot reach the cluster's Redis at {info.home}: {e}", file=sys.stderr)
            return 1
        if not known:
            print(f"slipstream: no job {args.job!r} in the cluster at {info.home}", file=sys.stderr)
            return 2
    try:
        stats = ReplayBuffer(
            redis.Redis.from_url(url, socket_connect_timeout=5, **tls.redis_kwargs(url)), args.job
        ).stats()
    except redis.RedisError as e:
        print(f"slipstream: cannot read buffer of job {args.job!r}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats))
        return 0
    hist = stats.pop("staleness")
    width = max(map(len, stats))
    print(f"job {args.job}")
    for k, v in stats.items():
        print(f"  {k:<{width}}  {v}")
    total = sum(hist.values()) or 1
    print("  staleness of consumed groups (versions):")
    for s, n in hist.items():
        print(f"    {s:>3}  {n:>8}  {'#' * round(40 * n / total)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "buffer":
        return _buffer_stats(args)
    if args.cmd == "cluster":
        return cluster_cli.main(args)
    if args.cmd in jobs_cli.COMMANDS:
        return jobs_cli.main(args)
    try:
        # relative paths: against the working directory, as `submit` sends it (jobspec.resolve_paths)
        spec = jobspec.resolve_paths(jobspec.load(args.spec, args.overrides), os.getcwd())
        jobspec.check_context(spec)  # once the model exists; `run` checks again after building it
    except jobspec.JobSpecError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    from generator_fleet.tasks import check_import_paths
    from generator_fleet.tools.impl_check import check_tools
    from jobspec.spec import eval_task

    # Reads the sources of custom tools, tasks and rewards; runs none of them.
    if why := check_tools(spec.tools) or check_import_paths(
        spec.dataset.name, spec.reward.name, None, eval_dataset_name=eval_task(spec)
    ):
        print(f"slipstream: invalid job spec: {why}", file=sys.stderr)
        return 2
    if args.cmd == "validate":
        print(jobspec.to_json(spec))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from slipstream.job.local import run_job
    from slipstream.job.progress import format_progress

    try:
        result = run_job(
            spec,
            on_progress=lambda r: print(
                format_progress(r, spec.algorithm.total_steps, spec.agent is not None), flush=True
            ),
        )
    except KeyboardInterrupt:
        print("slipstream: interrupted; job stopped", file=sys.stderr)
        return 130
    except jobspec.JobSpecError as e:  # what only the built model tells (its context)
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    print(f"done: version {result.version} in {result.elapsed_s:.0f}s; model at {result.final_model}")
    print(f"buffer: {result.buffer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
