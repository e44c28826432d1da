"""The one async client rollout workers use to drive an engine, SGLang server or built-in, over SGLang's
native HTTP API (docs/sglang_api.md). Token-in/token-out: prompts go as ids, results come back as ids,
behaviour logprobs and the weight version of every token."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from common import tls
from weight_bus.engine_client import KEEPALIVE_S, auth_headers

DEFAULT_TIMEOUT_S = 1800.0
"""Read timeout per call: a /generate may legitimately wait out a long pause for a weight update."""
CONNECT_TIMEOUT_S = 10.0


class EngineError(Exception):
    """A non-2xx answer (or no answer) from an engine; `message` is the server's own when it sent one."""

    def __init__(self, status_code: int | None, message: str, url: str) -> None:
        super().__init__(f"{url}: {status_code if status_code is not None else 'no response'}: {message}")
        self.status_code = status_code
        self.message = message
        self.url = url


class GenerateResult(msgspec.Struct, kw_only=True):
    """One /generate result, normalised across SGLang versions and the built-in engine."""

    output_ids: list[int]
    output_logprobs: list[float]
    """Behaviour logprob of each output token (raw logits, temperature 1); empty without return_logprob."""
    finish_reason: str
    """One of "stop" (EOS, stop token or stop string), "length" (max_new_tokens), "abort" (partial output)."""
    token_versions: list[int]
    """Weight version that produced each output token (from meta_info.weight_versions spans, else
    meta_info.weight_version); -1 where the version is not an integer (SGLang's default "default")."""
    weight_version: str
    """The engine's version string for the last token (or at finish when there are none)."""
    prompt_tokens: int
    text: str = ""
    meta_info: dict[str, Any] = {}
    """The raw meta_info, for fields not lifted above (finish_reason details, e2e_latency, ...)."""


def _version_int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per-token versions from SGLang's `weight_versions` spans, falling back to `weight_version`."""
    fallback = _version_int(meta.get("weight_version"))
    out = [fallback] * n_tokens
    for span in meta.get("weight_versions") or []:
        v = _version_int(span.get("version"))
        for i in range(max(0, int(span["start"])), min(n_tokens, int(span["end"]))):
            out[i] = v
    return out


def parse_generate(obj: dict[str, Any]) -> GenerateResult:
    """GenerateResult from one element of a /generate response."""
    meta = obj.get("meta_info") or {}
    lps = meta.get("output_token_logprobs") or []
    output_ids = obj.get("output_ids")
    if output_ids is None:  # older SGLang omits output_ids outside streaming; the logprob entries carry them
        output_ids = [int(e[1]) for e in lps]
    finish = meta.get("finish_reason")
    finish_type = finish.get("type", "abort") if isinstance(finish, dict) else (finish or "abort")
    return GenerateResult(
        output_ids=list(output_ids),
        output_logprobs=[math.nan if e[0] is None else float(e[0]) for e in lps],
        finish_reason=finish_type,
        token_versions=token_versions(meta, len(output_ids)),
        weight_version=str(meta.get("weight_version", "default")),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        text=obj.get("text") or "",
        meta_info=meta,
    )


