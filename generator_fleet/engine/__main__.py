"""`python -m generator_fleet.engine --model PATH --port N`: serve one built-in engine until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys

from common.http_guard import ENGINE_LIMITS, add_limit_arguments, limits_from_args
from common.startup import gc_paused
from generator_fleet.engine import options

API_KEY_ENV = "SLIPSTREAM_ENGINE_API_KEY"
"""Where the key is read from when --api-key is absent: a command line is visible to every local user."""


def is_loopback(host: str) -> bool:
    """Whether `host` (what --host binds) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m generator_fleet.engine", description=__doc__)
    options.add_arguments(p)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' (default: ${API_KEY_ENV}; prefer it: `ps` shows arguments)",
    )
    p.add_argument("--log-level", default="INFO")
    add_limit_arguments(p, ENGINE_LIMITS)
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    http_limits = limits_from_args(args)
    try:
        opts = options.from_args(args)
    except ValueError as e:
        p.error(str(e))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None:
        # Without a key every route is open, /update_weights_from_disk (any path) and pause included.
        if not is_loopback(args.host):
            p.exit(
                2,
                f"{p.prog}: error: refusing to serve on --host {args.host} without an API key: anyone who "
                f"can reach it could load weights from any path or stop generation. Set ${API_KEY_ENV} "
                "(or --api-key), or bind 127.0.0.1\n",
            )
        logging.getLogger(__name__).warning(
            "no API key: every route is open to any local user (set $%s to require one)", API_KEY_ENV
        )
    elif not is_loopback(args.host):
        logging.getLogger(__name__).warning(
            "serving plain HTTP on %s: the API key crosses the network in clear text; put a TLS reverse "
            "proxy in front of it (README: Security)",
            args.host,
        )

    with gc_paused():  # torch, transformers and the model load (common/startup.py)
        from generator_fleet.engine.serve import EngineServer  # after parsing: --help stays instant

        server = EngineServer(opts, api_key=api_key, limits=http_limits).start()

    asked: list[int] = []

    def shutdown(signum, frame) -> None:
        logging.getLogger(__name__).info("signal %d: shutting down", signum)
        asked.append(signum)
        server.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"engine ready at {server.url}", flush=True)
    server.serve_forever()
    # The server is down. A worker thread may still be blocked in a weight-bus receive whose sender is
    # gone (a trainer that died mid-update); a normal interpreter exit would wait for it until the
    # group's timeout (60 s by default). Nothing is left to save, so leave now.
    if server.fatal is not None:  # exit non-zero so a supervisor replaces this engine
        logging.getLogger(__name__).error("exiting: the engine is unhealthy (%s)", server.fatal)
    elif not asked:
        logging.getLogger(__name__).error("the HTTP server stopped without being asked to")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if asked and server.fatal is None else 1)


if __name__ == "__main__":
    main()
