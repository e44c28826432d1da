"""The control API: Slipstream's job operations over HTTP (FastAPI), every route but /healthz behind a
bearer token. `make cluster-up` starts it as `python -m slipstream.api --home HOME`; it reads the
cluster's addresses and secrets from HOME (slipstream/cluster.py writes them).
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
from pathlib import Path

from fastapi import FastAPI

log = logging.getLogger(__name__)

DEFAULT_PORT = 8420


def create_app(token: str) -> FastAPI:
    if not token:
        raise ValueError("the control API needs a token")
    app = FastAPI(title="Slipstream control API", version="0.1")

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"status": "ok"}

    app.state.token_ok = lambda given: secrets.compare_digest(given.encode(), token.encode())
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m slipstream.api", description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, required=True, help="the cluster's state directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = json.loads((args.home / "secrets.json").read_text())["api_token"]
    uvicorn.run(create_app(token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
