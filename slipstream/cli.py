"""`slipstream` command line: validate and run jobs. The job spec is parsed and validated before any
heavy import, so a bad spec is reported in well under a second."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from slipstream import jobspec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("run", "run a job on a local Ray instance with a private Redis"),
        ("validate", "check a job spec and print it resolved"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("spec", help="job spec YAML")
        s.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a spec key, e.g. --set algorithm.lr=1e-4 (repeatable)",
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = jobspec.load(args.spec, args.overrides)
    except jobspec.JobSpecError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 2
    if args.cmd == "validate":
        print(jobspec.to_json(spec))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from slipstream.launcher import format_progress, run_job

    try:
        result = run_job(
            spec, on_progress=lambda r: print(format_progress(r, spec.algorithm.total_steps), flush=True)
        )
    except KeyboardInterrupt:
        print("slipstream: interrupted; job stopped", file=sys.stderr)
        return 130
    print(f"done: version {result.version} in {result.elapsed_s:.0f}s; model at {result.final_model}")
    print(f"buffer: {result.buffer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
