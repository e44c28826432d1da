"""The engine's weight and generation-control routes: pause / continue, joining and leaving a weight
update group, receiving weights from it or loading them from disk, the weight version, and /flush_cache.

Weight operations run one at a time (the state's weight lock) in the state's weight thread, so the event
loop keeps answering /health and /abort_request while a receive blocks on the trainer."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec
import torch
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from generator_fleet.engine.api_types import (
    ContinueGeneration,
    GetWeightsByName,
    PauseGeneration,
    UpdateWeightsFromDisk,
    UpdateWeightVersion,
    control,
    decode,
    http_error,
    json_response,
)
from generator_fleet.engine.state import EngineState, engine_state
from weight_bus import ipc
from weight_bus.schema import (
    COMPLETION_EVENT,
    BuiltinUpdateWeightsFromTensor,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)

log = logging.getLogger(__name__)

router = APIRouter()

_WEIGHT_TRACE = os.environ.get("SLIPSTREAM_WEIGHT_TRACE")
"""Diagnostics: a file to append, per weight update, the GPU timeline of each bucket (CUDA events before
the receive, after it, after the load copy; ms from the first), to see where the engine's GPU waits.
/update_weights_from_tensor: before mapping the payload, before the load, after the load's copy."""


_STREAM_SCRATCH = os.environ.get("SLIPSTREAM_STREAM_SCRATCH") == "1"
"""Diagnostics: streamed arena buckets land in a scratch buffer, not the weights (the weights stay as they
were), to tell the receive's own speed from that of receiving into the serving weights."""


def trace_event():
    """A recorded CUDA event when tracing (SLIPSTREAM_WEIGHT_TRACE on a CUDA engine), else None."""
    if not (_WEIGHT_TRACE and torch.cuda.is_available()):
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def trace_bucket(state: EngineState, events: list, last: bool) -> None:
    """Keep one bucket's events; after the update's last bucket, append its timeline to the trace file."""
    state.trace.append(events)
    if not last:
        return
    torch.cuda.synchronize()
    t0 = state.trace[0][0]
    rows = [[round(t0.elapsed_time(e), 3) for e in ev] for ev in state.trace]
    state.trace.clear()
    with open(_WEIGHT_TRACE, "a") as f:
        f.write(msgspec.json.encode(rows).decode() + "\n")


def receive_and_load(state: EngineState, body: UpdateWeightsFromDistributed, t1: float) -> list:
    """One bucket of /update_weights_from_distributed, in one worker thread: receive (a CUDA engine
    overlaps it with the copy of the bucket before: weight_bus.receiver._Ring), then copy into the weights
    at a step boundary. Observes the receive and load phases (host time) and, when tracing, CUDA events
    before the receive, after it and after the copy."""
    phases = state.metrics.bucket_phase
    events = [trace_event()]
    marks: list[float] = []

    def load(named: list) -> None:
        marks.append(time.perf_counter())
        events.append(trace_event())
        if body.lora_name is not None:
            load_adapter_bucket(state, body, named)
        else:
            state.runner.load_weights(named, body.weight_version)

    named = state.receiver.receive(body, load)
    t3 = time.perf_counter()
    phases["receive"].observe(marks[0] - t1)
    phases["load"].observe(t3 - marks[0])
    if events[0] is not None:
        events.append(trace_event())
        trace_bucket(state, events, body.weight_version is not None)
    return named


