"""Per-rank colocated handoff (bus.backend ipc with more than one trainer rank): every trainer rank hands
the weights to the engines on its own device, since an engine sees only its own GPU and a CUDA-IPC
handle opens only on the device it names (slime's UpdateWeightFromTensor: each rank gathers, then calls
its local engine once per bucket). Every rank materialises the full tensors anyway (an FSDP full_tensor
is a collective), bucket by bucket.

One update, every rank calling `RankHandoff.publish` with its own bus's handoff and the trainer's object collective:

  1. plan — rank 0 syncs the membership (as a single-rank update does) and assigns each engine to the
     rank on its device: by the CUDA device UUID the engine reports (the built-in engine's
     /get_server_info `device_uuid`), else by position (engine j to rank j mod ranks: a colocated job
     puts engine i on trainer rank i's device; on CPU shared memory reaches any engine). The plan is
     broadcast.
  2. bucket 0 — every rank packs its first bucket (the same tensors on every rank, so the same
     gathers in the same order), before the pause.
  3. pause — rank 0 pauses every engine, or folds the pause into the one call as a single-rank update
     does (IpcTransfer.folds_pause), and broadcasts that decision: no rank sends before the pause.
  4. buckets — every rank sends its buckets to its own engines (IpcTransfer: its ring, its kept
     payloads, its failure handling: a dead engine is dropped, a refusal is an error).
  5. results — gathered by every rank; rank 0 drops the engines a rank lost, continues the engines,
     and every rank raises BusError if any rank's engine refused.

Versioning is the single-rank update's: each rank's last call carries the version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from weight_bus import ipc
from weight_bus.errors import BusError
from weight_bus.group import dtype_from_name, dtype_name
from weight_bus.ipc_transfer import IpcTransfer
from weight_bus.membership import IPC, Member, Membership
from weight_bus.stats import PublishStats, record_publish

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The trainer ranks' object collective (trainer.distributed.RankGroup)."""

    rank: int
    world_size: int

    def broadcast(self, obj=None): ...

    def all_gather(self, obj) -> list: ...


def assign(engines: list[Member], devices: list[str | None]) -> tuple[list[list[Member]], list[Member]]:
    """Each rank's engines (`devices`: each rank's CUDA device UUID, None on CPU), and the engines no rank
    can reach (a CUDA device UUID no rank has)."""
    out: list[list[Member]] = [[] for _ in devices]
    unreachable = []
    for j, e in enumerate(engines):
        if e.device_uuid is None or all(d is None for d in devices):
            out[j % len(devices)].append(e)
        elif e.device_uuid in devices:
            out[devices.index(e.device_uuid)].append(e)
        else:
            unreachable.append(e)
    return out, unreachable


