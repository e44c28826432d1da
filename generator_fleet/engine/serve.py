"""The built-in engine as a server: `EngineServer` loads the model into a Runner, serves the app under
uvicorn in a background thread of any process (the command line, tests, Ray actors), and stops itself a
grace period after a fatal CUDA error."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import httpx
import msgspec
import torch
import uvicorn
from fastapi import FastAPI

from common.http_guard import ENGINE_LIMITS, HttpLimits
from generator_fleet.engine.app import build_app
from generator_fleet.engine.options import EngineOptions, convert
from generator_fleet.engine.runner import Runner

log = logging.getLogger(__name__)


class EngineServer:
    """The built-in engine in a background thread: `start()` loads the model, serves, and returns once
    /health answers; `stop()` aborts in-flight requests and joins both threads."""

    def __init__(
        self,
        options: EngineOptions | str | os.PathLike,
        /,
        *,
        api_key: str | None = None,
        limits: HttpLimits = ENGINE_LIMITS,
        **fields: Any,
    ) -> None:
        """`options`: the engine's options, or its model directory with any other EngineOptions field
        given by name in `fields` (`EngineServer(path, context_length=256)`); fields outside their bounds
        are a ValueError. `api_key`: required as a bearer token on every route but GET /health and
        /metrics (None: no key). `limits`: the HTTP server's connection limits (request-head and body
        timeouts, keep-alive, concurrency)."""
        if isinstance(options, EngineOptions):
            options = convert({**msgspec.structs.asdict(options), **fields}) if fields else options
        else:
            options = convert({"model_path": os.fspath(options), **fields})
        self.options = options
        self.api_key = api_key
        self.limits = limits
        self.host = options.host
        self.port = options.port
        """0 until start() when 0 was asked: then the port the OS picked."""
        self.runner: Runner | None = None
        self.app: FastAPI | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._threads_before: int | None = None
        """torch's thread count before start set `torch_threads`, restored by stop."""

    @property
    def model_path(self) -> str:
        return self.options.model_path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> EngineServer:
        o = self.options
        if o.torch_threads:  # process-wide (one engine per process in production); given back at stop
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(o.torch_threads)
        self.runner = Runner.from_options(o)
        self.runner.on_fatal.append(self._on_fatal)
        self.runner.start()
        self.app = build_app(self.runner, o, api_key=self.api_key, body_timeout_s=self.limits.body_timeout_s)
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
        log.info("engine serving %s at %s (version %s)", o.model_path, self.url, o.weight_version)
        return self

    @property
    def fatal(self) -> str | None:
        """The fatal CUDA error that made this engine unhealthy, if one did."""
        return None if self.runner is None else self.runner.fatal

    def _on_fatal(self, cause: str) -> None:
        """The runner hit a fatal CUDA error: /health already answers 503; stop after the grace."""
        log.error(
            "engine at %s is unhealthy (%s); stopping in %.1f s",
            self.url,
            cause,
            self.options.fatal_exit_grace_s,
        )
        timer = threading.Timer(self.options.fatal_exit_grace_s, self.stop)
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
        if self._threads_before is not None:  # an engine in a process that goes on (a test, a notebook)
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
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
