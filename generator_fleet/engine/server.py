"""HTTP face of the built-in engine: SGLang's native API subset (shared/SGLANG_API.md) over a Runner.

Handlers only parse, validate and wait: compute runs on the runner's generation thread, blocking
collectives and loads in worker threads, so the event loop always answers /health and /abort_request.
`EngineServer` runs the app under uvicorn in a background thread of any process (tests, Ray actors).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import socket
import threading
import time
import uuid
from http import HTTPStatus
from typing import Any, TypeVar

import httpx
import msgspec
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from common.http_guard import ENGINE_LIMITS, BearerGuard, BodyGuard, HttpLimits
from generator_fleet.engine.metrics import EngineMetrics
from generator_fleet.engine.runner import Completion, EngineUnhealthy, Runner, SamplingParams
from generator_fleet.engine.runner import Request as GenRequest
from weight_bus.receiver import WeightReceiver
from weight_bus.schema import DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, UpdateWeightsFromDistributed

log = logging.getLogger(__name__)

VERSION = "slipstream-builtin"
HEALTH_CHECK_TIMEOUT_S = 20.0
"""SGLANG_HEALTH_CHECK_TIMEOUT's default."""
FATAL_EXIT_GRACE_S = 1.0
"""After a fatal CUDA error: how long /health answers 503 (with the cause) before the server stops."""
PUBLIC_GET_PATHS = frozenset({"/health", "/metrics"})
"""Reachable without the API key (liveness probes and Prometheus scrapes)."""
MAX_BODY_BYTES = 64 << 20
"""Default bound on a request body: a batch of long prompts as token ids is a few MiB; larger is a 413."""
LIMITS = ENGINE_LIMITS
MAX_REQUESTS_PER_CALL = 1 << 14
"""Default bound on the requests one /generate call makes (prompts x n): each is queued and kept until
the call returns, so an unbounded `n` would stall the engine for every client."""
MAX_LOGIT_BIAS = 100.0
"""|logit_bias| bound (OpenAI's range): +-100 already forces or bans a token; more overflows the logits."""
SEED_RANGE = (-(1 << 63), 1 << 64)
"""What torch.Generator.manual_seed takes."""

# ---- request bodies ------------------------------------------------------------------------------


class SamplingParamsIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`sampling_params` as sent: SGLang's keys only (others are a 400); null means the default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # Detokenization only: they shape `text`, never the tokens.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    # Accepted and ignored: SGLang also ignores custom_params without a custom logit processor.
    custom_params: dict[str, Any] | None = None
    # Constrained decoding: accepted by the schema, refused when set (ignoring them would silently change
    # what the policy generates).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None


_CONSTRAINED = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")


class GenerateReqIn(msgspec.Struct, kw_only=True):
    """POST /generate body (unknown top-level fields are ignored, as SGLang's dataclass does)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    input_embeds: list[Any] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int | list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None


class PauseGeneration(msgspec.Struct, kw_only=True):
    mode: str = "abort"


class ContinueGeneration(msgspec.Struct, kw_only=True):
    torch_empty_cache: bool = False


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersion(msgspec.Struct, kw_only=True):
    new_version: str
    abort_all_requests: bool = False


class UpdateWeightsFromDisk(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


T = TypeVar("T")


class BadRequest(Exception):
    """A handler's ValueError-class failure, rendered as {"error": {"message"}} (SGLang)."""


# ---- responses -----------------------------------------------------------------------------------


_WEIGHT_TRACE = os.environ.get("SLIPSTREAM_WEIGHT_TRACE")
"""Diagnostics: a file to append, per weight update, the GPU timeline of each bucket (CUDA events before
the receive, after it, after the load copy; ms from the first), to see where the engine's GPU waits."""