class RankHandoff:
    """One trainer rank's side of the per-rank handoff (see the module): its bus (rank 0's knows the
    engines), its own transfer to the engines on its device, and every rank's device, learned at the
    first update."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self.devices: list[str | None] | None = None
        """Each rank's CUDA device UUID (None on CPU), gathered at the first update."""
        self.local: IpcTransfer | None = None
        """This rank's transfer to its own engines (its connections, ring and kept payloads)."""

    def _local(self) -> IpcTransfer:
        if self.local is None:
            bus = self.bus
            t = bus.transfer
            members = Membership(
                bus.client, bus.calls, [], backend=IPC, master_address="127.0.0.1",
                group_name=bus.members.group_name, timeout_s=t.timeout_s, dtype=None, registry=None,
                rejoin_after_s=bus.members.rejoin_after_s,
            )  # fmt: skip
            self.local = IpcTransfer(
                members, bus.client, bus.calls, bucket_bytes=t.bucket_bytes, pause_mode=t.pause_mode,
                device=t.device, max_inflight=t.max_inflight, repair_in_stream=False,
            )  # fmt: skip
        return self.local

    def close(self) -> None:
        if self.local is not None:
            for e in self.local.members.engines:
                e.close()

    def _plan(self, ranks: Ranks) -> tuple[dict, list[str], list[str], bool]:
        """Rank 0 syncs the membership and assigns the engines to ranks; every rank gets the plan
        (`error` in it when rank 0 failed). Returns (plan, joined, dropped, probed)."""
        t, m = self.bus.transfer, self.bus.members
        plan = None
        joined: list[str] = []
        dropped: list[str] = []
        probe = False
        if ranks.rank == 0:
            try:
                probe = t.probe_due()
                t.healthy = False
                joined, dropped = m.sync(probe=probe)
                per_rank, unreachable = assign(m.engines, self.devices)
                for e in unreachable:
                    log.warning(
                        "engine %s: its GPU (%s) is no trainer rank's; left out", e.url, e.device_uuid
                    )
                dropped += m.drop([e.url for e in unreachable])
                dtype = m.wire_dtype()
                plan = {
                    "dtype": dtype_name(dtype) if dtype is not None else None,
                    "engines": [[(e.url, e.info) for e in es] for es in per_rank],
                }
            except Exception as e:  # every rank learns it, drains its gathers and raises
                plan = {"error": f"rank 0: {type(e).__name__}: {e}"}
        return ranks.broadcast(plan), joined, dropped, probe

    def _pause(self, ranks: Ranks, first) -> tuple[dict, list[Member]]:
        """Rank 0 pauses every engine (or folds the pause into the one call); every rank learns the
        decision and drops the engines that could not be paused. Returns (decision, engines paused)."""
        bus, t, m = self.bus, self.bus.transfer, self.bus.members
        go = None
        paused: list[Member] = []
        if ranks.rank == 0:
            fold = first is not None and t.folds_pause(first)
            paused = [] if fold else list(m.engines)
            failed = t._on_all(paused, bus.client.pause_generation, t.pause_mode)
            for url, err in failed.items():
                log.warning("engine %s: pause failed: %s", url, err)
            go = {"fold": fold, "abort": t.abort_in_call, "failed": sorted(failed)}
        go = ranks.broadcast(go)
        local = self.local
        local.abort_in_call = go["abort"]
        lost = set(go["failed"])
        if lost:
            _set_local(local, [(e.url, e.info) for e in local.members.engines if e.url not in lost])
        return go, paused

    # Long: one update's phases in order, every rank through the same collectives at the same points
    def publish(
        self, it: Iterator[tuple[str, torch.Tensor]], version: int, persistent: bool, ranks: Ranks
    ) -> PublishStats | None:
        """One update from every rank to the engines on its device (see the module). Returns the stats on
        rank 0 (None on the others); raises BusError on every rank if an engine refused or rank 0 could
        not pause; the caller drains `it` afterwards."""
        bus = self.bus
        if bus.client.is_closed:
            raise BusError("publish after close()")
        if self.devices is None:
            self.devices = ranks.all_gather(ipc.device_uuid(bus.transfer.device))
        plan, joined, dropped, probe = self._plan(ranks)
        if "error" in plan:
            for _ in it:
                pass
            raise BusError(plan["error"])
        local = self._local()
        _set_local(local, plan["engines"][ranks.rank])
        dtype = dtype_from_name(plan["dtype"]) if plan["dtype"] else None

        error: str | None = None
        t_gather = time.perf_counter()
        stream = local.pack(it, dtype, persistent=persistent)
        try:
            first = next(stream, None)
            if first is None:
                error = "publish: no tensors"
        except Exception as e:  # reported with the others' results below
            first, error = None, f"rank {ranks.rank}: {type(e).__name__}: {e}"
        gather_s = time.perf_counter() - t_gather

        t_pause = time.perf_counter()
        go, paused = self._pause(ranks, first)
        total = n_buckets = 0
        local_dropped: list[str] = []
        timeline: list = []
        t_transfer = time.perf_counter()
        if first is not None and local.members.engines and error is None:
            try:
                total, n_buckets, pack_s, local_dropped, timeline = local._transfer(first, stream, version)
                gather_s += pack_s
            except Exception as e:
                error = f"rank {ranks.rank}: {type(e).__name__}: {e}"
        for _ in stream:  # the rest of this rank's gathers, in the others' order
            pass
        transfer_s = time.perf_counter() - t_transfer
        local.healthy = error is None and not local_dropped
        results = ranks.all_gather({"dropped": local_dropped, "error": error, "bytes": total})
        errors = [r["error"] for r in results if r["error"]]
        if ranks.rank != 0:
            if errors:
                raise BusError("; ".join(errors))
            return None
        lost = set(go["failed"]) | {u for r in results for u in r["dropped"]}
        dropped += self._continue(sorted(lost), paused, go["fold"])
        pause_s = time.perf_counter() - t_pause
        if errors:
            raise BusError("; ".join(errors))
        m = bus.members
        bus.transfer.healthy = bool(m.engines) and not dropped
        m.promote(joined)
        stats = PublishStats(
            version=version, bytes=total, buckets=n_buckets, pause_ms=pause_s * 1e3,
            transfer_ms=transfer_s * 1e3, gather_ms=gather_s * 1e3, engines=m.urls,
            joined=[u for u in joined if u in m.urls], dropped=dropped, timeline=timeline,
            handoff=local.handoff, paused=not go["fold"], probed=probe, ranks=ranks.world_size,
        )  # fmt: skip
        record_publish(stats, IPC, sum(r["bytes"] for r in results), transfer_s, pause_s)
        log.info(
            "published version %d to %d engines from %d ranks (each to the engines on its device): %.1f MB "
            "per rank, %s, transfer %.1f ms, engines paused %.1f ms%s%s",
            version,
            len(m.engines),
            ranks.world_size,
            total / 1e6,
            local.handoff,
            stats.transfer_ms,
            stats.pause_ms,
            f", joined {stats.joined}" if stats.joined else "",
            f", dropped {dropped}" if dropped else "",
        )
        return stats

    def _continue(self, lost: list[str], paused: list[Member], folded: bool) -> list[str]:
        """Rank 0, after every rank sent: drops the engines a rank lost and continues the others (and any
        paused engine that left the group). Returns the engines dropped."""
        bus, m = self.bus, self.bus.members
        for url in lost:
            if url in m.urls:
                log.warning("engine %s dropped from the weight update (per-rank handoff)", url)
        dropped = m.drop(lost)
        for url in {e.url for e in paused} - set(m.urls) - m.parked:
            bus.calls.submit(bus.client.continue_generation, url)
        failed = bus.transfer._on_all([] if folded else m.engines, bus.client.continue_generation)
        for url, err in failed.items():
            log.warning("engine %s: continue failed: %s", url, err)
        return dropped + m.drop(list(failed))


def _set_local(local: IpcTransfer, engines: list[tuple[str, dict]]) -> None:
    """This rank's engines as the plan says, keeping the connections of those it had."""
    m = local.members
    have = {e.url: e for e in m.engines}
    m.engines = [
        have.pop(url, None) or Member(local.client, url, info, m.group_name) for url, info in engines
    ]
    for e in have.values():
        e.close()
