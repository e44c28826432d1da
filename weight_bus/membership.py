"""Who is in the weight bus's update group: probing engines, admitting joiners from the registry,
dropping the dead (or parking survivors of a failed NCCL update), and building the group over them.

The group is {trainer rank 0, every engine's TP ranks}; every change of membership builds a new one
(new name, new port): rank 0 hosts a fresh TCPStore, tells each engine to leave its previous groups and
join this one, and joins itself. An engine that cannot join is dropped and the build retried without it.
Backend `ipc` has no group: its engines (on this host only) are the members, and admitting one is
adding it to the list.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch

from common.net import is_local
from weight_bus import metrics
from weight_bus.engine_client import PROBE_TIMEOUT_S, EngineClient
from weight_bus.errors import BusError, Refused
from weight_bus.group import dtype_from_name, group_on, shutdown_group, tcp_store
from weight_bus.packing import rank_offsets
from weight_bus.schema import InitWeightsUpdateGroup, UpdateWeightsFromTensor

log = logging.getLogger(__name__)

SETUP_GRACE_S = 10.0
"""Extra time (at most `timeout_s`) for group setup and announcements beyond `timeout_s`: a survivor
whose receive is stuck on a dead peer gives it up only after its own group timeout (`timeout_s`), then
joins the new group."""
NCCL_BACKSTOP = 3
"""NCCL group timeout, in units of the bus's longest wait (see Membership.nccl_backstop_s)."""
MAX_REBUILDS = 3
"""Group rebuilds one update may go through before it gives up with BusError."""
IPC = "ipc"
"""The backend without a group: tensors handed over by CUDA IPC / shared memory (weight_bus/ipc.py)."""
BUILTIN_ENGINE = "slipstream-builtin"
"""`version` in the built-in engine's /get_server_info: it takes InitWeightsUpdateGroup.timeout_s."""


class Registry(Protocol):
    """What the bus needs of the engine registry (weight_bus.registry.EngineRegistry): engines
    registered mid-job wait in a joining set until the bus has given them the current weights."""

    def joining(self) -> list[str]: ...

    def promote(self, url: str) -> bool: ...

    def demote(self, url: str) -> None: ...


class Member:
    """One engine in the update group; its group calls and announcements go out in order on one
    pipelined connection."""

    def __init__(self, client: EngineClient, url: str, info: dict[str, Any], group_prefix: str) -> None:
        self.url = url
        self.tp_size = int(info.get("tp_size", 1))
        self.builtin = info.get("version") == BUILTIN_ENGINE
        self.dtype = info.get("dtype")
        self.layout = info.get("weight_layout")
        """The digest of the engine's weight arena layout (built-in engine; None: no arena)."""
        self.device_uuid = info.get("device_uuid")
        """The CUDA device the engine runs on (the built-in engine says; None: unknown, or CPU)."""
        self.info = {
            "tp_size": self.tp_size,
            "version": info.get("version"),
            "dtype": self.dtype,
            "device_uuid": self.device_uuid,
        }
        """What of its server info another trainer rank needs to send it weights (weight_bus.rank_handoff)."""
        self.channel = client.channel(url)
        self.payload_refs: dict[str, str] = {}
        self.payload_refs_before: dict[str, str] = {}
        """ipc: payloads this (built-in) engine keeps -> the reference it answered for each, for this
        update and the one before (what the engine keeps: ipc.OpenedHandles); sent instead of the payload."""
        self.copy_event: tuple[str, Any] | None = None
        """ipc on CUDA: (handle, the opened event) the engine records after each copy (completion event)."""
        self.broken = False
        """An announcement failed: later ones are not sent (they would wait on a group it left)."""
        self.groups = [
            g
            for g in info.get("weight_update_groups", [])
            if g == group_prefix or g.startswith(group_prefix + "-")
        ]
        """Our update groups this engine is in: left before it joins a new one (after a rebuild, or
        ones an earlier trainer process left behind; the built-in engine lists them in its info)."""

    def announce(self, body) -> Future:
        """POST /update_weights_from_distributed (or, for an UpdateWeightsFromTensor body,
        /update_weights_from_tensor) after everything sent before. A failed announcement
        marks the engine broken: later announcements fail at once instead of being sent (those already
        on the wire fail on the engine's side)."""
        out: Future = Future()
        out.set_running_or_notify_cancel()
        if self.broken:
            out.set_exception(Refused(f"{self.url}: not announced (an earlier bucket failed)"))
            return out

        def done(f: Future) -> None:
            err = f.exception()
            if err is None:
                out.set_result(f.result())
            else:
                self.broken = True
                out.set_exception(err)

        if isinstance(body, UpdateWeightsFromTensor):
            self.channel.update_weights_from_tensor(body).add_done_callback(done)
        else:
            self.channel.update_weights_from_distributed(body).add_done_callback(done)
        return out

    def join(self, req: InitWeightsUpdateGroup) -> Future:
        """Leave the engine's previous groups (best effort: it may be gone, or never have joined), then
        join the new one, in that order on its connection. A Future of the join's answer."""
        for name in self.groups:
            self.channel.destroy_weights_update_group(name)
        self.groups, self.broken = [], False
        joined = self.channel.init_weights_update_group(req)

        def done(f: Future) -> None:
            if f.exception() is None:
                self.groups = [req.group_name]

        joined.add_done_callback(done)
        return joined

    def leave(self, timeout_s: float) -> None:
        """Destroy the engine's groups and wait (bounded) for the answers."""
        wait([self.channel.destroy_weights_update_group(n) for n in self.groups], timeout=timeout_s)
        self.groups = []

    def close(self) -> None:
        self.channel.close()