def _trace_event():
    """A recorded CUDA event when tracing (SLIPSTREAM_WEIGHT_TRACE on a CUDA engine), else None."""
    if not (_WEIGHT_TRACE and torch.cuda.is_available()):
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _trace_bucket(state, events, last: bool) -> None:
    state.trace.append(events)
    if not last:
        return
    torch.cuda.synchronize()
    t0 = state.trace[0][0]
    rows = [[round(t0.elapsed_time(e), 3) for e in ev] for ev in state.trace]
    state.trace.clear()
    with open(_WEIGHT_TRACE, "a") as f:
        f.write(msgspec.json.encode(rows).decode() + "\n")


def _receive_and_load(state: _EngineState, body: UpdateWeightsFromDistributed, t1: float) -> list:
    """One bucket of /update_weights_from_distributed, in one worker thread: receive (a CUDA engine
    overlaps it with the copy of the bucket before: weight_bus.receiver._Ring), then copy into the weights
    at a step boundary. Observes the receive and load phases (host time) and, when tracing, CUDA events
    before the receive, after it and after the copy."""
    phases = state.metrics.bucket_phase
    events = [_trace_event()]
    marks: list[float] = []

    def load(named: list) -> None:
        marks.append(time.perf_counter())
        events.append(_trace_event())
        state.runner.load_weights(named, body.weight_version)

    named = state.receiver.receive(body, load)
    t3 = time.perf_counter()
    phases["receive"].observe(marks[0] - t1)
    phases["load"].observe(t3 - marks[0])
    if events[0] is not None:
        events.append(_trace_event())
        _trace_bucket(state, events, body.weight_version is not None)
    return named


async def _in_weight_thread(state: _EngineState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.weight_pool, functools.partial(fn, *args))


def _json(obj: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


def _validation_error(message: str) -> Response:
    return _json(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400
    )


def _http_error(code: int, message: str) -> Response:
    body = {
        "object": "error",
        "message": message,
        "type": HTTPStatus(code).phrase,
        "param": None,
        "code": code,
    }
    return _json(body, code)


def _value_error(message: str, code: int = 400) -> Response:
    return _json({"error": {"message": message}}, code)


def _control(success: bool, message: str, **extra: Any) -> Response:
    return _json({"success": success, "message": message, **extra}, 200 if success else 400)


async def _decode(request: Request, typ: type[T]) -> T:
    """Decode the body into `typ`; an empty body means all defaults (SGLang's control endpoints accept it)."""
    body = await request.body()
    return msgspec.json.decode(body or b"{}", type=typ)


def _group_problem(req: InitWeightsUpdateGroup) -> str | None:
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


# ---- /generate helpers ---------------------------------------------------------------------------


class _Item(msgspec.Struct):
    """One result of a /generate call: the runner request plus what shapes its JSON."""

    req: GenRequest
    sp: SamplingParamsIn


def _per_item(value: Any, i: int, n_items: int, name: str, default: Any) -> Any:
    if isinstance(value, list):
        if len(value) != n_items:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n_items}")
        value = value[i]
    return default if value is None else value


def _resolve_sampling(sp: SamplingParamsIn, prompt_len: int, runner: Runner) -> SamplingParams:
    for key in _CONSTRAINED:
        if getattr(sp, key) is not None:
            raise BadRequest(f"sampling_params.{key} is not supported by the built-in engine")
    fields = {
        f: getattr(sp, f)
        for f in SamplingParams.__struct_fields__
        if f not in ("stop", "stop_token_ids", "logit_bias") and getattr(sp, f, None) is not None
    }
    if sp.stop is not None:
        fields["stop"] = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop)
    if sp.stop_token_ids is not None:
        fields["stop_token_ids"] = tuple(sp.stop_token_ids)
    if sp.logit_bias:
        try:
            fields["logit_bias"] = {int(k): float(v) for k, v in sp.logit_bias.items()}
        except ValueError:
            raise BadRequest("logit_bias keys must be token ids") from None
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in fields["logit_bias"].values()):
            raise BadRequest(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].")
    if sp.sampling_seed is not None and not SEED_RANGE[0] <= sp.sampling_seed < SEED_RANGE[1]:
        raise BadRequest(f"sampling_seed must be a 64-bit integer, got {sp.sampling_seed}.")
    # SGLang: an explicit max_new_tokens that does not fit is an error; the default is clamped.
    max_total = runner.context_length - 1
    if sp.max_new_tokens is not None and prompt_len + sp.max_new_tokens > max_total:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {runner.context_length} "
            f"tokens. You requested a total of {prompt_len + sp.max_new_tokens} tokens: {prompt_len} tokens "
            f"from the input messages and {sp.max_new_tokens} tokens for the completion."
        )
    if sp.max_new_tokens is None:
        fields["max_new_tokens"] = max(0, min(SamplingParams().max_new_tokens, max_total - prompt_len))
    params = SamplingParams(**fields)
    try:
        params.verify()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params