# Long: one streamed update on the engine, in order, with its error branches sharing one clean-up
def receive_stream(state: EngineState, body: UpdateWeightsFromDistributed, t1: float) -> dict:
    """A whole streamed update (`body.stream`, one call), in the weight thread: every bucket received back
    to back (weight_bus.receiver.receive_stream), arena buckets straight into the weights, named ones
    copied in (or kept for the adapter). Generation waits at a step boundary for the whole receive when
    it writes the serving weights; staged (`body.stage`, and room for the staging arena), it goes on
    while the arena buckets land beside the weights and waits only for the copy over them at the end.
    If the receive fails after the serving weights were written, the engine stays paused (its weights
    are partly new) until a later full update succeeds. Returns the answer's extra fields: `paused_ms`
    (how long generation waited), `staged`, and `marks` (perf_counter seconds: the weight lock taken, the
    receive begun, its first and last broadcast posted, all received, the answer made)."""
    runner = state.runner
    arena_buckets = [b for b in body.stream if b.offset is not None]
    if arena_buckets:
        layout = runner.weight_layout()
        if layout is None or layout.digest != body.layout:
            raise ValueError(
                f"weight layout {body.layout} planned by the trainer is not this engine's "
                f"({layout.digest if layout else 'none: no weight arena'}); send named buckets"
            )
    adapter = body.lora_name is not None
    if not adapter:
        for b in body.stream:
            if b.offset is None:
                runner.check_named(
                    [(n, torch.empty(s, device="meta")) for n, s in zip(b.names, b.shapes, strict=True)]
                )
    staged = bool(arena_buckets) and body.stage and runner.staged_arena()
    live = not adapter and not staged  # the receive itself writes the serving weights
    # a full update sends every weight: the whole arena, or every name in named buckets
    covers = not arena_buckets or sum(b.nbytes for b in arena_buckets) >= layout.nbytes
    phases = state.metrics.bucket_phase

    touched = [False]  # a receive into the serving weights was posted, or a copy into them queued

    def target(b):
        if b.offset is None:
            return None
        touched[0] = touched[0] or live
        if _STREAM_SCRATCH:  # diagnostics: the same receive, into memory the weights do not use
            if state.scratch is None or state.scratch.numel() < layout.nbytes:
                state.scratch = torch.empty(layout.nbytes, dtype=torch.uint8, device=runner.device)
            return state.scratch[b.offset : b.offset + b.nbytes]
        return runner.arena_range(b.offset, b.nbytes, staged=staged)

    def load(b, named: list) -> None:
        if adapter:
            one = msgspec.structs.replace(body, weight_version=None)
            load_adapter_bucket(state, one, named)
        else:
            touched[0] = True
            runner.copy_weights(named)

    held = [0.0]
    marks = [t1]

    def receive() -> None:
        t = time.perf_counter()
        marks.append(t)
        try:
            marks.extend(state.receiver.receive_stream(body, target, load))
        except BaseException:
            if touched[0]:  # part of the serving weights is new, part old: no token may come from them
                runner.pause("in_place")
                state.weights_incomplete = True
                log.warning(
                    "streamed weight update failed after writing the weights: generation stays paused"
                )
            raise
        phases["receive"].observe(time.perf_counter() - t)
        if live:
            if body.weight_version is not None:
                runner.set_weight_version(body.weight_version)
            runner.weights_changed()  # a bucket of a multi-part update changed weights too
            held[0] = time.perf_counter() - t

    def swap() -> None:
        t = time.perf_counter()
        runner.swap_staged(body.weight_version)
        held[0] = time.perf_counter() - t
        phases["load"].observe(held[0])

    if live:
        runner.at_step_boundary(receive)
    else:
        receive()
        if staged:
            runner.at_step_boundary(swap)
    if adapter:  # generation waits only while the adapter is swapped in (LoraBank's own step boundary)
        tensors = state.lora_pending.get(body.lora_name)
        if tensors:
            t = time.perf_counter()
            load_adapter_bucket(state, msgspec.structs.replace(body, stream=None), [])
            held[0] = time.perf_counter() - t
        elif body.weight_version is not None:
            runner.set_weight_version(body.weight_version)
    if state.weights_incomplete and not adapter and covers:
        state.weights_incomplete = False
        runner.resume()
        log.info("weights complete again after a full update: generation goes on")
    marks.append(time.perf_counter())
    return {
        "paused_ms": round(held[0] * 1e3, 3),
        "staged": staged,
        "resumed": not state.weights_incomplete,
        "marks": marks,  # perf_counter: CLOCK_MONOTONIC, the same clock as a trainer on this host
    }


