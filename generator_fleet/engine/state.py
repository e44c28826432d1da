"""The state every route of one engine app works on: the runner, the pause gate, the weight receiver and
the metrics. The app keeps it at `app.state.engine`; a handler reaches it with `engine_state(request)`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any

from fastapi import Request

from generator_fleet.engine.metrics import EngineMetrics
from generator_fleet.engine.runner import Runner
from weight_bus import ipc
from weight_bus.receiver import WeightReceiver


class EngineState:
    """Per-app state that lives on the event loop: the pause gate, the weight receiver, metrics."""

    def __init__(self, runner: Runner, model_name: str, max_requests_per_call: int) -> None:
        self.runner = runner
        self.model_name = model_name
        self.max_requests_per_call = max_requests_per_call
        """A /generate asking for more requests (prompts x n) is a 400."""
        self.receiver = WeightReceiver(runner.device, gpu_lock=runner.gpu_lock)
        # New /generate calls wait on this while paused (SGLang: no error, they go on after continue).
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.waiting = 0
        self.paused_at: float | None = None
        self.trace: list = []  # SLIPSTREAM_WEIGHT_TRACE
        self.opened = ipc.OpenedHandles()
        """Sender buffers /update_weights_from_tensor mapped, kept open for the next call naming them."""
        self.weight_lock = asyncio.Lock()  # one weight operation at a time: groups receive in order
        # Weight operations run in their own thread, not the loop's default executor: a receive blocked on
        # a sender that is gone must not hold up the server's shutdown (asyncio.run joins the default
        # executor's threads) until the group times out.
        self.weight_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-weights")
        self.scratch = None
        """SLIPSTREAM_STREAM_SCRATCH: where streamed buckets land instead of the weights (diagnostics)."""
        self.weights_incomplete = False
        """A streamed update failed after writing the serving weights: generation stays paused until a
        full update succeeds (weight_routes.receive_stream)."""
        self.lora_pending: dict[str, dict] = {}
        """Tensors of a LoRA adapter whose group update is under way, by adapter name (weight thread)."""
        self.metrics = EngineMetrics(runner, model_name, lambda: self.waiting)
        self._copy_event = None
        self._copy_event_handle = ""

    def copy_done(self, stream) -> str:
        """Weight thread, CUDA: record the engine's interprocess event on `stream` (after a weight copy
        was queued on it) and return its IPC handle, base64 (the same for every call: a sender opens it
        once and waits for its latest record)."""
        import base64

        import torch

        if self._copy_event is None:
            with torch.cuda.device(self.runner.device):
                self._copy_event = torch.cuda.Event(interprocess=True)
                self._copy_event.record(stream)
                self._copy_event_handle = base64.b64encode(self._copy_event.ipc_handle()).decode()
        else:
            self._copy_event.record(stream)
        return self._copy_event_handle

    async def in_weight_thread(self, fn, *args) -> Any:
        """`fn(*args)` in the weight thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(
            self.weight_pool, functools.partial(fn, *args)
        )


def engine_state(request: Request) -> EngineState:
    """The state of the app serving `request`."""
    return request.app.state.engine
