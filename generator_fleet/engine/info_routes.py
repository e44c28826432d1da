"""The engine's health and information routes: /health (liveness; 503 once a fatal CUDA error hit),
/health_generate (a one-token generation), /model_info, /server_info (SGLang's fields plus the weight
update groups and the runner's internal state) and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from generator_fleet.engine.api_types import http_error, json_response
from generator_fleet.engine.request import Request as GenRequest
from generator_fleet.engine.request import SamplingParams
from generator_fleet.engine.state import EngineState, engine_state
from weight_bus import ipc

VERSION = "slipstream-builtin"
HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLANG_HEALTH_CHECK_TIMEOUT's default."""

router = APIRouter()


@router.get("/health", response_class=Response)
async def health(request: Request) -> Response:
    runner = engine_state(request).runner
    if runner.fatal is not None:
        return http_error(503, f"engine unhealthy: {runner.fatal}")
    return Response(status_code=200)


@router.get("/health_generate", response_class=Response)
async def health_generate(request: Request) -> Response:
    runner = engine_state(request).runner
    if runner.paused:
        return http_error(503, "generation is paused")
    if runner.released:
        return http_error(503, f"memory is released ({', '.join(runner.released)})")
    req = GenRequest(
        f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0)
    )
    try:
        c = await asyncio.wait_for(asyncio.wrap_future(runner.submit(req)), HEALTH_CHECK_TIMEOUT_S)
    except Exception as e:
        runner.abort_requests([req], "health check timed out")
        return http_error(503, f"health check failed: {e!r}")
    if c.finish_reason["type"] == "abort":
        return http_error(503, f"health check aborted: {c.finish_reason['message']}")
    return Response(status_code=200)


def model_info(state: EngineState) -> dict[str, Any]:
    """SGLang's /model_info."""
    runner = state.runner
    cfg = runner.config
    return {
        "model_path": runner.model_path,
        "tokenizer_path": runner.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": runner.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    }


def server_info(state: EngineState) -> dict[str, Any]:
    """SGLang's /server_info fields this engine has, plus its weight update groups."""
    runner = state.runner
    snap = runner.snapshot()
    return {
        "model_path": runner.model_path,
        "tokenizer_path": runner.model_path,
        "served_model_name": state.model_name,
        "weight_version": runner.weight_version,
        "device": str(runner.device),
        "device_uuid": ipc.device_uuid(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "max_batch_size": runner.max_batch_size,
        "max_running_requests": runner.max_batch_size,
        "context_length": runner.context_length,
        "max_total_num_tokens": runner.max_total_num_tokens,
        "max_req_input_len": runner.context_length - 1,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "weight_update_groups": sorted(state.receiver.groups),
        "weight_layout": layout.digest if (layout := runner.weight_layout()) is not None else None,
        "memory_released": snap["memory_released"],
        "internal_states": [{**snap, "num_queue_reqs": snap["num_queue_reqs"] + state.waiting}],
        "version": VERSION,
    }


async def get_model_info(request: Request) -> Response:
    return json_response(model_info(engine_state(request)))


async def get_server_info(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    if runner.fatal is not None:  # the weight bus probes this: an unhealthy engine counts as gone
        return http_error(503, f"engine unhealthy: {runner.fatal}")
    return json_response(server_info(state))


for path in ("/model_info", "/get_model_info"):
    router.add_api_route(path, get_model_info, methods=["GET"])
for path in ("/server_info", "/get_server_info"):
    router.add_api_route(path, get_server_info, methods=["GET"])


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    data, content_type = engine_state(request).metrics.render()
    return Response(data, media_type=content_type)