def load_adapter_bucket(state: EngineState, body: UpdateWeightsFromDistributed, named: list) -> None:
    """A bucket of a LoRA adapter sent over the group (`lora_name`): its tensors are kept (copied out of
    the receive buffer) until the update's last bucket (the one with the version), which loads the whole
    adapter at once, replacing the loaded one of that name atomically, and sets the version."""
    if body.lora_config is None:
        raise ValueError("lora_name needs lora_config (the adapter's PEFT adapter_config)")
    pending = state.lora_pending.setdefault(body.lora_name, {})
    for name, t in named:
        pending[name] = t.clone()
    if body.weight_version is None:
        return
    tensors = state.lora_pending.pop(body.lora_name)
    t0 = time.perf_counter()
    try:
        state.runner.load_lora(body.lora_name, body.lora_config, tensors, weight_version=body.weight_version)
    except Exception:
        state.metrics.lora_op("update", False)
        raise
    state.metrics.lora_op("update", True)
    state.metrics.lora_op_seconds.observe(time.perf_counter() - t0)
    log.info(
        "LoRA adapter %s replaced from group %s (%d tensors) at version %s",
        body.lora_name,
        body.group_name,
        len(tensors),
        body.weight_version,
    )


def load_from_tensor(state: EngineState, body: BuiltinUpdateWeightsFromTensor, t1: float) -> dict:
    """One /update_weights_from_tensor call, in the weight thread: map the sender's memory (CUDA IPC or
    shared memory), copy into the weights at a step boundary (cast to the engine dtype), and make sure the
    copy is done before the sender reuses that memory: wait for it before answering, or (`completion:
    "event"`, a CUDA engine) answer once it is queued, with the engine's interprocess CUDA event, recorded
    after the copy, for the sender to wait on. The engine's own later steps run after the copy either way
    (one stream). A payload this engine loaded before (the sender's persistent buffers, serialized once) is
    not unpickled again: its tensors, still mapped, come from ipc.OpenedHandles and were checked against
    the weights then; the answer's `payload_ref` names it, for the sender to send instead of the payload
    while the engine keeps it. Returns the answer's extra fields (with `tensors`, the count loaded)."""
    phases = state.metrics.bucket_phase
    cuda = state.runner.device.type == "cuda"
    events = [trace_event()]
    entry = body.serialized_named_tensors[0]
    with state.receiver.gpu_lock:  # opening IPC handles (and their events) never lands in a graph capture
        named = state.opened.lookup(entry, body.load_format)
        kept = named is not None
        if not kept:
            if entry.startswith(ipc.PAYLOAD_REF):
                raise ValueError(
                    f"unknown payload reference {entry}: this engine does not keep it; send the payload"
                )
            named = ipc.load_payload(entry, body.load_format)
    how = ("ref" if entry.startswith(ipc.PAYLOAD_REF) else "kept") if kept else "opened"
    state.metrics.ipc_payloads.labels(state.model_name, how).inc()
    t2 = time.perf_counter()
    phases["receive"].observe(t2 - t1)
    out: dict = {"tensors": len(named)}
    try:
        events.append(trace_event())
        state.runner.load_weights(named, body.weight_version, checked=kept)
        events.append(trace_event())
        if cuda and body.completion == COMPLETION_EVENT:
            out["event"] = state.copy_done(torch.cuda.current_stream(state.runner.device))
        elif cuda:
            torch.cuda.current_stream(state.runner.device).synchronize()
        out["payload_ref"] = state.opened.remember(entry, body.load_format, named)
        if events[0] is not None:
            trace_bucket(state, events, body.weight_version is not None)
        return out
    except BaseException:
        with state.receiver.gpu_lock:
            closed = state.opened.clear()
        log.info("weights from tensor: load failed, closed %d mapped sender buffers", closed)
        raise
    finally:
        phases["load"].observe(time.perf_counter() - t2)
        with state.receiver.gpu_lock:
            del named  # the mappings stay open only while state.opened keeps them
            if body.weight_version is not None:
                closed = state.opened.end_update()
                if closed:
                    log.info("weights from tensor: closed %d sender buffers the update did not use", closed)


def tensor_request_problem(body: UpdateWeightsFromTensor) -> str | None:
    """What is wrong with an /update_weights_from_tensor body before anything is loaded."""
    if len(body.serialized_named_tensors) != 1:
        return (
            f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries; the built-in "
            "engine is one TP rank (tp_size 1), so it takes exactly one"
        )
    if body.load_format not in ipc.LOAD_FORMATS:
        return f"load_format {body.load_format!r}: expected null, 'direct' or {ipc.FLATTENED_BUCKET!r}"
    return None


