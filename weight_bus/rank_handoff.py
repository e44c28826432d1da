"""Per-rank colocated handoff (bus.backend ipc with more than one trainer rank): every trainer rank hands
the weights to the engines on its own device, since an engine sees only its own GPU and a CUDA-IPC
handle opens only on the device it names (slime's UpdateWeightFromTensor: each rank gathers, then calls
its local engine once per bucket). Every rank materialises the full tensors anyway (an FSDP full_tensor
is a collective), bucket by bucket.

One update, every rank calling `publish_per_rank` with its own bus and the trainer's object collective:

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
from weight_bus.transfer import PublishStats, record_publish

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The trainer ranks' object collective (trainer.distributed.Pool)."""

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


def _local(bus: Any) -> IpcTransfer:
    """This rank's transfer to its own engines (its own connections, ring and kept payloads)."""
    if bus.local_transfer is None:
        t = bus.transfer
        members = Membership(
            bus.client, bus.pool, [], backend=IPC, master_address="127.0.0.1",
            group_name=bus.members.group_name, timeout_s=t.timeout_s, dtype=None, registry=None,
            rejoin_after_s=bus.members.rejoin_after_s,
        )  # fmt: skip
        bus.local_transfer = IpcTransfer(
            members, bus.client, bus.pool, bucket_bytes=t.bucket_bytes, pause_mode=t.pause_mode,
            device=t.device, max_inflight=t.max_inflight, repair_in_stream=False,
        )  # fmt: skip
    return bus.local_transfer


def _set_local(local: IpcTransfer, engines: list[tuple[str, dict]]) -> None:
    """This rank's engines as the plan says, keeping the connections of those it had."""
    m = local.members
    have = {e.url: e for e in m.engines}
    m.engines = [
        have.pop(url, None) or Member(local.client, url, info, m.group_name) for url, info in engines
    ]
    for e in have.values():
        e.close()


def publish_per_rank(
    bus: Any, it: Iterator[tuple[str, torch.Tensor]], version: int, persistent: bool, ranks: Ranks
) -> PublishStats | None:
    """One update from every rank to the engines on its device (see the module); `bus` is this rank's
    WeightBus (rank 0's knows the engines). Returns the stats on
    rank 0 (None on the others); raises BusError on every rank if an engine refused or rank 0 could not
    pause; the caller drains `it` afterwards."""
    main = ranks.rank == 0
    t, m = bus.transfer, bus.members
    if bus.client.is_closed:
        raise BusError("publish after close()")
    if bus.devices is None:
        bus.devices = ranks.all_gather(ipc.device_uuid(t.device))
    plan = None
    joined: list[str] = []
    dropped: list[str] = []
    if main:
        try:
            probe = t.probe_due()
            t.healthy = False
            joined, dropped = m.sync(probe=probe)
            per_rank, unreachable = assign(m.engines, bus.devices)
            for e in unreachable:
                log.warning("engine %s: its GPU (%s) is no trainer rank's; left out", e.url, e.device_uuid)
            dropped += m.drop([e.url for e in unreachable])
            dtype = m.wire_dtype()
            plan = {
                "dtype": dtype_name(dtype) if dtype is not None else None,
                "engines": [[(e.url, e.info) for e in es] for es in per_rank],
            }
        except Exception as e:  # every rank learns it, drains its gathers and raises
            plan = {"error": f"rank 0: {type(e).__name__}: {e}"}
    plan = ranks.broadcast(plan)
    if "error" in plan:
        for _ in it:
            pass
        raise BusError(plan["error"])
    local = _local(bus)
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

    go = None
    paused: list[Member] = []
    t_pause = time.perf_counter()
    if main:
        fold = first is not None and t.folds_pause(first)
        paused = [] if fold else list(m.engines)
        failed = t._on_all(paused, bus.client.pause_generation, t.pause_mode)
        if failed:
            for url, err in failed.items():
                log.warning("engine %s: pause failed: %s", url, err)
        go = {"fold": fold, "abort": t.abort_in_call, "failed": sorted(failed)}
    go = ranks.broadcast(go)
    local.abort_in_call = go["abort"]
    lost = set(go["failed"])
    if lost:
        _set_local(local, [(e.url, e.info) for e in local.members.engines if e.url not in lost])

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
    if not main:
        if errors:
            raise BusError("; ".join(errors))
        return None

    lost_anywhere = sorted(lost | {u for r in results for u in r["dropped"]})
    for url in lost_anywhere:
        if url in m.urls:
            log.warning("engine %s dropped from the weight update (per-rank handoff)", url)
    dropped += m.drop(lost_anywhere)
    for url in {e.url for e in paused} - set(m.urls) - m.parked:
        bus.pool.submit(bus.client.continue_generation, url)
    failed = t._on_all([] if go["fold"] else m.engines, bus.client.continue_generation)
    for url, err in failed.items():
        log.warning("engine %s: continue failed: %s", url, err)
    dropped += m.drop(list(failed))
    pause_s = time.perf_counter() - t_pause
    if errors:
        raise BusError("; ".join(errors))
    t.healthy = bool(m.engines) and not dropped
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
