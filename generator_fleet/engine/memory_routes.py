"""The engine's memory routes (SGLang's native API): POST (or GET) /release_memory_occupation and
/resume_memory_occupation {"tags": [...]}, which free and take back the device memory of the KV pool, the
weights and the captured graphs so a colocated trainer can use it (generator_fleet/engine/memory.py).

They run like weight operations: one at a time with them (the state's weight lock), in the weight thread,
so the event loop keeps answering /health, /abort_request and /get_server_info meanwhile."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from generator_fleet.engine.api_types import decode, http_error, json_response, value_error
from generator_fleet.engine.memory import resolve_tags
from generator_fleet.engine.state import engine_state
from weight_bus.schema import MemoryOccupation

log = logging.getLogger(__name__)

router = APIRouter()


async def _memory_call(request: Request, action: str) -> tuple[Any, float] | Response:
    """Run the runner's `release_memory` or `resume_memory` (`action`) on the body's tags in the weight
    thread, under the weight lock: its result and seconds, or the error answer."""
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, MemoryOccupation)
    try:
        tags = resolve_tags(body.tags)
    except ValueError as e:
        return value_error(str(e))
    t0 = time.perf_counter()
    async with state.weight_lock:
        try:
            result = await state.in_weight_thread(getattr(runner, f"{action}_memory"), tags)
        except Exception as e:
            if runner.poison(e):
                return http_error(503, f"engine unhealthy: {runner.fatal}")
            log.warning("%s_memory_occupation %s failed: %s", action, tags, e)
            return value_error(f"Failed to {action} memory occupation {tags}: {e}")
    return result, time.perf_counter() - t0


async def release_memory_occupation(request: Request) -> Response:
    out = await _memory_call(request, "release")
    if isinstance(out, Response):
        return out
    (freed, seconds), state = out, engine_state(request)
    if freed:
        state.metrics.memory_seconds["release"].observe(seconds)
    for tag, n in freed.items():  # the tags this call released
        state.metrics.memory_releases[tag].inc()
        state.metrics.memory_freed_bytes[tag].inc(n)
    return json_response(
        {
            "success": True,
            "message": "Memory released." if freed else "Already released.",
            "released": state.runner.released,
            "freed_bytes": freed,
        }
    )


async def resume_memory_occupation(request: Request) -> Response:
    out = await _memory_call(request, "resume")
    if isinstance(out, Response):
        return out
    (resumed, seconds), state = out, engine_state(request)
    if resumed:
        state.metrics.memory_seconds["resume"].observe(seconds)
    return json_response(
        {
            "success": True,
            "message": "Memory resumed." if resumed else "Nothing to resume.",
            "released": state.runner.released,
            "resumed": resumed,
        }
    )


for path, endpoint in (
    ("/release_memory_occupation", release_memory_occupation),
    ("/resume_memory_occupation", resume_memory_occupation),
):
    for method in ("GET", "POST"):  # SGLang's api_route takes both
        router.add_api_route(
            path, endpoint, methods=[method], operation_id=f"{path.strip('/')}_{method.lower()}"
        )