def group_problem(req: InitWeightsUpdateGroup) -> str | None:
    """What is wrong with a group request, named by field, before it reaches torch's rendezvous (whose
    errors for these are pybind signatures, or a wait on a peer that cannot exist)."""
    try:
        port = int(req.master_port)
    except ValueError:
        return f"master_port must be a port number, got {req.master_port!r}"
    if not 0 <= port <= 65535:
        return f"master_port must be in [0, 65535], got {port}"
    if req.world_size < 2:
        return f"world_size must be at least 2 (the trainer and this engine), got {req.world_size}"
    if not 1 <= req.rank_offset < req.world_size:
        return f"rank_offset must be in [1, world_size={req.world_size}) (rank 0 is the trainer), got {req.rank_offset}"
    if req.timeout_s is not None and not req.timeout_s > 0:
        return f"timeout_s must be positive, got {req.timeout_s}"
    return None


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, PauseGeneration)
    if body.mode not in ("abort", "retract", "in_place"):
        return control(False, f"pause mode {body.mode!r} is not one of abort, retract, in_place")
    state.unpaused.clear()
    if state.paused_at is None:
        state.paused_at = time.monotonic()
    await asyncio.to_thread(runner.pause, body.mode)  # returns once aborted calls returned / KV freed
    log.info("generation paused (mode=%s)", body.mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    await decode(request, ContinueGeneration)
    runner.resume()
    state.unpaused.set()
    if state.paused_at is not None:
        state.metrics.pause_seconds.observe(time.monotonic() - state.paused_at)
        state.paused_at = None
    log.info("generation continued (weight version %s)", runner.weight_version)
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    state = engine_state(request)
    body = await decode(request, InitWeightsUpdateGroup)
    if why := group_problem(body):
        return control(False, f"Failed to init weight update group: {why}")
    async with state.weight_lock:
        try:
            # Blocks until the trainer (rank 0) and every other engine rank have joined.
            await state.in_weight_thread(state.receiver.init_group, body)
        except Exception as e:
            log.warning("init_weights_update_group failed: %s", e)
            return control(False, f"Failed to init weight update group: {e}")
    log.info("joined weight update group %s", body.group_name)
    return control(True, "Succeeded to initialize custom process group.")


async def locked_update(state: EngineState, body, load, route: str):
    """One weight load under the weight lock, in the weight thread: `load(state, body, t1)`'s result, or
    the error answer (503 and the engine goes down on a CUDA fault). Observes the wait for the lock and
    aborts every request first when the body asks."""
    runner = state.runner
    t0 = time.perf_counter()
    async with state.weight_lock:
        t1 = time.perf_counter()
        state.metrics.bucket_phase["wait"].observe(t1 - t0)
        if body.abort_all_requests:
            runner.abort(abort_all=True)
        try:
            return await state.in_weight_thread(load, state, body, t1)
        except Exception as e:
            if runner.poison(e):  # a CUDA fault: the engine goes down (logged there); the bus drops it
                return http_error(503, f"engine unhealthy: {runner.fatal}")
            log.warning("%s failed: %s", route, e)
            return control(False, f"Failed to update weights: {e}")


@router.post("/get_weights_by_name")
async def get_weights_by_name(request: Request) -> Response:
    """SGLang's /get_weights_by_name: what the engine computes with, for checking an update landed."""
    state = engine_state(request)
    body = await decode(request, GetWeightsByName)
    weights = state.runner.model.state_dict()
    if body.name not in weights:
        return http_error(400, f"no weight {body.name!r}")

    def rows() -> list:
        return weights[body.name][: body.truncate_size].float().cpu().tolist()

    async with state.weight_lock:  # not halfway through an update
        return json_response(await state.in_weight_thread(rows))


@router.get("/weight_layout")
async def weight_layout(request: Request) -> Response:
    """Where every weight lives in the engine's arena (weight_bus.schema.WeightLayout), for a trainer to
    plan buckets that are received in place; 404 without an arena (or while the weights are released)."""
    layout = engine_state(request).runner.weight_layout()
    if layout is None:
        return http_error(404, "this engine's weights are not in one arena (or are released)")
    return Response(msgspec.json.encode(layout), media_type="application/json")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, UpdateWeightsFromDistributed)
    if body.stream is not None:
        out = await locked_update(state, body, receive_stream, "update_weights_from_distributed")
        if state.weights_incomplete:
            state.unpaused.clear()  # new requests wait for weights that are whole again
        if isinstance(out, Response):
            return out
        if out.pop("resumed") and state.paused_at is None:
            state.unpaused.set()
        state.metrics.weight_updates.inc()
        log.info(
            "weights updated from %s: %d buckets streamed (%s%s), generation waited %.1f ms; version %s",
            body.group_name,
            len(body.stream),
            "staged" if out["staged"] else "in place",
            f", adapter {body.lora_name}" if body.lora_name else "",
            out["paused_ms"],
            runner.weight_version,
        )
        return control(True, "Succeeded to update parameter online.", **out)
    named = await locked_update(state, body, receive_and_load, "update_weights_from_distributed")
    if isinstance(named, Response):
        return named
    state.metrics.weight_updates.inc()
    # One INFO line per update (its last bucket carries the version), not per bucket.
    log.log(
        logging.INFO if body.weight_version is not None else logging.DEBUG,
        "weights updated from %s (%d tensors) to version %s",
        body.group_name,
        len(named),
        runner.weight_version,
    )
    return control(True, "Succeeded to update parameter online.")


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, BuiltinUpdateWeightsFromTensor)
    if why := tensor_request_problem(body):
        return control(False, f"Failed to update weights: {why}")
    out = await locked_update(state, body, load_from_tensor, "update_weights_from_tensor")
    if isinstance(out, Response):
        return out
    state.metrics.weight_updates.inc()
    log.log(
        logging.INFO if body.weight_version is not None else logging.DEBUG,
        "weights updated from tensor (%d tensors, %s) to version %s",
        out.pop("tensors"),
        body.load_format or "direct",
        runner.weight_version,
    )
    return control(True, "Success", **out)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    state = engine_state(request)
    body = await decode(request, DestroyWeightsUpdateGroup)
    async with state.weight_lock:
        try:
            state.receiver.destroy(body.group_name)
        except ValueError as e:
            return control(False, str(e))
    log.info("left weight update group %s", body.group_name)
    return control(True, "Succeeded to destroy custom process group.")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, UpdateWeightsFromDisk)
    async with state.weight_lock:
        if body.abort_all_requests:
            runner.abort(abort_all=True)
        try:
            await state.in_weight_thread(runner.load_weights_from_disk, body.model_path, body.weight_version)
        except Exception as e:
            if not runner.poison(e):
                log.warning("update_weights_from_disk(%s) failed: %s", body.model_path, e)
            return control(
                False, f"Failed to update weights from {body.model_path}: {e}", num_paused_requests=0
            )
    state.metrics.weight_updates.inc()
    log.info("weights updated from disk %s to version %s", body.model_path, runner.weight_version)
    return control(True, "Succeeded to update model weights.", num_paused_requests=0)


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, UpdateWeightVersion)
    if body.abort_all_requests:
        runner.abort(abort_all=True)
    runner.set_weight_version(body.new_version)
    log.info("weight version set to %s", body.new_version)
    return json_response(
        {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }
    )


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    runner = engine_state(request).runner
    return json_response({"weight_version": runner.weight_version})


async def flush_cache(request: Request) -> Response:
    """Empty the prefix cache; SGLang's text, and its 400 while requests are running or waiting."""
    done = engine_state(request).runner.flush_cache()
    return Response(
        "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
        "waiting requests, the operation will not be performed.)\n",
        status_code=200 if done else 400,
        media_type="text/plain",
    )


for method in ("GET", "POST"):
    router.add_api_route(
        "/flush_cache",
        flush_cache,
        methods=[method],
        operation_id=f"flush_cache_{method.lower()}",
        response_class=PlainTextResponse,
    )
