"""The engine's profiling routes (SGLang's): GET|POST /start_profile {"output_dir", "num_steps",
"activities": ["CPU", "GPU"], "record_shapes", "with_stack"} profiles the generation steps from the next
one on, until `num_steps` steps ran or GET|POST /stop_profile; the files land in the engine's profile
directory (`--profile-dir`; engine/profiling.py). A start while profiling is off, with an output_dir outside
that directory or while a profile runs is a 400 saying so ({"error": {"message"}}); a stop with none running
too."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from generator_fleet.engine.api_types import StartProfile, decode, value_error
from generator_fleet.engine.profiling import ProfileError
from generator_fleet.engine.state import engine_state

router = APIRouter()


async def start_profile(request: Request) -> Response:
    body = await decode(request, StartProfile)
    try:
        engine_state(request).runner.start_profile(
            output_dir=body.output_dir,
            num_steps=body.num_steps,
            activities=body.activities,
            record_shapes=body.record_shapes,
            with_stack=body.with_stack,
        )
    except ProfileError as e:
        return value_error(str(e))
    return PlainTextResponse("Start profiling.\n")


async def stop_profile(request: Request) -> Response:
    if not engine_state(request).runner.stop_profile():
        return value_error("Profiling is not in progress.")
    return PlainTextResponse("Stop profiling. This will take some time.\n")


for method in ("GET", "POST"):
    for path, endpoint in (("/start_profile", start_profile), ("/stop_profile", stop_profile)):
        router.add_api_route(
            path,
            endpoint,
            methods=[method],
            operation_id=f"{path.strip('/')}_{method.lower()}",
            response_class=PlainTextResponse,
        )