def _expand(
    body: GenerateReqIn, runner: Runner, max_requests: int = MAX_REQUESTS_PER_CALL
) -> tuple[list[_Item], bool]:
    """Turn a /generate body into runner requests in response order; returns (items, is_batch)."""
    for key in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "token_ids_logprob"):
        if getattr(body, key) is not None:
            raise BadRequest(f"{key} is not supported by the built-in engine")
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        prompts = [runner.tokenizer.encode(t) for t in texts]
        is_batch = not isinstance(body.text, str)
    else:
        ids = body.input_ids
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if all(isinstance(x, int) for x in ids):
            prompts, is_batch = [list(ids)], False
        elif all(isinstance(x, list) for x in ids):
            prompts, is_batch = [list(x) for x in ids], True
        else:
            raise BadRequest("input_ids must be a list of ints or a list of lists of ints.")
    if not prompts:
        raise BadRequest("the batch is empty.")
    for p in prompts:
        if not p:
            raise BadRequest("input_ids cannot be empty.")
        if len(p) >= runner.context_length:
            raise BadRequest(
                f"The input ({len(p)} tokens) is longer than the model's context length ({runner.context_length} tokens)."
            )
        if min(p) < 0 or max(p) >= runner.vocab_size:
            raise BadRequest(
                f"The input_ids {p} contain values outside the vocabulary (size {runner.vocab_size})."
            )

    sps = body.sampling_params
    if isinstance(sps, list) and not is_batch:
        raise BadRequest("sampling_params is a list but the request is not a batch.")
    sps_by_prompt = [
        _per_item(sps, i, len(prompts), "sampling_params", SamplingParamsIn()) for i in range(len(prompts))
    ]
    ns = {sp.n if sp.n is not None else 1 for sp in sps_by_prompt}
    if len(ns) != 1:
        raise BadRequest("The parallel sample number n must be the same across a batch.")
    n = ns.pop()
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if len(prompts) * n > max_requests:
        raise BadRequest(
            f"the call asks for {len(prompts)} prompt(s) x n={n} = {len(prompts) * n} requests; "
            f"the engine takes at most {max_requests} per call."
        )
    rids = body.rid
    if isinstance(rids, list) and len(rids) != len(prompts):
        raise BadRequest("The rid list must match the batch size.")
    if isinstance(rids, list) and len(set(rids)) != len(rids):
        raise BadRequest("Duplicate rids in one batch.")
    is_batch = is_batch or n > 1

    items: list[_Item] = []
    for i, (prompt, sp) in enumerate(zip(prompts, sps_by_prompt, strict=True)):
        params = _resolve_sampling(sp, len(prompt), runner)
        return_logprob = bool(_per_item(body.return_logprob, i, len(prompts), "return_logprob", False))
        start = int(_per_item(body.logprob_start_len, i, len(prompts), "logprob_start_len", -1))
        top_k = int(_per_item(body.top_logprobs_num, i, len(prompts), "top_logprobs_num", 0))
        for _ in range(n):
            if n > 1 or rids is None:
                rid = uuid.uuid4().hex  # SGLang gives parallel samples fresh rids
            elif isinstance(rids, list):
                rid = rids[i]
            else:
                rid = f"{rids}_{i}" if is_batch else rids
            req = GenRequest(
                rid,
                prompt,
                params,
                return_logprob=return_logprob,
                logprob_start_len=start,
                top_logprobs_num=top_k,
            )
            items.append(_Item(req, sp))
    return items, is_batch


