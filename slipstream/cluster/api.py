"""The control API: Slipstream's job operations over HTTP (FastAPI), every route but /healthz behind a
bearer token (constant-time comparison). `make cluster-up` starts it as `python -m slipstream.cluster.api --home
HOME`; it reads the cluster's addresses and secrets from HOME (slipstream/cluster/services.py writes them).
OpenAPI docs at /docs.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import threading
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from common.http_guard import API_LIMITS, BearerGuard, BodyGuard, add_limit_arguments, limits_from_args
from jobspec import MAX_POOL  # a scale request's cap is the spec's pool-size cap

log = logging.getLogger(__name__)

DEFAULT_PORT = 8420
MAX_BODY_BYTES = 1 << 20
"""A job spec is a few kB; larger requests are refused (413): by Content-Length before they are read,
chunked ones as soon as the bytes received pass it."""
LIMITS = API_LIMITS
PUBLIC_PATHS = frozenset(
    ("/healthz", "/ui", "/ui/app.js", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
)
"""GET (and HEAD) of these, and of /ui/jobs/NAME, answer without the token: they hold no data."""


def is_public(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path in PUBLIC_PATHS or path.startswith("/ui/jobs/"))


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
    force: bool = Field(
        False,
        description="also have Ray stop the job's submission now (its driver gets SIGTERM, no checkpoint) "
        "instead of after the current step",
    )
    checkpoint: bool = Field(
        True, description="write a checkpoint where the trainer stops (whatever checkpoint_every says)"
    )


# Long: the control API's routes, declared together as FastAPI has them
def create_app(token: str, control=None, body_timeout_s: float | None = LIMITS.body_timeout_s) -> FastAPI:
    """`control`: a slipstream.cluster.control.JobControl (None: only /healthz answers, for tests of auth).
    The token is checked on the request's head, before any of its body is read (BearerGuard); the
    route dependency below checks it again and puts the scheme in the OpenAPI schema."""
    if not token:
        raise ValueError("the control API needs a token")
    app = FastAPI(title="Slipstream control API", version="0.1", description=__doc__, responses=ERRORS)
    bearer = HTTPBearer(auto_error=False)

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = creds.credentials if creds is not None else ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    app.add_middleware(BodyGuard, max_bytes=MAX_BODY_BYTES, body_timeout_s=body_timeout_s, what="the API's")
    app.add_middleware(BearerGuard, token=token, public=is_public)  # the outer one: no token, no 413 either

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict:
        return {"status": "ok"}

    def ctl():
        if control is None:
            raise HTTPException(503, "no cluster attached to this API")
        return control

    def call(fn, *args, **kw):
        from slipstream.cluster.control import REDIS_UNAVAILABLE, ControlError

        try:
            return fn(*args, **kw)
        except ControlError as e:
            raise HTTPException(e.status, str(e)) from None
        except REDIS_UNAVAILABLE as e:  # a stall or outage, not a bug: say so instead of a bare 500
            message = control.redis_unavailable(e)
            log.warning("%s: 503: %s", fn.__name__, message)
            raise HTTPException(503, message, headers={"Retry-After": "5"}) from None

    auth = [Depends(authorized)]

    @app.get("/metrics", dependencies=auth, include_in_schema=False)
    def metrics() -> Response:
        """This process's Prometheus registry (slipstream_control_*), behind the token like the jobs."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

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

    # The built-in web page (slipstream/cluster/ui.py): HTML and script without auth (they hold no data); the
    # script calls the JSON routes above with the token the user pastes (kept in sessionStorage).
    from slipstream.cluster import ui

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
        req = req or StopRequest()
        return call(ctl().stop, name, req.force, req.checkpoint)

    @app.delete("/jobs/{name}", dependencies=auth, summary="Remove an ended job's records")
    def remove(name: str, purge: bool = False) -> dict:
        """Deletes the job's control records and Redis keys; refuses (409) a job that may still run.
        `purge`: also delete the job's own directory HOME/jobs/NAME and nothing outside it (a symlink
        there is removed as a link, its target kept: `link_removed`)."""
        return call(ctl().remove, name, purge)

    @app.post("/jobs/{name}/checkpoint", dependencies=auth, summary="Checkpoint after the current step")
    def checkpoint(name: str) -> dict:
        return call(ctl().checkpoint, name)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from slipstream.cluster import state as cluster_state
    from slipstream.cluster.control import JobControl
    from slipstream.cluster.targets import TargetWriter

    p = argparse.ArgumentParser(prog="python -m slipstream.cluster.api", description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, required=True, help="the cluster's state directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--tool-modules",
        default=None,
        metavar="MOD[,MOD...]",
        help="jobs' custom tools may come only from these modules ('': builtin tools only; default: any)",
    )
    p.add_argument(
        "--input-root",
        action="append",
        metavar="DIR",
        help="jobs' input paths must lie here or in their own directory (repeatable; default: HOME, the "
        "project, the temp directory)",
    )
    add_limit_arguments(p, LIMITS)
    args = p.parse_args(argv)
    limits = limits_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    info = cluster_state.load_info(args.home)
    tool_modules = None if args.tool_modules is None else [m for m in args.tool_modules.split(",") if m]
    control = JobControl(info, tool_modules=tool_modules, input_roots=args.input_root)
    try:  # after a cluster restart, jobs that were running have no driver any more: mark them
        if marked := control.reconcile():
            log.warning("jobs whose driver is gone, marked: %s", ", ".join(marked))
    except Exception as e:  # Redis or Ray not answering: get/list/stop/submit reconcile later
        log.warning("start-up reconcile of the jobs failed: %s", e)
    threading.Thread(target=control.warm, name="ray-job-client", daemon=True).start()
    # Prometheus discovers every job's processes from the file this writes (deploy/prometheus.yml).
    targets = TargetWriter(control.r, Path(info.home) / "prometheus" / "targets")
    targets.start()
    log.info("control API on %s:%d for the cluster at %s (%s)", args.host, args.port, args.home, limits)
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "serving plain HTTP on %s: the bearer token crosses the network in clear text; put a TLS "
            "reverse proxy in front of it (README: Security)",
            args.host,
        )
    log.info("job inputs from: %s", ", ".join(args.input_root or ["HOME, the project, the temp directory"]))
    log.info(
        "custom tools from: %s",
        "any module" if tool_modules is None else ", ".join(tool_modules) or "nowhere (builtin tools only)",
    )
    try:
        uvicorn.run(
            create_app(info.api_token, control, body_timeout_s=limits.body_timeout_s),
            host=args.host,
            port=args.port,
            log_level="warning",
            **limits.uvicorn_kwargs(),
        )
    finally:
        targets.stop()


if __name__ == "__main__":
    main()