def _server_message(resp: httpx.Response) -> str:
    """The message out of any of SGLang's error shapes (§0), else the body text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return resp.text.strip()


def _generate_body(
    input_ids,
    sampling_params,
    return_logprob: bool,
    rid: str | None,
    priority: int | None = None,
    lora_path: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    if lora_path is not None:  # SGLang: one adapter name for every prompt of the call
        body["lora_path"] = lora_path
    if rid is not None:
        body["rid"] = rid
    if priority is not None:
        body["priority"] = priority
    return body


class EngineClient:
    """Async client for one engine URL; shares one connection pool across all calls. Use `async with`
    or call `aclose()`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_connections: int | None = 1024,
        lora_path: str | None = None,
    ) -> None:
        """`lora_path`: the LoRA adapter (its name on the engine) every generation call runs with
        (SGLang's per-request `lora_path`); None = the base model."""
        self.base_url = base_url.rstrip("/")
        self.lora_path = lora_path
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=auth_headers(api_key),
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            verify=tls.verify(),  # https:// engines behind a TLS proxy: $SLIPSTREAM_CA_CERT's CA too
            # A rollout worker keeps hundreds of /generate calls open on one engine.
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_S,
            ),
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, json: Any = None, ok_404: bool = False
    ) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, json=json)
        except httpx.TransportError as e:
            raise EngineError(None, f"{type(e).__name__}: {e}", f"{self.base_url}{path}") from e
        if resp.is_success or (ok_404 and resp.status_code == 404):
            return resp
        raise EngineError(resp.status_code, _server_message(resp), f"{self.base_url}{path}")

    # ---- generation ----

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> GenerateResult:
        """One sample for one prompt (use one call per sample: `n` > 1 gets rids you cannot abort)."""
        resp = await self._request(
            "POST",
            "/generate",
            _generate_body(input_ids, sampling_params, return_logprob, rid, lora_path=self.lora_path),
        )
        obj = resp.json()
        if isinstance(obj, list):  # only if sampling_params asked for n > 1; keep the first
            obj = obj[0]
        return parse_generate(obj)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict[str, Any]],
        return_logprob: bool = True,
        rid: str | None = None,
        priority: int | None = None,
    ) -> list[GenerateResult]:
        """One sample for each of several prompts (results in input order). Items with the same sampling
        params go in ONE request with one params object (a group's G samples: one HTTP round trip instead
        of G), which is also the only batch an sglang-router accepts: its GenerateRequest takes a single
        `sampling_params` object and a single `rid` string. Items whose params differ (resumed samples
        with less budget left) go as one request per distinct params, concurrently. The engine names the
        items "{rid}_{i}" ("{rid}_{k}_{i}" in the k-th of several requests), so aborting `rid` (prefix
        match) aborts them all. `priority`: SGLang's request priority (larger is scheduled first where
        the server schedules by priority; null sends none)."""
        if len(input_ids) != len(sampling_params):
            raise ValueError("input_ids and sampling_params must have the same length")
        parts: dict[str, list[int]] = {}
        for i, sp in enumerate(sampling_params):
            parts.setdefault(json.dumps(sp, sort_keys=True), []).append(i)

        async def request(k: int, idx: list[int]) -> list[dict[str, Any]]:
            sub_rid = f"{rid}_{k}" if rid is not None and len(parts) > 1 else rid
            prompts = [input_ids[i] for i in idx]
            body = _generate_body(
                prompts, sampling_params[idx[0]], return_logprob, sub_rid, priority, self.lora_path
            )
            resp = await self._request("POST", "/generate", body)
            objs = resp.json()
            if not isinstance(objs, list) or len(objs) != len(idx):
                raise EngineError(resp.status_code, f"expected a list of {len(idx)} results", self.base_url)
            return objs

        answers = await asyncio.gather(*(request(k, idx) for k, idx in enumerate(parts.values())))
        out: list[GenerateResult | None] = [None] * len(input_ids)
        for idx, objs in zip(parts.values(), answers, strict=True):
            for i, obj in zip(idx, objs, strict=True):
                out[i] = parse_generate(obj)
        return out

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> AsyncIterator[GenerateResult]:
        """Stream one sample: yields a cumulative result per server event (finish_reason "" until the
        last one). Leaving the loop early closes the connection, which aborts the request."""
        body = {
            **_generate_body(input_ids, sampling_params, return_logprob, rid, lora_path=self.lora_path),
            "stream": True,
        }
        try:
            async with self._http.stream("POST", "/generate", json=body) as resp:
                if not resp.is_success:
                    await resp.aread()
                    raise EngineError(resp.status_code, _server_message(resp), f"{self.base_url}/generate")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        raise EngineError(resp.status_code, str(obj["error"].get("message")), self.base_url)
                    if not (obj.get("meta_info") or {}).get("finish_reason"):
                        obj["meta_info"]["finish_reason"] = {"type": ""}
                    yield parse_generate(obj)
        except httpx.TransportError as e:
            raise EngineError(None, f"{type(e).__name__}: {e}", f"{self.base_url}/generate") from e

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort by rid prefix, or everything; the aborted generate() calls return finish_reason "abort"."""
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    # ---- pause / weights ----

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation. mode "abort" returns after in-flight requests have returned (aborted);
        "retract" moves them back to the engine's queue and frees their KV cache (re-prefilled after
        continue_generation()); "in_place" parks them with their KV cache until continue_generation()."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def update_weight_version(self, version: str | int, abort_all_requests: bool = False) -> None:
        await self._request(
            "POST",
            "/update_weight_version",
            {"new_version": str(version), "abort_all_requests": abort_all_requests},
        )

    async def weight_version(self) -> str:
        """The engine's current weight version string (GET /get_weight_version)."""
        resp = await self._request("GET", "/get_weight_version")
        return str(resp.json().get("weight_version"))

    async def flush_cache(self) -> None:
        """Raises EngineError (400) while an SGLang server still has requests resident; callers retry."""
        await self._request("POST", "/flush_cache")

    # ---- info ----

    async def health(self) -> bool:
        try:
            resp = await self._http.get("/health")
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        """/model_info (recent SGLang), else /get_model_info (0.5.3 and earlier)."""
        resp = await self._request("GET", "/model_info", ok_404=True)
        if resp.status_code == 404:
            resp = await self._request("GET", "/get_model_info")
        return resp.json()

    async def server_info(self) -> dict[str, Any]:
        resp = await self._request("GET", "/server_info", ok_404=True)
        if resp.status_code == 404:
            resp = await self._request("GET", "/get_server_info")
        return resp.json()
