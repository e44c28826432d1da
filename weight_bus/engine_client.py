"""The engines' control routes over HTTP (SGLang's native API, docs/sglang_api.md §3): pause and
continue generation, join and leave weight-update groups, announce buckets, hand over tensors by CUDA
IPC / shared memory, read server info. The one synchronous client for them, used by the weight bus and
the job driver; generation has its own async client (generator_fleet.client).

Two ways to call: `EngineClient` sends one request and waits for its answer (pooled connections, safe to
share between threads); `EngineChannel` writes requests in order on one pipelined connection to one
engine and returns Futures (weight_bus/pipeline.py says why the bus's group calls and announcements
need that). Both check an answer alike: HTTP 200 and no `success: false`, else `Refused`.
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import Future
from typing import Any

import httpx
import msgspec

from common import tls
from weight_bus import metrics
from weight_bus.errors import Refused
from weight_bus.pipeline import Pipeline, SerialPipeline
from weight_bus.schema import (
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensors,
    MemoryOccupation,
    UnloadLoraAdapter,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
    WeightLayout,
)

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
"""GET /get_server_info bound (it never waits on a collective), and a channel's connect timeout."""

KEEPALIVE_S = 4.0
"""An idle pooled connection to an engine is not reused after this long (this client's and the rollout's,
generator_fleet/client.py): under the 5 s after which uvicorn (SGLang's server and the built-in engine)
closes an idle connection. At httpx's default, also 5 s, a request can be written into a connection the
engine is closing, and fails with no response (the pipelined weight calls reconnect after 1 s idle:
weight_bus/pipeline.py)."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header every engine checks (the job's engine key), for generation and control calls alike."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def checked(url: str, path: str, status: int, body: bytes) -> dict:
    """An engine's answer to a control call, or Refused (HTTP status other than 200, success: false)."""
    if status != 200:
        raise Refused(f"{url}{path}: HTTP {status}: {body[:500].decode(errors='replace')}")
    data = msgspec.json.decode(body) if body else {}
    if isinstance(data, dict) and data.get("success") is False:
        raise Refused(f"{url}{path}: {data.get('message') or data.get('error_message')}")
    return data


