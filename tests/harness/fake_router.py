"""A fake sglang-router for the generator-fleet tests: sgl-router's admin API and a /generate that proxies to
a worker, served in a thread of the test's process."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from generator_fleet.launch import is_healthy


class FakeRouter:
    """The sglang-router API the fleet uses (sgl-router's server.rs): /health, /list_workers -> {"urls"},
    POST /add_worker?url=&api_key=, POST /remove_worker?url=, and /generate proxied to a worker with that
    worker's key. Served by uvicorn in a thread; records the weight versions of what it proxied."""

    def __init__(self) -> None:
        self.workers: dict[str, str | None] = {}
        self.added: list[str] = []
        self.versions: list[str] = []
        self.requests = 0
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/list_workers")
        async def list_workers() -> dict:
            return {"urls": list(self.workers)}

        @app.post("/add_worker")
        async def add_worker(url: str, api_key: str | None = None) -> Response:
            self.workers[url] = api_key
            self.added.append(url)
            return Response(f"Successfully added worker: {url}")

        @app.post("/remove_worker")
        async def remove_worker(url: str) -> Response:
            del self.workers[url]
            return Response(f"Successfully removed worker: {url}")

        @app.post("/generate")
        async def proxy(request: Request) -> Response:
            body = await request.body()
            req = json.loads(body)
            # sgl-router's GenerateRequest: one `sampling_params` object, one `rid` string (axum: 422).
            if isinstance(req.get("sampling_params"), list) or not isinstance(req.get("rid", ""), str):
                return Response("Failed to deserialize the JSON body into the target type", status_code=422)
            self.requests += 1
            url, key = next(iter(self.workers.items()))
            async with httpx.AsyncClient(timeout=60) as http:
                resp = await http.post(
                    url + "/generate",
                    content=body,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
            out = resp.json()
            self.versions += [
                o["meta_info"]["weight_version"] for o in (out if isinstance(out, list) else [out])
            ]
            return Response(resp.content, status_code=resp.status_code, media_type="application/json")

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not is_healthy(self.url):
            assert time.monotonic() < deadline, "fake router did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