def _render(c: Completion, item: _Item, tokenizer, return_text_in_logprobs: bool) -> dict[str, Any]:
    """SGLang's non-streaming /generate result for one request."""
    sp, req = item.sp, item.req
    skip = sp.skip_special_tokens is not False
    spaces = sp.spaces_between_special_tokens is not False
    text_ids = c.output_ids
    matched = c.finish_reason.get("matched")
    if isinstance(matched, int) and not sp.no_stop_trim and text_ids:
        text_ids = text_ids[:-1]  # SGLang trims the matched stop token from text (not from output_ids)
    text = tokenizer.decode(text_ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if isinstance(matched, str) and not sp.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": c.finish_reason or None,  # null in intermediate stream events
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "weight_version": c.weight_version,
        "num_retractions": c.num_retractions,
    }
    if len(c.weight_versions) > 1:
        meta["weight_versions"] = c.weight_versions
    if req.return_logprob:

        def tok_text(t: int) -> str | None:
            return tokenizer.decode([t]) if return_text_in_logprobs else None

        meta["output_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(c.output_logprobs, c.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(c.output_ids)
        if c.input_logprobs is not None:
            prompt = req.prompt_ids[len(req.prompt_ids) - len(c.input_logprobs) :]
            meta["input_token_logprobs"] = [
                [lp, t, tok_text(t)] for lp, t in zip(c.input_logprobs, prompt, strict=True)
            ]
        else:
            meta["input_token_logprobs"] = []
        if c.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [
                [[lp, t, tok_text(t)] for lp, t in pos] for pos in c.output_top_logprobs
            ]
            meta["input_top_logprobs"] = None
    meta["e2e_latency"] = c.e2e_latency
    return {"text": text, "output_ids": c.output_ids, "meta_info": meta}


# ---- the app -------------------------------------------------------------------------------------


def _public(method: str, path: str) -> bool:
    """With an API key, everything but GET /health and GET /metrics needs `Authorization: Bearer <key>`."""
    return method == "GET" and path in PUBLIC_GET_PATHS


def _unauthorized_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"error": {"message": "Unauthorized"}})


def _error_body(status: int, message: str) -> bytes:
    return bytes(_http_error(status, message).body)