class EngineClient:
    """Blocking control calls to any engine, with the job's API key; every call is bounded by
    `timeout_s` unless it says otherwise. Transport errors (connection refused, timeout) are httpx's."""

    def __init__(self, api_key: str | None, timeout_s: float) -> None:
        self.headers = auth_headers(api_key)
        self.timeout_s = timeout_s
        # TCP_NODELAY: a POST goes out as two writes (headers, body); with Nagle on, the body waits for
        # the server's delayed ACK of the headers, 40 ms per call on Linux.
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        self._http = httpx.Client(
            headers=self.headers,
            timeout=timeout_s,
            # https:// engines behind a TLS proxy: $SLIPSTREAM_CA_CERT's CA besides the public ones
            transport=httpx.HTTPTransport(socket_options=nodelay, verify=tls.verify()),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    def post(self, url: str, path: str, body: Any = None, timeout: float | None = None) -> dict:
        """POST `body` (a msgspec Struct or plain JSON value; None: {}) to `url + path`; the answer's JSON."""
        resp = self._http.post(
            url + path,
            content=msgspec.json.encode(body) if body is not None else b"{}",
            headers={"Content-Type": "application/json"},
            timeout=timeout or self.timeout_s,
        )
        return checked(url, path, resp.status_code, resp.content)

    def server_info(self, url: str) -> dict:
        """GET /get_server_info (at most PROBE_TIMEOUT_S): tp_size, pp_size, dtype, version, and the
        built-in engine's weight_update_groups.

        The bus drops an engine whose probe fails, so a transport error other than a timeout is tried
        once more on a new connection: a pooled connection can break under a live engine (the engine
        closed it as it went idle, or its socket was broken on this side). A dead engine refuses the
        second connect at once; a hung one is not asked twice."""
        timeout = min(PROBE_TIMEOUT_S, self.timeout_s)
        try:
            resp = self._http.get(url + "/get_server_info", timeout=timeout)
        except httpx.TimeoutException:
            raise
        except httpx.TransportError as first:
            log.info("%s/get_server_info failed (%s); trying a new connection", url, first)
            metrics.PROBE_RETRIES.inc()
            resp = self._http.get(url + "/get_server_info", timeout=timeout)
        if resp.status_code != 200:
            raise Refused(f"{url}/get_server_info: HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.json()

    def weight_layout(self, url: str) -> WeightLayout:
        """GET /weight_layout (built-in engine): where each weight lives in its arena."""
        resp = self._http.get(url + "/weight_layout", timeout=self.timeout_s)
        if resp.status_code != 200:
            raise Refused(f"{url}/weight_layout: HTTP {resp.status_code}: {resp.text[:200]}")
        return msgspec.json.decode(resp.content, type=WeightLayout)

    def healthy(self, url: str, timeout_s: float | None = None) -> bool:
        """GET /health answers 200 (SGLang answers 503 while it starts); False on any transport error."""
        try:
            return self._http.get(url + "/health", timeout=timeout_s or self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def pause_generation(self, url: str, mode: str) -> dict:
        """mode: "in_place" (requests keep their KV cache), "retract" or "abort"."""
        return self.post(url, "/pause_generation", {"mode": mode})

    def continue_generation(self, url: str) -> dict:
        return self.post(url, "/continue_generation", {})

    def update_weights_from_tensor(self, url: str, body: UpdateWeightsFromTensor) -> dict:
        """POST /update_weights_from_tensor: the engine loads the tensors `body` shares (weight_bus.ipc)
        and answers once it copied them (the sender may then reuse that memory)."""
        return self.post(url, "/update_weights_from_tensor", body)

    def load_lora_adapter(self, url: str, lora_name: str, lora_path: str) -> dict:
        """POST /load_lora_adapter: load the PEFT adapter directory `lora_path` (on the engine's host or a
        shared filesystem) as `lora_name`. Answers {"success", "loaded_adapters", ...}."""
        return self.post(url, "/load_lora_adapter", LoadLoraAdapter(lora_name=lora_name, lora_path=lora_path))

    def load_lora_adapter_from_tensors(self, url: str, body: LoadLoraAdapterFromTensors) -> dict:
        """POST /load_lora_adapter_from_tensors: the adapter's tensors shared as for
        /update_weights_from_tensor (weight_bus.ipc), with its PEFT config."""
        return self.post(url, "/load_lora_adapter_from_tensors", body)

    def unload_lora_adapter(self, url: str, lora_name: str) -> dict:
        """POST /unload_lora_adapter."""
        return self.post(url, "/unload_lora_adapter", UnloadLoraAdapter(lora_name=lora_name))

    def update_weight_version(self, url: str, version: int | str) -> dict:
        """POST /update_weight_version: tag what the engine serves now with `version` (an adapter-only
        update through the LoRA routes, which carry no version of their own)."""
        return self.post(url, "/update_weight_version", UpdateWeightVersion(new_version=str(version)))

    def release_memory_occupation(
        self, url: str, tags: list[str] | None = None, timeout: float | None = None
    ) -> dict:
        """POST /release_memory_occupation: free the engine's device memory of `tags` ("kv_cache",
        "weights", "cuda_graph"; None = all). SGLang needs --enable-memory-saver and answers an empty
        200; the built-in engine answers what is released now and the bytes freed."""
        return self.post(url, "/release_memory_occupation", MemoryOccupation(tags=tags), timeout) or {}

    def resume_memory_occupation(
        self, url: str, tags: list[str] | None = None, timeout: float | None = None
    ) -> dict:
        """POST /resume_memory_occupation: take back the memory of `tags` (None = all); the colocated
        order is ["weights"], then the weight update, then ["kv_cache", "cuda_graph"]."""
        return self.post(url, "/resume_memory_occupation", MemoryOccupation(tags=tags), timeout) or {}

    def channel(self, url: str) -> EngineChannel:
        """A pipelined connection to one engine, with this client's API key."""
        return EngineChannel(url, self.headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineChannel:
    """Control calls to one engine, written in order on one pipelined connection: each returns a Future
    of the answer's JSON (or Refused, or the connection's error), without waiting for earlier answers."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        # https:// (a TLS proxy in front of the engine): in order, but one request at a time
        serial = url.startswith("https://")
        self._pipeline = (SerialPipeline if serial else Pipeline)(url, headers, PROBE_TIMEOUT_S)

    def call(self, path: str, body: Any) -> Future:
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def done(raw: Future) -> None:
            try:
                resp = raw.result()
                out.set_result(checked(self.url, path, resp.status, resp.body))
            except Exception as e:
                out.set_exception(e)

        self._pipeline.post(path, msgspec.json.encode(body)).add_done_callback(done)
        return out

    def init_weights_update_group(self, req: InitWeightsUpdateGroup) -> Future:
        return self.call("/init_weights_update_group", req)

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributed) -> Future:
        return self.call("/update_weights_from_distributed", req)

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensor) -> Future:
        return self.call("/update_weights_from_tensor", req)

    def load_lora_adapter_from_tensors(self, req: LoadLoraAdapterFromTensors) -> Future:
        return self.call("/load_lora_adapter_from_tensors", req)

    def load_lora_adapter(self, req: LoadLoraAdapter) -> Future:
        return self.call("/load_lora_adapter", req)

    def unload_lora_adapter(self, lora_name: str) -> Future:
        return self.call("/unload_lora_adapter", UnloadLoraAdapter(lora_name=lora_name))

    def update_weight_version(self, version: int | str) -> Future:
        return self.call("/update_weight_version", UpdateWeightVersion(new_version=str(version)))

    def destroy_weights_update_group(self, group_name: str) -> Future:
        return self.call("/destroy_weights_update_group", DestroyWeightsUpdateGroup(group_name=group_name))

    def close(self) -> None:
        """Drop the connection; unanswered calls fail (ConnectionError)."""
        self._pipeline.close()


def continue_engines(urls: list[str], api_key: str | None, timeout_s: float = 10.0) -> dict[str, Exception]:
    """POST /continue_generation to each engine in turn (engines a weight update left paused, e.g. when
    the trainer died between pause and continue); returns the failures by URL."""
    failed: dict[str, Exception] = {}
    with EngineClient(api_key, timeout_s) as client:
        for url in urls:
            try:
                client.continue_generation(url)
            except (Refused, httpx.HTTPError) as e:
                failed[url] = e
    return failed
