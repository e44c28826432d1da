"""The built-in engine's FastAPI app: SGLang's native API subset (docs/sglang_api.md) over a Runner,
assembled from its route groups (generation, weights and generation control, health and information)
behind the API key and body guards.

Handlers only parse, validate and wait: compute runs on the runner's generation thread, blocking
collectives and loads in the weight thread, so the event loop always answers /health and /abort_request.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.routing import APIRoute

from common.http_guard import ENGINE_LIMITS, BearerGuard, BodyGuard
from generator_fleet.engine import (
    generate_routes,
    info_routes,
    lora_routes,
    memory_routes,
    profile_routes,
    weight_routes,
)
from generator_fleet.engine.api_types import (
    AbortRequest,
    BadRequest,
    ContinueGeneration,
    GenerateReqIn,
    PauseGeneration,
    UpdateWeightsFromDisk,
    UpdateWeightVersion,
    http_error,
    validation_error,
    value_error,
)
from generator_fleet.engine.faults import EngineUnhealthy
from generator_fleet.engine.info_routes import VERSION
from generator_fleet.engine.options import EngineOptions
from generator_fleet.engine.runner import Runner
from generator_fleet.engine.state import EngineState
from weight_bus.schema import (
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    MemoryOccupation,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)

PUBLIC_GET_PATHS = frozenset({"/health", "/metrics"})
"""Reachable without the API key (liveness probes and Prometheus scrapes)."""


def _public(method: str, path: str) -> bool:
    """With an API key, everything but GET /health and GET /metrics needs `Authorization: Bearer <key>`."""
    return method == "GET" and path in PUBLIC_GET_PATHS


def _unauthorized_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"error": {"message": "Unauthorized"}})


def _error_body(status: int, message: str) -> bytes:
    return bytes(http_error(status, message).body)


_BODIES: dict[str, type] = {
    "/generate": GenerateReqIn,
    "/abort_request": AbortRequest,
    "/pause_generation": PauseGeneration,
    "/continue_generation": ContinueGeneration,
    "/init_weights_update_group": InitWeightsUpdateGroup,
    "/update_weights_from_distributed": UpdateWeightsFromDistributed,
    "/update_weights_from_tensor": UpdateWeightsFromTensor,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroup,
    "/update_weights_from_disk": UpdateWeightsFromDisk,
    "/update_weight_version": UpdateWeightVersion,
    "/release_memory_occupation": MemoryOccupation,
    "/resume_memory_occupation": MemoryOccupation,
}
"""The body each route decodes: its handler reads the raw body (msgspec), so FastAPI cannot see it."""


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus each route's request body, generated from the Struct its handler decodes
    (an empty body means all defaults, so a body is required only where a field is)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=VERSION, routes=app.routes)
        refs, components = msgspec.json.schema_components(
            _BODIES.values(), ref_template="#/components/schemas/{name}"
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        for (path, typ), ref in zip(_BODIES.items(), refs, strict=True):
            required = any(f.required for f in msgspec.structs.fields(typ))
            for op in schema["paths"][path].values():
                op["requestBody"] = {"required": required, "content": {"application/json": {"schema": ref}}}
        app.openapi_schema = schema
    return app.openapi_schema


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    return validation_error(str(exc))


async def _on_bad_request(request: Request, exc: Exception) -> Response:
    return value_error(str(exc))


async def _on_unhealthy(request: Request, exc: Exception) -> Response:
    return http_error(503, f"engine unhealthy: {exc}")


async def _on_error(request: Request, exc: Exception) -> Response:
    # An engine bug still answers in SGLang's shape (Starlette logs the traceback).
    return http_error(500, f"{type(exc).__name__}: {exc}")


def build_app(
    runner: Runner,
    options: EngineOptions,
    *,
    api_key: str | None = None,
    body_timeout_s: float | None = ENGINE_LIMITS.body_timeout_s,
) -> FastAPI:
    """The FastAPI app over a started runner (EngineServer wires lifecycle; tests may use this alone):
    `options` gives the served model name and the request bounds. OpenAPI at /openapi.json (behind the
    API key like every route but /health and /metrics)."""
    model_name = options.served_model_name or runner.model_path
    app = FastAPI(title="slipstream built-in engine", docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)
    app.state.engine = EngineState(runner, model_name, options.max_requests_per_call)

    # Plain ASGI (common/http_guard.py), so they add nothing to the /generate path but a compare: the
    # key is checked on the request head before any body byte is read; a body over the limit is a 413,
    # by its Content-Length or (chunked) as soon as the bytes read pass it; a stalled body is a 408.
    app.add_middleware(
        BodyGuard,
        max_bytes=options.max_body_bytes,
        body_timeout_s=body_timeout_s,
        error_body=_error_body,
        what="the engine's",
    )
    app.add_middleware(  # the outer one: no key, no 413 either
        BearerGuard, token=api_key, public=_public, error_body=_unauthorized_body, message="Unauthorized"
    )
    # msgspec.DecodeError also catches its subclass msgspec.ValidationError.
    app.add_exception_handler(msgspec.DecodeError, _on_validation_error)
    app.add_exception_handler(BadRequest, _on_bad_request)
    app.add_exception_handler(EngineUnhealthy, _on_unhealthy)
    app.add_exception_handler(Exception, _on_error)

    for group in (generate_routes, weight_routes, lora_routes, memory_routes, profile_routes, info_routes):
        _add_routes(app, group.router)
    return app


def _add_routes(app: FastAPI, router: APIRouter) -> None:
    """Add a route group's routes to the app itself, not as an included router: `app.routes` then lists
    every route (the security tests enumerate them) and a request is matched in one routing level."""
    for r in router.routes:
        assert isinstance(r, APIRoute), r
        app.add_api_route(
            r.path,
            r.endpoint,
            methods=sorted(r.methods),
            name=r.name,
            operation_id=r.operation_id,
            response_class=r.response_class,
            responses=r.responses,
        )
