"""The control API: Slipstream's job operations over HTTP (FastAPI), every route but /healthz behind a
bearer token (constant-time comparison). `make cluster-up` starts it as `python -m slipstream.api --home
HOME`; it reads the cluster's addresses and secrets from HOME (slipstream/cluster.py writes them).
OpenAPI docs at /docs.
"""

from __future__ import annotations

import argparse
import logging
import secrets
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from slipstream.jobspec import MAX_POOL  # a scale request's cap is the spec's pool-size cap

log = logging.getLogger(__name__)

DEFAULT_PORT = 8420
MAX_BODY_BYTES = 1 << 20
"""A job spec is a few kB; larger requests are refused (413) before they are read."""


class SubmitRequest(BaseModel):
    spec: str = Field(description="the job spec, YAML (or JSON) text")
    overrides: list[str] = Field(default_factory=list, description="dotted.key=value overrides")
    cwd: str | None = Field(None, description="where relative paths in the spec are resolved")


class ScaleRequest(BaseModel):
    generators: int | None = Field(
        None, ge=1, le=MAX_POOL, description="engines (each with its rollout workers)"
    )
    trainers: int | None = Field(
        None, ge=1, le=MAX_POOL, description="trainer ranks (restart from a checkpoint)"
    )


class ErrorBody(BaseModel):
    detail: str | list[dict] = Field(
        description="what is wrong: a message, or (a body that does not fit the schema) one entry per field"
    )


ERRORS = {code: {"model": ErrorBody} for code in (401, 404, 409, 413, 422, 503)}
"""Every route's error answers, in the schema: a refused operation (ControlError) is a 422 with a
message, not FastAPI's default 422 schema (a list of field errors) alone."""


class StopRequest(BaseModel):
    force: bool = Field(False, description="also stop the Ray job now instead of after the current step")


def create_app(token: str, control=None) -> FastAPI:
    """`control`: a slipstream.control.JobControl (None: only /healthz answers, for tests of auth)."""
    if not token:
        raise ValueError("the control API needs a token")
    app = FastAPI(title="Slipstream control API", version="0.1", description=__doc__, responses=ERRORS)
    bearer = HTTPBearer(auto_error=False)

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = creds.credentials if creds is not None else ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        return await call_next(request)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"status": "ok"}

    def ctl():
        if control is None:
            raise HTTPException(503, "no cluster attached to this API")
        return control

    def call(fn, *args, **kw):
        from slipstream.control import ControlError

        try:
            return fn(*args, **kw)
        except ControlError as e:
            raise HTTPException(e.status, str(e)) from None

    auth = [Depends(authorized)]

    @app.post("/jobs", dependencies=auth, status_code=201, summary="Submit a job")
    def submit(req: SubmitRequest) -> dict:
        return call(ctl().submit, req.spec, req.overrides, req.cwd)

    @app.get("/jobs", dependencies=auth, summary="List jobs")
    def list_jobs() -> list[dict]:
        return call(ctl().list)

    @app.get("/jobs/{name}", dependencies=auth, summary="A job's state, progress and pools")
    def get_job(name: str) -> dict:
        return call(ctl().get, name)

    @app.get("/jobs/{name}/progress", dependencies=auth, summary="A job's per-step progress records")
    def progress(name: str, since: int = 0) -> dict:
        return call(ctl().progress, name, since)

    # The built-in web page (slipstream/ui.py): HTML and script without auth (they hold no data); the
    # script calls the JSON routes above with the token the user pastes (kept in sessionStorage).
    from slipstream import ui

    @app.get("/ui", include_in_schema=False)
    def ui_jobs() -> HTMLResponse:
        return HTMLResponse(ui.JOBS_HTML, headers=ui.SECURITY_HEADERS)

    @app.get("/ui/app.js", include_in_schema=False)
    def ui_script() -> Response:
        return Response(ui.APP_JS, media_type="text/javascript", headers=ui.SECURITY_HEADERS)

    @app.get("/ui/jobs/{name}", include_in_schema=False)
    def ui_job(name: str) -> HTMLResponse:
        return HTMLResponse(ui.JOB_HTML, headers=ui.SECURITY_HEADERS)

    @app.get("/jobs/{name}/logs", dependencies=auth, summary="A job's driver log, or one component's")
    def logs(name: str, component: str | None = None, tail: int = 200) -> dict:
        return call(ctl().logs, name, component, tail)

    @app.post("/jobs/{name}/scale", dependencies=auth, summary="Set pool sizes")
    def scale(name: str, req: ScaleRequest) -> dict:
        return call(ctl().scale, name, req.generators, req.trainers)

    @app.post("/jobs/{name}/stop", dependencies=auth, summary="Stop a job")
    def stop(name: str, req: StopRequest | None = None) -> dict:
        return call(ctl().stop, name, bool(req and req.force))

    @app.post("/jobs/{name}/checkpoint", dependencies=auth, summary="Checkpoint after the current step")
    def checkpoint(name: str) -> dict:
        return call(ctl().checkpoint, name)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from slipstream import cluster
    from slipstream.control import JobControl
    from slipstream.targets import TargetWriter

    p = argparse.ArgumentParser(prog="python -m slipstream.api", description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, required=True, help="the cluster's state directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    info = cluster.load_info(args.home)
    control = JobControl(info)
    # Prometheus discovers every job's processes from the file this writes (deploy/prometheus.yml).
    targets = TargetWriter(control.r, Path(info.home) / "prometheus" / "targets")
    targets.start()
    log.info("control API on %s:%d for the cluster at %s", args.host, args.port, args.home)
    try:
        uvicorn.run(create_app(info.api_token, control), host=args.host, port=args.port, log_level="warning")
    finally:
        targets.stop()


if __name__ == "__main__":
    main()
