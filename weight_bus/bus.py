"""Trainer side of the weight bus: one process group {trainer rank 0, every engine}, bucketed broadcasts.

One update (`WeightBus.publish`):

  1. membership — probe the engines (GET /get_server_info); drop the dead, admit engines waiting to join
     (the registry's joining set, or engines dropped earlier that answer again); rebuild the group
     if it changed. Nothing is paused yet.
  2. bucket 0 — pulled from the trainer's (lazy) iterator, cast to the engine dtype and packed into one
     flat buffer, still before the pause.
  3. pause — /pause_generation on every engine (in_place | retract | abort).
  4. buckets — per bucket: announce (/update_weights_from_distributed, names/dtypes/shapes, the last
     one tagged with the version), then one broadcast. While bucket k is on the wire, bucket k+1 is
     gathered and packed; at most MAX_INFLIGHT buckets are unconfirmed at a time.
  5. continue — /continue_generation; engines that joined are promoted in the registry (they take
     traffic only now, holding the current weights).

Order matters (shared/SGLANG_API.md §3): an engine's HTTP handler blocks inside the collective, so the
trainer fires the HTTP request first, then joins the collective, then collects the HTTP answer. The
announcements to one engine go out in bucket order on one pipelined connection (weight_bus/pipeline.py):
bucket k+1's is written without waiting for k's answer, yet cannot overtake it (on two connections it
could, and the engine would receive bucket k+1's bytes as bucket k).

Failure: every HTTP call and every collective is bounded (`timeout_s`). An engine that dies, or does
not answer in time, during an update is dropped; rank 0 leaves the group, builds a new one (new name,
new port) with the survivors, and re-sends every bucket they have not confirmed, so the same update
still reaches them and `publish` returns normally. An engine that is alive but refuses a bucket (e.g.
an unknown parameter name) is a bug, not a failure: `publish` raises BusError. Either way the engines
are continued and the trainer's iterator is drained (its other ranks take part in the same gathers).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import httpx
import msgspec
import torch

from weight_bus import metrics
from weight_bus.config import BUCKET_BYTES, PAUSE_MODES
from weight_bus.group import (
    DEFAULT_TIMEOUT_S,
    broadcast_async,
    dtype_from_name,
    dtype_name,
    group_on,
    shutdown_group,
    tcp_store,
)
from weight_bus.pipeline import Pipeline, Response
from weight_bus.receiver import FLATTENED_BUCKET
from weight_bus.schema import (
    DEFAULT_GROUP,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
)

log = logging.getLogger(__name__)

MAX_INFLIGHT = 2
"""Default for buckets announced and broadcast but not yet confirmed; the next one is packed meanwhile,
so the trainer holds at most max_inflight + 1 bucket buffers. More hides more per-bucket HTTP latency
(an engine hears of bucket k + max_inflight once bucket k is confirmed)."""
POLL_S = 1e-4
"""How often an unconfirmed bucket is checked (its broadcast and every engine's HTTP answer)."""
PROBE_TIMEOUT_S = 5.0
"""GET /get_server_info bound when probing engines (it never waits on a collective)."""
SETUP_GRACE_S = 10.0
"""Extra time (at most `timeout_s`) for group setup and announcements beyond `timeout_s`: a survivor
whose receive is stuck on a dead peer gives it up only after its own group timeout (`timeout_s`), then
joins the new group."""
NCCL_BACKSTOP = 3
"""NCCL group timeout, in units of the bus's longest wait (see WeightBus._nccl_backstop_s)."""
MAX_REBUILDS = 3
"""Group rebuilds one update may go through before it gives up with BusError."""
BUILTIN_ENGINE = "slipstream-builtin"
"""`version` in the built-in engine's /get_server_info: it takes InitWeightsUpdateGroup.timeout_s."""


class BusError(RuntimeError):
    """An engine refused a weight-bus call, or no update group could be built; the message names the
    engine. The caller must not publish the version."""


class _Refused(BusError):
    """An engine answered, but not with success (HTTP status other than 200 or success: false)."""


class PublishStats(msgspec.Struct, kw_only=True):
    version: int
    bytes: int
    """Bytes broadcast once (the flattened buckets, in the engine dtype)."""
    buckets: int
    pause_ms: float
    """Engine pause: from /pause_generation sent to /continue_generation answered (generation lost)."""
    transfer_ms: float
    """First announcement to the last bucket confirmed by every engine (broadcast done and HTTP 200)."""
    gather_ms: float
    """Time spent pulling and packing tensors from the trainer's iterator (bucket 0 before the pause);
    what of it is not hidden behind the wire shows up in transfer_ms."""
    engines: list[str]
    """Engines that hold `version` now."""
    joined: list[str] = []
    """Engines admitted by this update (they got the whole model; promoted in the registry)."""
    dropped: list[str] = []
    """Engines removed from the group by this update (dead or timed out)."""
    rebuilds: int = 0
    """Update groups built during this update (membership change or failure)."""
    timeline: list[list[float]] = []
    """Per confirmed bucket: [index, launched, broadcast seen done, every engine seen answered], ms from
    the start of the transfer (seen: when _confirm polled it, so within POLL_S of the event once the
    bucket is at the head of the queue). Where the wire idles between buckets shows here."""

    @property
    def pause_s(self) -> float:
        return self.pause_ms / 1e3

    @property
    def transfer_s(self) -> float:
        return self.transfer_ms / 1e3


class Registry(Protocol):
    """What the bus needs of the engine registry (generator_fleet.registry.EngineRegistry): engines
    registered mid-job wait in a joining set until the bus has given them the current weights."""

    def joining(self) -> list[str]: ...

    def promote(self, url: str) -> bool: ...

    def demote(self, url: str) -> None: ...


def update_due(version: int, every: int, final_version: int | None = None) -> bool:
    """Whether to publish after the optimizer step that made `version`: every `every` versions, and
    always at `final_version` so that engines end on the final policy. Pure, so that every trainer rank
    decides alike (the full-tensor gather is a collective all of them take part in)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return version % every == 0 or (final_version is not None and version >= final_version)


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


# ---- packing --------------------------------------------------------------------------------------


class _Bucket:
    """One flattened bucket: what the engines are told, the bytes, and its state on the wire."""

    __slots__ = ("calls", "dtypes", "flat", "index", "last", "names", "shapes", "times", "work")

    def __init__(self, index: int, names, dtypes, shapes, flat: torch.Tensor, last: bool) -> None:
        self.index, self.names, self.dtypes, self.shapes = index, names, dtypes, shapes
        self.flat, self.last = flat, last
        self.work = None
        self.calls: dict[str, Future] = {}
        self.times = [0.0, 0.0, 0.0]
        """perf_counter at launch, broadcast seen done, every engine seen answered."""


def pack(
    named: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None,
    device: torch.device,
) -> Iterator[_Bucket]:
    """Pull tensors lazily from `named` (cast to `dtype` if floating point, on `device`) and yield them
    packed into flat buckets of at most bucket_bytes, in order; a bucket is yielded once the next tensor
    does not fit (or `named` ends: then it is `last`). A bucket is packed by one torch.cat per run of one
    dtype (a copy per tensor costs ~25 us of launch overhead on CUDA: 7 ms for a 0.5B model's ~300
    tensors); meanwhile the trainer holds that bucket's gathered tensors. A tensor alone in its bucket
    that needs no cast or move is broadcast in place."""
    index = 0
    pending: list[tuple[str, torch.Tensor, torch.dtype]] = []
    size = 0
    for name, t in named:
        t = t.detach()
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        n = t.numel() * target.itemsize
        if pending and size + n > bucket_bytes:
            yield _packed(index, pending, size, device, last=False)
            index += 1
            pending, size = [], 0
        pending.append((name, t, target))
        size += n
    if pending:
        yield _packed(index, pending, size, device, last=True)


def _packed(
    index: int,
    tensors: list[tuple[str, torch.Tensor, torch.dtype]],
    size: int,
    device: torch.device,
    last: bool,
) -> _Bucket:
    names = [n for n, _, _ in tensors]
    dtypes = [dtype_name(d) for _, _, d in tensors]
    shapes = [list(t.shape) for _, t, _ in tensors]
    if len(tensors) == 1:
        _, t, target = tensors[0]
        if t.dtype == target and t.device == device and t.is_contiguous():
            return _Bucket(index, names, dtypes, shapes, t.reshape(-1).view(torch.uint8), last)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    off = i = 0
    while i < len(tensors):  # one cat per run of tensors travelling as the same dtype
        target = tensors[i][2]
        j = i
        while j < len(tensors) and tensors[j][2] == target:
            j += 1
        run = [t.reshape(-1) if t.device == device else t.to(device).reshape(-1) for _, t, _ in tensors[i:j]]
        n = sum(t.numel() for t in run) * target.itemsize
        if off % target.itemsize == 0:
            torch.cat(run, out=flat[off : off + n].view(target))  # casts on the way in
        else:  # a mixed-dtype bucket left this run unaligned for `target`
            flat[off : off + n].copy_(torch.cat(run).to(target).view(torch.uint8))
        off, i = off + n, j
    return _Bucket(index, names, dtypes, shapes, flat, last)


def _error(f: Future) -> BaseException | None:
    """The exception of a finished call (a cancelled one counts as failed); None while running or on success."""
    if not f.done():
        return None
    if f.cancelled():
        return RuntimeError("cancelled")
    return f.exception()


def _drain(it: Iterator) -> None:
    """Consume what is left of the trainer's iterator: its other ranks take part in the same gathers."""
    for _ in it:
        pass


# ---- engines --------------------------------------------------------------------------------------


def _checked(url: str, path: str, resp: Response) -> dict:
    """An engine's answer to a control call, or _Refused (HTTP status other than 200, success: false)."""
    if resp.status != 200:
        raise _Refused(f"{url}{path}: HTTP {resp.status}: {resp.body[:500].decode(errors='replace')}")
    data = msgspec.json.decode(resp.body) if resp.body else {}
    if isinstance(data, dict) and data.get("success") is False:
        raise _Refused(f"{url}{path}: {data.get('message')}")
    return data


class _Engine:
    """One engine in the update group; its group calls and announcements go out in order on one
    pipelined connection."""

    def __init__(self, url: str, info: dict[str, Any], group_prefix: str, headers: dict[str, str]) -> None:
        self.url = url
        self.tp_size = int(info.get("tp_size", 1))
        self.builtin = info.get("version") == BUILTIN_ENGINE
        self.dtype = info.get("dtype")
        self.channel = Pipeline(url, headers, PROBE_TIMEOUT_S)
        self.broken = False
        """An announcement failed: later ones are not sent (they would wait on a group it left)."""
        self.groups = [
            g
            for g in info.get("weight_update_groups", [])
            if g == group_prefix or g.startswith(group_prefix + "-")
        ]
        """Our update groups this engine is in: left before it joins a new one (after a rebuild, or
        ones an earlier trainer process left behind; the built-in engine lists them in its info)."""

    def call(self, path: str, body: Any, announcement: bool = False) -> Future:
        """POST in order after everything sent before; a Future of the answer's JSON (or _Refused, or
        the connection's error). A failed announcement marks the engine broken: later announcements
        fail at once instead of being sent (those already on the wire fail on the engine's side)."""
        out: Future = Future()
        out.set_running_or_notify_cancel()
        if announcement and self.broken:
            out.set_exception(_Refused(f"{self.url}: not announced (an earlier bucket failed)"))
            return out

        def done(raw: Future) -> None:
            try:
                out.set_result(_checked(self.url, path, raw.result()))
            except Exception as e:
                if announcement:
                    self.broken = True
                out.set_exception(e)

        self.channel.post(path, msgspec.json.encode(body)).add_done_callback(done)
        return out

    def close(self) -> None:
        self.channel.close()


class _UpdateFailed(Exception):
    """A bucket was not confirmed: engine calls that failed, and the collective's error if any."""

    def __init__(self, bucket: _Bucket, errors: dict[str, BaseException], collective: BaseException | None):
        self.bucket, self.errors, self.collective = bucket, errors, collective
        parts = [f"{url}: {e}" for url, e in errors.items()]
        if collective is not None:
            parts.append(f"collective: {collective}")
        super().__init__(f"bucket {bucket.index}: " + "; ".join(parts))


class WeightBus:
    """Connects to engines over HTTP, hosts rank 0 of the update group, publishes weights."""

    def __init__(
        self,
        engine_urls: list[str],
        api_key: str | None = None,
        backend: str = "gloo",
        bucket_bytes: int = BUCKET_BYTES,
        master_address: str = "127.0.0.1",
        pause_mode: str = "in_place",
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dtype: str | None = None,
        registry: Registry | None = None,
        rejoin_after_s: float = 60.0,
        device: str | torch.device | None = None,
        max_inflight: int = MAX_INFLIGHT,
        repair_in_stream: bool | None = None,
    ) -> None:
        """`dtype`: what the weights travel and load as ("bfloat16", ...); None: the engines' dtype from
        /get_server_info when they all report the same concrete one, else the trainer's own.
        `timeout_s`: bound on every HTTP call and collective (see SETUP_GRACE_S). `registry`: where
        engines that join mid-job wait (they are admitted at the next update). `rejoin_after_s`: an
        engine dropped, or one that failed to join, is retried as a joiner after this long.
        `device`: where buckets are packed (default: the current CUDA device for nccl, else CPU).
        `max_inflight`: see MAX_INFLIGHT. `repair_in_stream`: after an engine failed mid-update, re-send
        the unconfirmed buckets to the survivors (default: gloo), or park them until the next update
        (default: NCCL; see _recover)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {PAUSE_MODES}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: expected gloo or nccl")
        self.engine_urls = list(engine_urls)
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.master_address = master_address
        self.pause_mode = pause_mode
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.dtype = dtype_from_name(dtype) if dtype else None
        self.registry = registry
        self.rejoin_after_s = rejoin_after_s
        self.max_inflight = max(1, max_inflight)
        self.repair_in_stream = backend == "gloo" if repair_in_stream is None else repair_in_stream
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = headers
        # TCP_NODELAY: a POST goes out as two writes (headers, body); with Nagle on, the body waits for
        # the server's delayed ACK of the headers, 40 ms per call on Linux, i.e. per bucket.
        nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        self.http = httpx.Client(
            headers=headers, timeout=timeout_s, transport=httpx.HTTPTransport(socket_options=nodelay)
        )
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bus-http")
        self.engines: list[_Engine] = []
        self.group = None
        self._generation = 0
        self._retry_at: dict[str, float] = {}
        """Engines dropped (or failed to join): URL -> when to try them again as joiners."""
        self._parked: set[str] = set()
        """Engines left paused by a failed NCCL update (see _recover), until they rejoin."""
        self._grace = min(SETUP_GRACE_S, timeout_s)
        self._lock = threading.Lock()
        """One update (or connect) at a time: an update never overlaps another."""

    @property
    def urls(self) -> list[str]:
        """Engines in the update group now."""
        return [e.url for e in self.engines]

    # --- HTTP --------------------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: Any, timeout: float | None = None) -> dict:
        resp = self.http.post(
            url + path,
            content=msgspec.json.encode(body) if body is not None else b"{}",
            headers={"Content-Type": "application/json"},
            timeout=timeout or self.timeout_s,
        )
        if resp.status_code != 200:
            raise _Refused(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        data = resp.json() if resp.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise _Refused(f"{url}{path}: {data.get('message')}")
        return data

    def _info(self, url: str) -> dict:
        resp = self.http.get(url + "/get_server_info", timeout=min(PROBE_TIMEOUT_S, self.timeout_s))
        if resp.status_code != 200:
            raise _Refused(f"{url}/get_server_info: HTTP {resp.status_code}: {resp.text[:200]}")
        info = resp.json()
        # SGLang joins as rank_offset + tp_rank, whatever its PP rank: PP would need a group per stage.
        if int(info.get("pp_size", 1)) != 1:
            raise _Refused(f"{url}: pipeline-parallel engines (pp_size {info['pp_size']}) are unsupported")
        return info

    def _probe(self, urls: list[str]) -> dict[str, dict | BaseException]:
        """Server info of each engine, or why it could not be had (in parallel, bounded)."""
        futures = {u: self.pool.submit(self._info, u) for u in urls}
        out: dict[str, dict | BaseException] = {}
        for u, f in futures.items():
            try:
                out[u] = f.result()
            except Exception as e:
                out[u] = e
        return out

    def _on_all(self, engines: list[_Engine], path: str, body: Any) -> dict[str, BaseException]:
        """POST to every engine in parallel; returns the failures by URL."""
        futures = {e.url: self.pool.submit(self._post, e.url, path, body) for e in engines}
        return {u: f.exception() for u, f in futures.items() if f.exception() is not None}

    # --- membership and the group ------------------------------------------------------------------
    def connect(self) -> None:
        """Build the first update group with `engine_urls`; every one of them must answer (a bad token
        or a dead engine fails here in milliseconds, not after a group-setup timeout)."""
        with self._lock:
            infos = self._probe(self.engine_urls)
            errors = [f"{u}: {r}" for u, r in infos.items() if isinstance(r, BaseException)]
            if errors:
                raise BusError("; ".join(errors))
            self.engines = [_Engine(u, infos[u], self.group_name, self._headers) for u in self.engine_urls]
            if self.engines:
                self._rebuild()
            log.info(
                "weight bus connected: %d engines, %s, group %s", len(self.engines), self.backend, self._name
            )

    @property
    def _name(self) -> str:
        return self.group_name if self._generation <= 1 else f"{self.group_name}-{self._generation}"

    def _leave_group(self) -> None:
        shutdown_group(self.group)
        self.group = None

    def _rebuild(self) -> None:
        """Build a new group over self.engines (new name, new port); engines that cannot join are
        dropped and the build retried without them. Raises BusError after MAX_REBUILDS tries, with the
        last try's cause."""
        cause = "no try"
        for _ in range(MAX_REBUILDS):
            self._leave_group()
            if not self.engines:
                return
            self._generation += 1
            metrics.GROUP_REBUILDS.inc()
            name = self._name
            offsets, world = rank_offsets([e.tp_size for e in self.engines])
            # gloo: blocks until every rank joined; a survivor may first sit out a stuck receive
            timeout = self.timeout_s + self._grace if self.backend == "gloo" else self._nccl_backstop_s()
            try:  # the store listens before any engine is told its port (port 0: no race for a free one)
                store = tcp_store(self.master_address, 0, world, True, timeout)
            except Exception as e:  # ours, not the engines': they are not dropped for it
                cause = f"could not host its store on {self.master_address}: {type(e).__name__}: {e}"
                log.warning("weight group %s: %s", name, cause)
                continue
            port = store.port
            futures: dict[str, Future] = {}
            for e, offset in zip(self.engines, offsets, strict=True):
                req = InitWeightsUpdateGroup(
                    master_address=self.master_address,
                    master_port=port,
                    rank_offset=offset,
                    world_size=world,
                    group_name=name,
                    backend=self.backend,
                    timeout_s=self._engine_group_timeout_s() if e.builtin else None,
                )
                futures[e.url] = self._join(e, req)
            try:
                self.group = group_on(store, 0, world, self.backend, name, timeout)
            except Exception as e:
                cause = f"setup failed: {type(e).__name__}: {e}"
                log.warning("weight group %s: %s", name, cause)
            wait(futures.values(), timeout=self.timeout_s + 2 * self._grace)
            failed = {u: f.exception() if f.done() else TimeoutError("no answer") for u, f in futures.items()}
            failed = {u: err for u, err in failed.items() if err is not None}
            if self.group is not None and not failed:
                log.info(
                    "weight group %s: %d engines, world %d, port %d", name, len(self.engines), world, port
                )
                return
            for url, err in failed.items():
                cause = f"{url} could not join: {err}"
                log.warning("weight group %s: %s", name, cause)
            self._drop(list(failed) or [])
        self._leave_group()
        raise BusError(f"no weight update group could be built over {self.urls}; the last try: {cause}")

    def _nccl_backstop_s(self) -> float:
        """NCCL groups' own timeout: its watchdog takes the whole process down when a collective times
        out, so the bus aborts a broken group itself (rank 0 on its deadline, engines through
        /destroy_weights_update_group) well before this."""
        return NCCL_BACKSTOP * (self.timeout_s + 2 * self._grace)

    def _engine_group_timeout_s(self) -> float:
        """gloo: a survivor's receive stuck on a dead peer gives up after timeout_s (recovery waits for
        it, since the engine holds its weight lock meanwhile); NCCL: see _nccl_backstop_s."""
        return self.timeout_s if self.backend == "gloo" else self._nccl_backstop_s()

    def _join(self, e: _Engine, req: InitWeightsUpdateGroup) -> Future:
        """Leave the engine's previous groups (best effort: it may be gone, or never have joined), then
        join the new one, in that order on its connection. A Future of the join's answer."""
        for name in e.groups:
            e.call("/destroy_weights_update_group", DestroyWeightsUpdateGroup(group_name=name))
        e.groups, e.broken = [], False
        joined = e.call("/init_weights_update_group", req)

        def done(f: Future) -> None:
            if f.exception() is None:
                e.groups = [req.group_name]

        joined.add_done_callback(done)
        return joined

    def _leave_on_engine(self, e: _Engine) -> None:
        """Destroy the engine's groups and wait (bounded) for the answers."""
        calls = [
            e.call("/destroy_weights_update_group", DestroyWeightsUpdateGroup(group_name=n)) for n in e.groups
        ]
        wait(calls, timeout=min(PROBE_TIMEOUT_S, self.timeout_s))
        e.groups = []

    def _drop(self, urls: list[str], park: bool = False) -> list[str]:
        """Remove engines from the group (and from the registry's live set, so that they stop taking
        traffic until they are given the current weights again as joiners). `park`: alive engines whose
        weights this update left incomplete; they stay paused and rejoin at the next update."""
        dropped = []
        for e in [e for e in self.engines if e.url in urls]:
            self.engines.remove(e)
            e.close()
            dropped.append(e.url)
            self._retry_at[e.url] = time.monotonic() + (0.0 if park else self.rejoin_after_s)
            if park:
                self._parked.add(e.url)
            else:
                metrics.ENGINE_FAILURES.inc()
            if self.registry is not None:
                try:
                    self.registry.demote(e.url)
                except Exception as err:
                    log.warning("registry: could not demote %s: %s", e.url, err)
        if self.group is not None and dropped:
            self._leave_group()  # its world had them; a rebuild follows
        return dropped

    def _sync_members(self) -> tuple[list[str], list[str]]:
        """Before an update: drop engines that do not answer, admit joiners; rebuild if anything
        changed. Returns (joined, dropped)."""
        now = time.monotonic()
        candidates = self._candidates(now)
        infos = self._probe(self.urls + sorted(candidates))
        dead = [u for u in self.urls if isinstance(infos[u], BaseException)]
        left = self._deregistered(dead)
        for u in dead:
            if u in left:  # scaled down or replaced on purpose: expected, not a failure
                log.info("engine %s left the registry; dropped from the update group", u)
            else:
                log.warning("engine %s does not answer; dropped from the update group: %s", u, infos[u])
        dropped = self._drop(dead)
        joined = []
        for u in sorted(candidates):
            if isinstance(infos[u], BaseException):
                self._retry_at[u] = now + self.rejoin_after_s
                continue
            self._retry_at.pop(u, None)
            self._parked.discard(u)
            self.engines.append(_Engine(u, infos[u], self.group_name, self._headers))
            joined.append(u)
        if joined:
            log.info("engines joining the update group: %s", joined)
        if self.engines and (self.group is None or joined or dropped):
            self._rebuild()
        return [u for u in joined if u in self.urls], dropped

    def _candidates(self, now: float) -> set[str]:
        """Engines an update would try to admit now: registered as joining, or dropped (or failed to
        join) with their retry due; never one in the group, nor one whose retry is not due yet."""
        candidates = {u for u, t in list(self._retry_at.items()) if t <= now}
        if self.registry is not None:
            try:
                candidates.update(self.registry.joining())
            except Exception as e:  # Redis down: update the engines we have
                log.warning("registry: could not list joining engines: %s", e)
        candidates -= set(self.urls)
        return {u for u in candidates if self._retry_at.get(u, 0) <= now}

    def joiners_waiting(self) -> list[str]:
        """The engines the next update would try to admit, sorted. A trainer with nothing to train
        publishes its current weights for them (Trainer: bus.idle_sync_s) instead of waiting for its
        next step, which never comes when every engine is gone or still joining."""
        return sorted(self._candidates(time.monotonic()))

    def _deregistered(self, urls: list[str]) -> set[str]:
        """Those of `urls` that are in neither registry set (their engine left it: scaled down, or the
        job driver replaced it); empty without a registry that can list its live engines."""
        live = getattr(self.registry, "live", None)
        if not urls or live is None:
            return set()
        try:
            return set(urls) - set(live()) - set(self.registry.joining())
        except Exception as e:  # Redis down: call them failures
            log.debug("registry: %s", e)
            return set()

    def _wire_dtype(self) -> torch.dtype | None:
        """The bus's `dtype`, else the engines' common concrete dtype (SGLang may say "auto": no cast)."""
        if self.dtype is not None:
            return self.dtype
        names = {e.dtype for e in self.engines}
        if len(names) == 1:
            try:
                return dtype_from_name(names.pop())
            except (ValueError, TypeError, AttributeError):
                return None
        return None

    # --- one update --------------------------------------------------------------------------------
    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        """Send every (HF name, full tensor) of `named` to every live engine and tag them with `version`.
        `named` may be lazy (an FSDP full-tensor gather per parameter): it is consumed once, in order, and
        always to the end. Returns once every engine left in the group confirmed; raises BusError if an
        engine refused or no group could be built (the version must not be published then)."""
        it = iter(named)
        with self._lock:
            try:
                return self._publish(it, version)
            finally:
                _drain(it)

    def _publish(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> PublishStats:
        if self.http.is_closed:
            raise BusError("publish after close()")
        generation0 = self._generation
        joined, dropped = self._sync_members()
        dtype = self._wire_dtype()
        t_gather = time.perf_counter()
        stream = pack(it, self.bucket_bytes, dtype, self.device)
        first = next(stream, None)
        gather_s = time.perf_counter() - t_gather
        if first is None:
            raise BusError("publish: no tensors")
        if not self.engines:
            log.warning("version %d: no engine to update (none registered or all dropped)", version)
            return PublishStats(
                version=version, bytes=0, buckets=0, pause_ms=0.0, transfer_ms=0.0,
                gather_ms=gather_s * 1e3, engines=[], joined=[], dropped=dropped,
            )  # fmt: skip
        paused = list(self.engines)
        t_pause = time.perf_counter()
        total = n_buckets = 0
        timeline: list[list[float]] = []
        try:
            failed = self._on_all(paused, "/pause_generation", {"mode": self.pause_mode})
            refused = {u: e for u, e in failed.items() if isinstance(e, _Refused)}
            if refused and all(not isinstance(r, BaseException) for r in self._probe(list(refused)).values()):
                raise BusError(f"pause refused: {refused}")
            if failed:
                dropped += self._drop(list(failed))
                self._rebuild()
            t_transfer = time.perf_counter()
            total, n_buckets, pack_s, more_dropped, timeline = self._transfer(first, stream, version)
            gather_s += pack_s
            dropped += more_dropped
            transfer_s = time.perf_counter() - t_transfer
        finally:
            # Engines dropped meanwhile are continued too (one that timed out may still be alive), but not
            # waited for: they may not answer at all.
            for url in {e.url for e in paused} - set(self.urls) - self._parked:
                self.pool.submit(self._post, url, "/continue_generation", {})
            failed = self._on_all(self.engines, "/continue_generation", {})
            for url, err in failed.items():
                log.warning("engine %s: continue failed: %s", url, err)
            dropped += self._drop(list(failed))
        pause_s = time.perf_counter() - t_pause
        if self.registry is not None:
            for url in joined:
                if url in self.urls:
                    try:
                        self.registry.promote(url)
                    except Exception as e:  # it stays joining; the next update promotes it
                        log.warning("registry: could not promote %s: %s", url, e)
        stats = PublishStats(
            version=version,
            bytes=total,
            buckets=n_buckets,
            pause_ms=pause_s * 1e3,
            transfer_ms=transfer_s * 1e3,
            gather_ms=gather_s * 1e3,
            engines=self.urls,
            joined=[u for u in joined if u in self.urls],
            dropped=dropped,
            rebuilds=self._generation - generation0,
            timeline=timeline,
        )
        metrics.BYTES.inc(total)
        metrics.TRANSFER_SECONDS.observe(transfer_s)
        metrics.PAUSE_SECONDS.observe(pause_s)
        metrics.VERSION.set(version)
        metrics.UPDATES.inc()
        metrics.ENGINES.set(len(self.engines))
        log.info(
            "published version %d to %d engines: %.1f MB in %d buckets, transfer %.1f ms (%.2f GB/s), "
            "engines paused %.1f ms, gather %.1f ms%s%s",
            version,
            len(self.engines),
            total / 1e6,
            n_buckets,
            stats.transfer_ms,
            total / max(transfer_s, 1e-9) / 1e9,
            stats.pause_ms,
            stats.gather_ms,
            f", joined {stats.joined}" if stats.joined else "",
            f", dropped {dropped}" if dropped else "",
        )
        return stats

    def _transfer(self, first: _Bucket, stream: Iterator[_Bucket], version: int):
        """Announce and broadcast every bucket, packing the next while the previous is on the wire; on a
        failure, rebuild over the survivors and re-send what they have not confirmed.
        Returns (bytes, buckets, seconds spent packing, engines dropped, timeline: see PublishStats)."""
        t0 = time.perf_counter()
        timeline: list[list[float]] = []
        pending: deque[_Bucket] = deque()
        nxt: _Bucket | None = first
        total = count = 0
        pack_s = 0.0
        dropped: list[str] = []
        rebuilds = 0
        while (nxt is not None or pending) and self.engines:
            if nxt is not None and len(pending) < self.max_inflight:
                self._launch(nxt, version)
                pending.append(nxt)
                if nxt.last:
                    nxt = None
                else:
                    t = time.perf_counter()
                    nxt = next(stream)  # gathered and packed while the buckets before it are on the wire
                    pack_s += time.perf_counter() - t
                continue
            try:
                done = self._confirm(pending[0])
            except _UpdateFailed as failure:
                rebuilds += 1
                if rebuilds > MAX_REBUILDS:
                    self._leave_group()
                    raise BusError(f"update failed {rebuilds} times; last: {failure}") from failure
                dropped += self._recover(failure, pending, confirmed=count)
                if not self.engines:
                    log.warning("version %d: every engine was dropped", version)
                    return total, count, pack_s, dropped, timeline
                for b in pending:
                    self._launch(b, version)
                continue
            pending.popleft()
            total += done.flat.numel()
            count += 1
            timeline.append([done.index] + [round((t - t0) * 1e3, 3) for t in done.times])
            done.flat = done.work = None
        return total, count, pack_s, dropped, timeline

    def _launch(self, b: _Bucket, version: int) -> None:
        body = UpdateWeightsFromDistributed(
            names=b.names,
            dtypes=b.dtypes,
            shapes=b.shapes,
            group_name=self._name,
            load_format=FLATTENED_BUCKET,
            weight_version=str(version) if b.last else None,
            flush_cache=b.last,
        )
        b.times[0] = time.perf_counter()
        b.calls = {
            e.url: e.call("/update_weights_from_distributed", body, announcement=True) for e in self.engines
        }
        try:
            b.work = broadcast_async(self.group, b.flat)
        except Exception as e:  # the group is already broken: _confirm reports it
            b.work = e

    def _confirm(self, b: _Bucket) -> _Bucket:
        """Wait (bounded) until bucket b's broadcast is done and every engine answered 200."""
        deadline = time.monotonic() + self.timeout_s + self._grace
        work = b.work
        while True:
            errors = {u: err for u, f in b.calls.items() if (err := _error(f)) is not None}
            if isinstance(work, BaseException):
                raise _UpdateFailed(b, errors, work)
            if errors:
                raise _UpdateFailed(b, errors, None)
            sent = work.is_completed()
            answered = all(f.done() for f in b.calls.values())
            now = time.perf_counter()
            if sent and not b.times[1]:
                b.times[1] = now
            if answered and not b.times[2]:
                b.times[2] = now
            if sent and answered:
                break
            if time.monotonic() > deadline:
                late = {u: TimeoutError("no answer in time") for u, f in b.calls.items() if not f.done()}
                done = work.is_completed()
                raise _UpdateFailed(b, late, None if done else TimeoutError("broadcast did not complete"))
            time.sleep(POLL_S)
        try:
            work.wait()
        except Exception as e:
            raise _UpdateFailed(b, {}, e) from e
        return b

    def _recover(self, failure: _UpdateFailed, pending: deque[_Bucket], confirmed: int) -> list[str]:
        """Leave the broken group, find out who is dead, rebuild over the survivors (the caller re-sends
        the pending buckets). An engine that is alive but refused a bucket whose broadcast went through
        raises BusError instead.

        NCCL (repair_in_stream False), after `confirmed` > 0 buckets: an engine answers an announcement
        once its receive is queued, and rank 0's broadcast completes once the bytes left it, so neither
        proves that a bucket reached an engine downstream of the dead one; re-sending only the pending
        buckets could leave a survivor with a hole. The survivors are parked instead: out of the group (and of the
        registry's live set), still paused, their groups aborted, and rejoined with the whole model at
        the next update. (gloo receives block: an engine's answer means its bytes arrived.)"""
        log.warning("weight update failed: %s", failure)
        self._leave_group()  # rank 0's unfinished broadcasts fail now
        # Let sent announcements finish (a survivor gives up a receive stuck on the dead peer after its
        # group timeout, and then fails the rest at once), so that each engine's answer tells what
        # happened to it. One that stays silent is lost.
        errors: dict[str, BaseException] = dict(failure.errors)
        for e in self.engines:  # already lost (no answer in time, connection error): stop waiting on them
            if e.url in errors and not isinstance(errors[e.url], _Refused):
                e.channel.close()
        calls = [f for b in pending for f in b.calls.values()]
        wait(calls, timeout=self.timeout_s + 2 * self._grace)
        for b in pending:
            for url, f in b.calls.items():
                if url not in errors:
                    err = _error(f) if f.done() else TimeoutError("no answer in time")
                    if err is not None:
                        errors[url] = err
        lost = {u for u, e in errors.items() if not isinstance(e, _Refused)}  # transport error, timeout
        infos = self._probe([u for u in self.urls if u not in lost])
        lost |= {u for u, r in infos.items() if isinstance(r, BaseException)}
        refused = {u: e for u, e in errors.items() if u not in lost}
        if refused and not lost and failure.collective is None:
            # everyone alive and the bytes arrived, yet an engine said no: a bug, not a failure
            raise BusError("; ".join(str(e) for e in refused.values()))
        dropped = self._drop(sorted(lost))
        for url in dropped:
            log.warning("engine %s dropped from the update group: %s", url, errors.get(url, infos.get(url)))
        if not self.repair_in_stream and confirmed > 0 and self.engines:
            survivors = list(self.engines)
            list(self.pool.map(self._leave_on_engine, survivors))  # abort their stuck receives
            parked = self._drop([e.url for e in survivors], park=True)
            log.warning("engines %s parked (paused) until the next update resends the whole model", parked)
            return dropped + parked
        self._rebuild()
        return dropped

    def close(self) -> None:
        """Leave the group on every side (engines keep serving) and release the connections."""
        with self._lock:
            self._leave_group()
            list(self.pool.map(self._leave_on_engine, self.engines))
            for e in self.engines:
                e.close()
            self.engines = []
        self.http.close()
        self.pool.shutdown(wait=False)