class Membership:
    """The engines in the update group, rank 0's side of the group, and the engines waiting to (re)join."""

    def __init__(
        self,
        client: EngineClient,
        calls: ThreadPoolExecutor,
        engine_urls: list[str],
        backend: str,
        master_address: str,
        group_name: str,
        timeout_s: float,
        dtype: torch.dtype | None,
        registry: Registry | None,
        rejoin_after_s: float,
    ) -> None:
        self.client, self.calls = client, calls
        self.engine_urls = list(engine_urls)
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.dtype = dtype
        self.registry = registry
        self.rejoin_after_s = rejoin_after_s
        self.grace = min(SETUP_GRACE_S, timeout_s)
        self.engines: list[Member] = []
        self.group = None
        self.generation = 0
        """Groups built so far; the current one's name carries it from the second on."""
        self.retry_at: dict[str, float] = {}
        """Engines dropped (or failed to join): URL -> when to try them again as joiners."""
        self.parked: set[str] = set()
        """Engines left paused by a failed NCCL update (see Transfer.recover), until they rejoin."""
        self.waiting: list[str] = []
        """Engines in the group that the registry lists as joining (promoted after the update)."""
        self.lora_files = False
        """Adapter-only updates (a LoRA job): engines without the built-in engine's adapter-over-the-group
        extension (SGLang) load the adapter from a directory, so no group is built over them."""

    @property
    def urls(self) -> list[str]:
        """Engines in the update group now."""
        return [e.url for e in self.engines]

    @property
    def name(self) -> str:
        """The current group's name."""
        return self.group_name if self.generation <= 1 else f"{self.group_name}-{self.generation}"

    # --- probing -----------------------------------------------------------------------------------
    def info(self, url: str) -> dict:
        if self.backend == IPC and not is_local(url):
            raise Refused(
                f"{url}: bus backend ipc hands weights over on this host only; the engine is not on it"
            )
        info = self.client.server_info(url)
        # SGLang joins as rank_offset + tp_rank, whatever its PP rank: PP would need a group per stage.
        if int(info.get("pp_size", 1)) != 1:
            raise Refused(f"{url}: pipeline-parallel engines (pp_size {info['pp_size']}) are unsupported")
        return info

    def probe(self, urls: list[str]) -> dict[str, dict | BaseException]:
        """Server info of each engine, or why it could not be had (in parallel, bounded)."""
        futures = {u: self.calls.submit(self.info, u) for u in urls}
        out: dict[str, dict | BaseException] = {}
        for u, f in futures.items():
            try:
                out[u] = f.result()
            except Exception as e:
                out[u] = e
        return out

    # --- the group ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Build the first update group with `engine_urls`; every one of them must answer (a bad token
        or a dead engine fails here in milliseconds, not after a group-setup timeout)."""
        infos = self.probe(self.engine_urls)
        errors = [f"{u}: {r}" for u, r in infos.items() if isinstance(r, BaseException)]
        if errors:
            raise BusError("; ".join(errors))
        self.engines = [Member(self.client, u, infos[u], self.group_name) for u in self.engine_urls]
        if self.engines:
            self.rebuild()

    def leave_group(self) -> None:
        shutdown_group(self.group)
        self.group = None

    def rebuild(self) -> None:
        """Build a new group over self.engines (new name, new port); engines that cannot join are
        dropped and the build retried without them. Raises BusError after MAX_REBUILDS tries, with the
        last try's cause."""
        if self.backend == IPC:  # no group: every engine in self.engines gets the buckets over HTTP
            return
        if self.lora_files and any(not e.builtin for e in self.engines):  # they read adapter directories
            self.leave_group()
            return
        cause = "no try"
        for _ in range(MAX_REBUILDS):
            self.leave_group()
            if not self.engines:
                return
            self.generation += 1
            metrics.GROUP_REBUILDS.inc()
            name = self.name
            offsets, world = rank_offsets([e.tp_size for e in self.engines])
            # gloo: blocks until every rank joined; a survivor may first sit out a stuck receive
            timeout = self.timeout_s + self.grace if self.backend == "gloo" else self.nccl_backstop_s()
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
                    timeout_s=self.engine_group_timeout_s() if e.builtin else None,
                )
                futures[e.url] = e.join(req)
            try:
                self.group = group_on(store, 0, world, self.backend, name, timeout, self.master_address)
            except Exception as e:
                cause = f"setup failed: {type(e).__name__}: {e}"
                log.warning("weight group %s: %s", name, cause)
            wait(futures.values(), timeout=self.timeout_s + 2 * self.grace)
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
            self.drop(list(failed) or [])
        self.leave_group()
        raise BusError(f"no weight update group could be built over {self.urls}; the last try: {cause}")

    def nccl_backstop_s(self) -> float:
        """NCCL groups' own timeout: its watchdog takes the whole process down when a collective times
        out, so the bus aborts a broken group itself (rank 0 on its deadline, engines through
        /destroy_weights_update_group) well before this."""
        return NCCL_BACKSTOP * (self.timeout_s + 2 * self.grace)

    def engine_group_timeout_s(self) -> float:
        """gloo: a survivor's receive stuck on a dead peer gives up after timeout_s (recovery waits for
        it, since the engine holds its weight lock meanwhile); NCCL: see nccl_backstop_s."""
        return self.timeout_s if self.backend == "gloo" else self.nccl_backstop_s()

    def leave_on_engine(self, e: Member) -> None:
        """Destroy the engine's groups and wait (bounded) for the answers."""
        e.leave(min(PROBE_TIMEOUT_S, self.timeout_s))

    # --- membership --------------------------------------------------------------------------------
    def drop(self, urls: list[str], park: bool = False) -> list[str]:
        """Remove engines from the group (and from the registry's live set, so that they stop taking
        traffic until they are given the current weights again as joiners). `park`: alive engines whose
        weights this update left incomplete; they stay paused and rejoin at the next update."""
        dropped = []
        for e in [e for e in self.engines if e.url in urls]:
            self.engines.remove(e)
            e.close()
            dropped.append(e.url)
            self.retry_at[e.url] = time.monotonic() + (0.0 if park else self.rejoin_after_s)
            if park:
                self.parked.add(e.url)
            else:
                metrics.ENGINE_FAILURES.inc()
            if self.registry is not None:
                try:
                    self.registry.demote(e.url)
                except Exception as err:
                    log.warning("registry: could not demote %s: %s", e.url, err)
        if self.group is not None and dropped:
            self.leave_group()  # its world had them; a rebuild follows
        return dropped

    def sync(self, probe: bool = True) -> tuple[list[str], list[str]]:
        """Before an update: drop engines that do not answer, admit joiners; rebuild if anything
        changed. `probe` False: the engines in the group are known alive (the last update reached every
        one of them, and the update's own calls detect a failure), so only joiners are probed, and those
        in neither registry set (scaled down or replaced; or demoted and not renewed yet). Returns
        (joined, dropped)."""
        now = time.monotonic()
        joining = self._joining()
        candidates = self._candidates(now, joining)
        self.waiting = [u for u in joining or [] if u in self.urls]
        suspects = [] if probe else sorted(self._deregistered(list(self.urls), joining))
        infos = self.probe((self.urls if probe else suspects) + sorted(candidates))
        dead = [u for u in self.urls if isinstance(infos.get(u), BaseException)]
        left = self._deregistered(dead, joining)
        for u in dead:
            if u in left:  # scaled down or replaced on purpose: expected, not a failure
                log.info("engine %s left the registry; dropped from the update group", u)
            else:
                log.warning("engine %s does not answer; dropped from the update group: %s", u, infos[u])
        dropped = self.drop(dead)
        joined = []
        for u in sorted(candidates):
            if isinstance(infos[u], BaseException):
                self.retry_at[u] = now + self.rejoin_after_s
                continue
            self.retry_at.pop(u, None)
            self.parked.discard(u)
            self.engines.append(Member(self.client, u, infos[u], self.group_name))
            joined.append(u)
        if joined:
            log.info("engines joining the update group: %s", joined)
        if self.engines and (self.group is None or joined or dropped):
            self.rebuild()
        return [u for u in joined if u in self.urls], dropped

    def promote(self, joined: list[str]) -> None:
        """Let engines that joined and hold the current weights take traffic (the registry's live set);
        also those in the group found waiting in the joining set (one that rejoined before its renewal
        had moved it there: its promotion found nothing to move)."""
        if self.registry is None:
            return
        for url in dict.fromkeys([*joined, *self.waiting]):
            if url in self.urls:
                try:
                    self.registry.promote(url)
                except Exception as e:  # it stays joining; the next update promotes it
                    log.warning("registry: could not promote %s: %s", url, e)

    def _joining(self) -> list[str] | None:
        """The registry's joining set, read once per update; [] without a registry, None when Redis
        cannot be read (the update goes to the engines we have)."""
        if self.registry is None:
            return []
        try:
            return self.registry.joining()
        except Exception as e:
            log.warning("registry: could not list joining engines: %s", e)
            return None

    def _candidates(self, now: float, joining: list[str] | None) -> set[str]:
        """Engines an update would try to admit now: registered as joining, or dropped (or failed to
        join) with their retry due; never one in the group, nor one whose retry is not due yet."""
        candidates = {u for u, t in list(self.retry_at.items()) if t <= now} | set(joining or [])
        candidates -= set(self.urls)
        return {u for u in candidates if self.retry_at.get(u, 0) <= now}

    def joiners_waiting(self) -> list[str]:
        """The engines the next update would try to admit, sorted."""
        return sorted(self._candidates(time.monotonic(), self._joining()))

    def _deregistered(self, urls: list[str], joining: list[str] | None) -> set[str]:
        """Those of `urls` that are in neither registry set (`joining`: the joining set as read for this
        update; their engine left it: scaled down, or the job driver replaced it); empty without a
        registry that can list its live engines, or when Redis cannot be read."""
        live = getattr(self.registry, "live", None)
        if not urls or live is None or joining is None:
            return set()
        try:
            return set(urls) - set(live()) - set(joining)
        except Exception as e:  # Redis down: call them failures
            log.debug("registry: %s", e)
            return set()

    def wire_dtype(self) -> torch.dtype | None:
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

    def close(self) -> None:
        """Leave the group on every side (engines keep serving) and release the connections."""
        self.leave_group()
        list(self.calls.map(self.leave_on_engine, self.engines))
        for e in self.engines:
            e.close()
        self.engines = []
