"""Trainer side of the weight bus: one process group {trainer rank 0, every engine}, bucketed broadcasts.

Order matters (shared/SGLANG_API.md §3): an engine's HTTP handler blocks inside the collective, so the
trainer fires the HTTP request first, then joins the collective, then collects the HTTP answer.
Engines pause only around the swap: pause -> buckets -> continue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import msgspec
import torch

from weight_bus import metrics
from weight_bus.group import DEFAULT_TIMEOUT_S, broadcast, dtype_name, new_group
from weight_bus.receiver import FLATTENED_BUCKET
from weight_bus.schema import DEFAULT_GROUP, InitWeightsUpdateGroup, UpdateWeightsFromDistributed

log = logging.getLogger(__name__)


class BusError(RuntimeError):
    """An engine refused or failed a weight-bus call; the message names the engine."""


class PublishStats(msgspec.Struct):
    version: int
    bytes: int
    buckets: int
    pause_s: float
    """Wall time from the engines' pause to their continue (what generation lost)."""
    transfer_s: float
    """Time spent moving the buckets (HTTP announce + broadcast + engine load)."""


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split (name, tensor) pairs, in order, into groups of at most bucket_bytes (a larger tensor alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return [b for b in out if b]


def flatten(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each tensor's raw bytes concatenated in order (SGLang's flattened_bucket load format)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the update group, and the group's size: the trainer is rank 0 and
    engine i's TP ranks follow the previous engines' (slime: rank_offset = 1 + GPUs before it)."""
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


class WeightBus:
    """Connects to engines over HTTP, hosts rank 0 of the update group, publishes weights."""

    def __init__(
        self,
        engine_urls: list[str],
        api_key: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = 512 * 1024 * 1024,
        master_address: str = "127.0.0.1",
        pause_mode: str = "in_place",
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.engine_urls = list(engine_urls)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.pause_mode = pause_mode
        self.group_name = group_name
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.engine_urls)))
        self.group = None

    # --- HTTP helpers ------------------------------------------------------------------------------
    def _post(self, url: str, path: str, body) -> dict:
        resp = self.http.post(
            url + path,
            content=msgspec.json.encode(body) if body is not None else b"{}",
            headers={"Content-Type": "application/json"},
        )
        if resp.status_code != 200:
            raise BusError(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        data = resp.json() if resp.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise BusError(f"{url}{path}: {data.get('message')}")
        return data

    def _fire(self, path: str, body_for) -> list[Future]:
        return [
            self.pool.submit(self._post, url, path, body_for(i)) for i, url in enumerate(self.engine_urls)
        ]

    @staticmethod
    def _collect(futures: list[Future]) -> None:
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise BusError("; ".join(str(e) for e in errors))

    def _all(self, path: str, body=None) -> None:
        self._collect(self._fire(path, lambda i: body))

    # --- protocol ----------------------------------------------------------------------------------
    def _preflight(self) -> list[int]:
        """Every engine reachable and accepting our token, before anyone blocks in a collective: a bad
        token or a dead engine fails in milliseconds instead of after the group-setup timeout. Returns
        each engine's tensor-parallel size: every TP rank of an SGLang engine joins the group."""
        futures = [self.pool.submit(self.http.get, url + "/get_server_info") for url in self.engine_urls]
        errors, tp_sizes = [], []
        for url, f in zip(self.engine_urls, futures, strict=True):
            try:
                resp = f.result()
            except httpx.HTTPError as e:
                errors.append(f"{url}: unreachable: {e}")
                continue
            if resp.status_code != 200:
                errors.append(f"{url}/get_server_info: HTTP {resp.status_code}: {resp.text[:200]}")
                continue
            info = resp.json()
            # SGLang joins as rank_offset + tp_rank, whatever its PP rank: PP would need a group per stage.
            if int(info.get("pp_size", 1)) != 1:
                errors.append(f"{url}: pipeline-parallel engines (pp_size {info['pp_size']}) are unsupported")
            tp_sizes.append(int(info.get("tp_size", 1)))
        if errors:
            raise BusError("; ".join(errors))
        return tp_sizes

    def connect(self) -> None:
        """Create the update group: announce to every engine (not awaited), host rank 0, then await."""
        from slipstream.redis_server import free_port  # a free TCP port for the group's store

        offsets, world = rank_offsets(self._preflight())
        port = free_port(self.master_address)
        futures = self._fire(
            "/init_weights_update_group",
            lambda i: InitWeightsUpdateGroup(
                master_address=self.master_address,
                master_port=port,
                rank_offset=offsets[i],
                world_size=world,
                group_name=self.group_name,
                backend=self.backend,
            ),
        )
        try:
            self.group = new_group(
                self.master_address, port, 0, world, self.backend, self.group_name, self.timeout_s
            )
        except Exception as e:
            failed = [f.exception() for f in futures if f.done() and f.exception()]
            raise BusError(f"weight group setup failed: {e}; engine errors: {failed}") from e
        self._collect(futures)
        log.info("weight bus connected: %d engines, %s, port %d", len(self.engine_urls), self.backend, port)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        """Pause engines, send every bucket, tag the last with `version`, continue. Raises BusError if
        any engine fails (the caller must not publish the version then)."""
        if self.group is None:
            raise BusError("publish before connect()")
        plan = buckets(named, self.bucket_bytes)
        t_pause = time.perf_counter()
        self._all("/pause_generation", {"mode": self.pause_mode})
        total = 0
        try:
            t_transfer = time.perf_counter()
            for i, bucket in enumerate(plan):
                last = i == len(plan) - 1
                body = UpdateWeightsFromDistributed(
                    names=[n for n, _ in bucket],
                    dtypes=[dtype_name(t.dtype) for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket],
                    group_name=self.group_name,
                    load_format=FLATTENED_BUCKET,
                    weight_version=str(version) if last else None,
                    flush_cache=last,
                )
                futures = self._fire("/update_weights_from_distributed", lambda _i, b=body: b)
                flat = flatten(bucket)
                broadcast(self.group, flat)
                self._collect(futures)
                total += flat.numel()
            transfer_s = time.perf_counter() - t_transfer
        finally:
            self._all("/continue_generation", {})
        pause_s = time.perf_counter() - t_pause
        metrics.BYTES.inc(total)
        metrics.TRANSFER_SECONDS.observe(transfer_s)
        metrics.PAUSE_SECONDS.observe(pause_s)
        metrics.VERSION.set(version)
        log.info(
            "published version %d: %.1f MB in %d buckets, transfer %.1f ms, engines paused %.1f ms",
            version,
            total / 1e6,
            len(plan),
            transfer_s * 1e3,
            pause_s * 1e3,
        )
        return PublishStats(version, total, len(plan), pause_s, transfer_s)

    def close(self) -> None:
        self.http.close()
        self.pool.shutdown(wait=False)
        self.group = None
