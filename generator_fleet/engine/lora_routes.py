"""The engine's LoRA adapter routes (SGLang's): /load_lora_adapter (a PEFT directory),
/load_lora_adapter_from_tensors (the weight_bus.ipc payload of /update_weights_from_tensor: CUDA IPC or
shared memory) and /unload_lora_adapter. Each answers SGLang's LoRAUpdateOutput, `{"success",
"error_message", "loaded_adapters"}` (plus "message", as our other control routes), 200 or 400.

A load runs like a weight update: under the weight lock, in the weight thread, applied at a step boundary
(never inside a step or a CUDA graph capture). Loading a name that is already loaded replaces that adapter
in place (SGLang refuses it: there a replacement is an unload and a load)."""

from __future__ import annotations

import logging
import time

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from generator_fleet.engine.api_types import decode, http_error, json_response
from generator_fleet.engine.state import EngineState, engine_state
from weight_bus import ipc
from weight_bus.schema import LoadLoraAdapter, LoadLoraAdapterFromTensors, UnloadLoraAdapter

log = logging.getLogger(__name__)

router = APIRouter()


def lora_answer(state: EngineState, success: bool, error: str | None = None) -> Response:
    body = {
        "success": success,
        "error_message": error,
        "message": error or "Success",
        "loaded_adapters": state.runner.lora_adapters(),
    }
    return json_response(body, 200 if success else 400)


async def locked_lora(state: EngineState, op: str, what: str, fn, *args) -> Response:
    """`fn(*args)` under the weight lock in the weight thread; the LoRAUpdateOutput answer."""
    runner = state.runner
    t0 = time.perf_counter()
    async with state.weight_lock:
        try:
            await state.in_weight_thread(fn, *args)
        except Exception as e:
            if runner.poison(e):
                return http_error(503, f"engine unhealthy: {runner.fatal}")
            log.warning("%s failed: %s", what, e)
            state.metrics.lora_op(op, False)
            return lora_answer(state, False, f"Failed to {what}: {e}")
    state.metrics.lora_op(op, True)
    state.metrics.lora_op_seconds.observe(time.perf_counter() - t0)
    return lora_answer(state, True)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = engine_state(request)
    body = await decode(request, LoadLoraAdapter)
    resp = await locked_lora(
        state, "load", "load LoRA adapter", state.runner.load_lora_from_dir, body.lora_name, body.lora_path
    )
    if resp.status_code == 200:
        log.info("LoRA adapter %s loaded from %s", body.lora_name, body.lora_path)
    return resp


def _load_from_tensors(state: EngineState, body: LoadLoraAdapterFromTensors) -> None:
    with state.receiver.gpu_lock:  # opening IPC handles never lands in a graph capture
        named = ipc.load_payload(body.serialized_named_tensors[0], body.load_format)
    try:
        state.runner.load_lora(body.lora_name, body.config_dict, named)
        if state.runner.device.type == "cuda":
            torch.cuda.current_stream(state.runner.device).synchronize()
    finally:
        with state.receiver.gpu_lock:
            del named  # closes the IPC mappings


@router.post("/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request) -> Response:
    state = engine_state(request)
    body = await decode(request, LoadLoraAdapterFromTensors)
    if len(body.serialized_named_tensors) != 1:
        return lora_answer(
            state,
            False,
            f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries; the built-in engine "
            "is one TP rank, so it takes exactly one",
        )
    if body.load_format not in ipc.LOAD_FORMATS:
        return lora_answer(
            state,
            False,
            f"load_format {body.load_format!r}: expected null, 'direct' or {ipc.FLATTENED_BUCKET!r}",
        )
    resp = await locked_lora(
        state, "load_from_tensors", "load LoRA adapter from tensors", _load_from_tensors, state, body
    )
    if resp.status_code == 200:
        log.info("LoRA adapter %s loaded from tensors", body.lora_name)
    return resp


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = engine_state(request)
    body = await decode(request, UnloadLoraAdapter)
    resp = await locked_lora(state, "unload", "unload LoRA adapter", state.runner.unload_lora, body.lora_name)
    if resp.status_code == 200:
        log.info("LoRA adapter %s unloaded", body.lora_name)
    return resp