class _EngineState:
    """Per-app state that lives on the event loop: the pause gate, the weight receiver, metrics."""

    def __init__(self, runner: Runner, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name
        self.receiver = WeightReceiver(runner.device, gpu_lock=runner.gpu_lock)
        # New /generate calls wait on this while paused (SGLang: no error, they go on after continue).
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.waiting = 0
        self.paused_at: float | None = None
        self.trace: list = []  # SLIPSTREAM_WEIGHT_TRACE
        self.weight_lock = asyncio.Lock()  # one weight operation at a time: groups receive in order
        # Weight operations run in their own thread, not the loop's default executor: a receive blocked on
        # a sender that is gone must not hold up the server's shutdown (asyncio.run joins the default
        # executor's threads) until the group times out.
        self.weight_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-weights")
        self.metrics = EngineMetrics(runner, model_name, lambda: self.waiting)


_BODIES: dict[str, type] = {
    "/generate": GenerateReqIn,
    "/abort_request": AbortRequest,
    "/pause_generation": PauseGeneration,
    "/continue_generation": ContinueGeneration,
    "/init_weights_update_group": InitWeightsUpdateGroup,
    "/update_weights_from_distributed": UpdateWeightsFromDistributed,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroup,
    "/update_weights_from_disk": UpdateWeightsFromDisk,
    "/update_weight_version": UpdateWeightVersion,
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


def build_app(
    runner: Runner,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_requests_per_call: int = MAX_REQUESTS_PER_CALL,
    body_timeout_s: float | None = LIMITS.body_timeout_s,
) -> FastAPI:
    """The FastAPI app over a started runner (EngineServer wires lifecycle; tests may use this alone).
    OpenAPI at /openapi.json (behind the API key like every route but /health and /metrics)."""
    model_name = served_model_name or runner.model_path
    app = FastAPI(title="slipstream built-in engine", docs_url=None, redoc_url=None)
    app.openapi = lambda: _openapi(app)
    state = _EngineState(runner, model_name)
    app.state.engine = state

    # Plain ASGI (common/http_guard.py), so they add nothing to the /generate path but a compare: the
    # key is checked on the request head before any body byte is read; a body over the limit is a 413,
    # by its Content-Length or (chunked) as soon as the bytes read pass it; a stalled body is a 408.
    app.add_middleware(
        BodyGuard,
        max_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        error_body=_error_body,
        what="the engine's",
    )
    app.add_middleware(  # the outer one: no key, no 413 either
        BearerGuard, token=api_key, public=_public, error_body=_unauthorized_body, message="Unauthorized"
    )

    @app.exception_handler(msgspec.DecodeError)  # also catches its subclass msgspec.ValidationError
    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return _validation_error(str(exc))

    @app.exception_handler(BadRequest)
    async def on_bad_request(request: Request, exc: Exception) -> Response:
        return _value_error(str(exc))

    @app.exception_handler(EngineUnhealthy)
    async def on_unhealthy(request: Request, exc: Exception) -> Response:
        return _http_error(503, f"engine unhealthy: {exc}")

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception) -> Response:
        # An engine bug still answers in SGLang's shape (Starlette logs the traceback).
        return _http_error(500, f"{type(exc).__name__}: {exc}")

    # ---- generation ----

    async def generate(request: Request) -> Response:
        body = await _decode(request, GenerateReqIn)
        items, is_batch = _expand(body, runner, max_requests_per_call)
        if not state.unpaused.is_set():
            state.waiting += 1
            try:
                await state.unpaused.wait()
            finally:
                state.waiting -= 1
        if body.stream:
            return _stream(items, is_batch, body.return_text_in_logprobs)
        futures = [asyncio.wrap_future(runner.submit(it.req)) for it in items]
        try:
            completions = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            # The client went away: free the rows (SGLang aborts on disconnect too).
            runner.abort_requests([it.req for it in items], "Client disconnected")
            raise
        for c in completions:
            state.metrics.e2e_latency.observe(c.e2e_latency)
            if c.time_to_first_token is not None:
                state.metrics.ttft.observe(c.time_to_first_token)
        out = [
            _render(c, it, runner.tokenizer, body.return_text_in_logprobs)
            for c, it in zip(completions, items, strict=True)
        ]
        return _json(out if is_batch else out[0])

    def _stream(items: list[_Item], is_batch: bool, text_in_logprobs: bool) -> StreamingResponse:
        """SGLang's SSE framing: one cumulative `data: {json}` event per new token of any item (batch
        events carry "index"), finish_reason null until the item ends, then `data: [DONE]`. A client
        that disconnects aborts its requests."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        for it in items:
            it.req.listener = lambda: loop.call_soon_threadsafe(wake.set)
        futures = [runner.submit(it.req) for it in items]

        async def events():
            sent: list[int | None] = [-1] * len(items)  # tokens already sent per item; None = finished
            try:
                while any(n is not None for n in sent):
                    await wake.wait()
                    wake.clear()
                    for i, (it, fut) in enumerate(zip(items, futures, strict=True)):
                        if sent[i] is None:
                            continue
                        done = fut.done()
                        c = fut.result() if done else runner.progress(it.req)
                        if not done and len(c.output_ids) == sent[i]:
                            continue
                        obj = _render(c, it, runner.tokenizer, text_in_logprobs)
                        if is_batch:
                            obj["index"] = i
                        yield b"data: " + msgspec.json.encode(obj) + b"\n\n"
                        sent[i] = None if done else len(c.output_ids)
                yield b"data: [DONE]\n\n"
            finally:
                if not all(f.done() for f in futures):
                    runner.abort_requests([it.req for it in items], "Client disconnected")

        return StreamingResponse(events(), media_type="text/event-stream")

    for method in ("POST", "PUT"):  # one route per method: each its own OpenAPI operation id
        app.add_api_route(
            "/generate",
            generate,
            methods=[method],
            operation_id=f"generate_{method.lower()}",
            responses={200: {"content": {"text/event-stream": {}}}},  # "stream": true
        )

    @app.post("/abort_request", response_class=Response)
    async def abort_request(request: Request) -> Response:
        body = await _decode(request, AbortRequest)
        n = runner.abort(body.rid, body.abort_all)
        if n:
            log.info("aborted %d request(s) (rid=%r, abort_all=%s)", n, body.rid, body.abort_all)
        return Response(status_code=200)

    # ---- pause / continue ----

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _decode(request, PauseGeneration)
        if body.mode not in ("abort", "retract", "in_place"):
            return _control(False, f"pause mode {body.mode!r} is not one of abort, retract, in_place")
        state.unpaused.clear()
        if state.paused_at is None:
            state.paused_at = time.monotonic()
        await asyncio.to_thread(runner.pause, body.mode)  # returns once aborted calls returned / KV freed
        log.info("generation paused (mode=%s)", body.mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        await _decode(request, ContinueGeneration)
        runner.resume()
        state.unpaused.set()
        if state.paused_at is not None:
            state.metrics.pause_seconds.observe(time.monotonic() - state.paused_at)
            state.paused_at = None
        log.info("generation continued (weight version %s)", runner.weight_version)
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    # ---- weights ----

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        body = await _decode(request, InitWeightsUpdateGroup)
        if why := _group_problem(body):
            return _control(False, f"Failed to init weight update group: {why}")
        async with state.weight_lock:
            try:
                # Blocks until the trainer (rank 0) and every other engine rank have joined.
                await _in_weight_thread(state, state.receiver.init_group, body)
            except Exception as e:
                log.warning("init_weights_update_group failed: %s", e)
                return _control(False, f"Failed to init weight update group: {e}")
        log.info("joined weight update group %s", body.group_name)
        return _control(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        body = await _decode(request, UpdateWeightsFromDistributed)
        phases = state.metrics.bucket_phase
        t0 = time.perf_counter()
        async with state.weight_lock:
            t1 = time.perf_counter()
            phases["wait"].observe(t1 - t0)
            if body.abort_all_requests:
                runner.abort(abort_all=True)
            try:
                named = await _in_weight_thread(state, _receive_and_load, state, body, t1)
            except Exception as e:
                if runner.poison(e):  # a CUDA fault: the engine goes down (logged there); the bus drops it
                    return _http_error(503, f"engine unhealthy: {runner.fatal}")
                log.warning("update_weights_from_distributed failed: %s", e)
                return _control(False, f"Failed to update weights: {e}")
        state.metrics.weight_updates.inc()
        # One INFO line per update (its last bucket carries the version), not per bucket.
        log.log(
            logging.INFO if body.weight_version is not None else logging.DEBUG,
            "weights updated from %s (%d tensors) to version %s",
            body.group_name,
            len(named),
            runner.weight_version,
        )
        return _control(True, "Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = await _decode(request, DestroyWeightsUpdateGroup)
        async with state.weight_lock:
            try:
                state.receiver.destroy(body.group_name)
            except ValueError as e:
                return _control(False, str(e))
        log.info("left weight update group %s", body.group_name)
        return _control(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _decode(request, UpdateWeightsFromDisk)
        async with state.weight_lock:
            if body.abort_all_requests:
                runner.abort(abort_all=True)
            try:
                await _in_weight_thread(
                    state, runner.load_weights_from_disk, body.model_path, body.weight_version
                )
            except Exception as e:
                if not runner.poison(e):
                    log.warning("update_weights_from_disk(%s) failed: %s", body.model_path, e)
                return _control(
                    False, f"Failed to update weights from {body.model_path}: {e}", num_paused_requests=0
                )
        state.metrics.weight_updates.inc()
        log.info("weights updated from disk %s to version %s", body.model_path, runner.weight_version)
        return _control(True, "Succeeded to update model weights.", num_paused_requests=0)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await _decode(request, UpdateWeightVersion)
        if body.abort_all_requests:
            runner.abort(abort_all=True)
        runner.set_weight_version(body.new_version)
        log.info("weight version set to %s", body.new_version)
        return _json(
            {
                "success": True,
                "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version,
            }
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return _json({"weight_version": runner.weight_version})

    # ---- info and health ----

    @app.get("/health", response_class=Response)
    async def health() -> Response:
        if runner.fatal is not None:
            return _http_error(503, f"engine unhealthy: {runner.fatal}")
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response)
    async def health_generate() -> Response:
        if runner.paused:
            return _http_error(503, "generation is paused")
        req = GenRequest(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            c = await asyncio.wait_for(asyncio.wrap_future(runner.submit(req)), HEALTH_CHECK_TIMEOUT_S)
        except Exception as e:
            runner.abort_requests([req], "health check timed out")
            return _http_error(503, f"health check failed: {e!r}")
        if c.finish_reason["type"] == "abort":
            return _http_error(503, f"health check aborted: {c.finish_reason['message']}")
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
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

    def server_info() -> dict[str, Any]:
        snap = runner.snapshot()
        return {
            "model_path": runner.model_path,
            "tokenizer_path": runner.model_path,
            "served_model_name": model_name,
            "weight_version": runner.weight_version,
            "device": str(runner.device),
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
            "internal_states": [{**snap, "num_queue_reqs": snap["num_queue_reqs"] + state.waiting}],
            "version": VERSION,
        }

    async def get_model_info() -> Response:
        return _json(model_info())

    async def get_server_info() -> Response:
        if runner.fatal is not None:  # the weight bus probes this: an unhealthy engine counts as gone
            return _http_error(503, f"engine unhealthy: {runner.fatal}")
        return _json(server_info())

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, get_model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, get_server_info, methods=["GET"])

    async def flush_cache() -> Response:
        # No prefix cache yet: there is nothing to flush, and nothing can make the flush fail.
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            media_type="text/plain",
        )

    for method in ("GET", "POST"):
        app.add_api_route(
            "/flush_cache",
            flush_cache,
            methods=[method],
            operation_id=f"flush_cache_{method.lower()}",
            response_class=PlainTextResponse,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    return app


# ---- running it ----------------------------------------------------------------------------------


class EngineServer:
    """The built-in engine in a background thread: `start()` loads the model, serves, and returns once
    /health answers; `stop()` aborts in-flight requests and joins both threads."""

    def __init__(
        self,
        model_path: str,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        device: str = "cpu",
        max_batch_size: int = 256,
        torch_threads: int | None = None,
        weight_version: str = "0",
        context_length: int | None = None,
        served_model_name: str | None = None,
        dtype: str | None = None,
        kv_cache_tokens: int | None = None,
        cuda_graphs: bool = True,
        load_format: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_requests_per_call: int = MAX_REQUESTS_PER_CALL,
        fatal_exit_grace_s: float = FATAL_EXIT_GRACE_S,
        limits: HttpLimits = LIMITS,
    ) -> None:
        """`dtype`: "bfloat16", "float16", "float32" or None (bf16 on CUDA, fp32 on CPU); `kv_cache_tokens`:
        KV pool size (default: see Runner); `cuda_graphs`: capture decode steps on CUDA; `load_format`:
        "dummy" for random weights from the config (see Runner); `max_body_bytes`: larger requests are
        a 413; `max_requests_per_call`: a /generate asking for more (prompts x n) is a 400; `limits`: the
        HTTP server's connection limits (request-head and body timeouts, keep-alive, concurrency);
        `fatal_exit_grace_s`: after a fatal CUDA error, how long the server answers 503 before it stops
        (serve_forever returns; the CLI exits non-zero, an EngineActor's watch fails)."""
        self.fatal_exit_grace_s = fatal_exit_grace_s
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.max_requests_per_call = max_requests_per_call
        self.model_path = str(model_path)
        self.dtype = dtype
        self.kv_cache_tokens = kv_cache_tokens
        self.cuda_graphs = cuda_graphs
        self.load_format = load_format
        self.api_key = api_key
        self.host = host
        self.port = port
        """0 until start() when 0 was asked: then the port the OS picked."""
        self.device = device
        self.max_batch_size = max_batch_size
        self.torch_threads = torch_threads
        self.weight_version = weight_version
        self.context_length = context_length
        self.served_model_name = served_model_name
        self.runner: Runner | None = None
        self.app: FastAPI | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> EngineServer:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # process-wide: one engine per process in production
        self.runner = Runner(
            self.model_path,
            device=self.device,
            max_batch_size=self.max_batch_size,
            weight_version=self.weight_version,
            context_length=self.context_length,
            dtype=getattr(torch, self.dtype) if self.dtype else None,
            kv_cache_tokens=self.kv_cache_tokens,
            cuda_graphs=self.cuda_graphs,
            load_format=self.load_format,
        )
        self.runner.on_fatal.append(self._on_fatal)
        self.runner.start()
        self.app = build_app(
            self.runner,
            api_key=self.api_key,
            served_model_name=self.served_model_name,
            max_body_bytes=self.max_body_bytes,
            max_requests_per_call=self.max_requests_per_call,
            body_timeout_s=self.limits.body_timeout_s,
        )
        # Bind here so port=0 resolves before uvicorn starts and the URL is known to the caller.
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
        # it every response on a kept-alive connection (headers, then body) waited ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            **self.limits.uvicorn_kwargs(),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"engine-http-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"engine at {self.url} did not become healthy")
                time.sleep(0.02)  # uvicorn offers no startup event to wait on; /health is the signal
        log.info("engine serving %s at %s (version %s)", self.model_path, self.url, self.weight_version)
        return self

    @property
    def fatal(self) -> str | None:
        """The fatal CUDA error that made this engine unhealthy, if one did."""
        return None if self.runner is None else self.runner.fatal

    def _on_fatal(self, cause: str) -> None:
        """The runner hit a fatal CUDA error: /health already answers 503; stop after the grace."""
        log.error(
            "engine at %s is unhealthy (%s); stopping in %.1f s", self.url, cause, self.fatal_exit_grace_s
        )
        timer = threading.Timer(self.fatal_exit_grace_s, self.stop)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()  # first, so open /generate calls return (aborted) and uvicorn can drain
        if self.app is not None:  # a weight receive still blocked on a gone sender is left to its timeout
            self.app.state.engine.weight_pool.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)
        self._stopped.set()
        log.info("engine at %s stopped", self.url)

    def serve_forever(self) -> None:
        """Block until the server thread ends or stop() has returned (the CLI's main thread)."""
        assert self._thread is not None, "start() first"
        while self._thread.is_alive() and not self._stopped.is_set():
            self._thread.join(0.5)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
