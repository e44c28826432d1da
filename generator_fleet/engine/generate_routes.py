"""The engine's generation routes: POST/PUT /generate (a whole result, or SGLang's server-sent events with
"stream": true) and /abort_request. A call waits while generation is paused and aborts its requests when
its client goes away."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from generator_fleet.engine.api_types import AbortRequest, GenerateReqIn, decode, json_response
from generator_fleet.engine.runner import Runner
from generator_fleet.engine.sglang_compat import Item, attach_constraints, expand, render
from generator_fleet.engine.state import engine_state

log = logging.getLogger(__name__)

router = APIRouter()


async def generate(request: Request) -> Response:
    state = engine_state(request)
    runner = state.runner
    body = await decode(request, GenerateReqIn)
    items, is_batch = expand(body, runner, state.max_requests_per_call)
    constrained = [it.grammar[0] for it in items if it.grammar is not None]
    if constrained:
        # Grammars compile in a worker thread before anything is queued: the event loop and the
        # generation thread go on meanwhile, and an invalid grammar is a 400 that queued nothing.
        await asyncio.get_running_loop().run_in_executor(None, attach_constraints, items, runner)
        for kind in constrained:
            state.metrics.grammar_requests[kind].inc()
    if not state.unpaused.is_set():
        state.waiting += 1
        try:
            await state.unpaused.wait()
        finally:
            state.waiting -= 1
    if body.stream:
        return stream(runner, items, is_batch, body.return_text_in_logprobs)
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
        render(c, it, runner.tokenizer, body.return_text_in_logprobs)
        for c, it in zip(completions, items, strict=True)
    ]
    return json_response(out if is_batch else out[0])


def stream(runner: Runner, items: list[Item], is_batch: bool, text_in_logprobs: bool) -> StreamingResponse:
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
                    obj = render(c, it, runner.tokenizer, text_in_logprobs)
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
    router.add_api_route(
        "/generate",
        generate,
        methods=[method],
        operation_id=f"generate_{method.lower()}",
        responses={200: {"content": {"text/event-stream": {}}}},  # "stream": true
    )


@router.post("/abort_request", response_class=Response)
async def abort_request(request: Request) -> Response:
    runner = engine_state(request).runner
    body = await decode(request, AbortRequest)
    n = runner.abort(body.rid, body.abort_all)
    if n:
        log.info("aborted %d request(s) (rid=%r, abort_all=%s)", n, body.rid, body.abort_all)
    return Response(status_code=200)
