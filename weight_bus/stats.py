"""What one weight update did (PublishStats: bytes, timings, who got it, where its time went) and the bus's
Prometheus metrics recorded from it."""

from __future__ import annotations

import msgspec

from weight_bus import metrics


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
    handoff: str = ""
    """Backend ipc: "direct" (the trainer's own tensors shared by handle, one call, no copy on the
    trainer) or "ring" (packed into the bus's bucket buffers); "" for a group backend."""
    paused: bool = True
    """Whether the engines got /pause_generation and /continue_generation (False: folded into the one
    update call, which the engine applies at a step boundary; pause_ms is then the update's time)."""
    probed: bool = True
    """Whether the engines in the group were probed before the update (False: known alive)."""
    ranks: int = 1
    """Trainer ranks that handed the weights over, each to the engines on its device (ipc, more than
    one rank: weight_bus.rank_handoff); bytes, buckets and timeline are rank 0's."""
    rebuilds: int = 0
    """Update groups built during this update (membership change or failure)."""
    adapter: str | None = None
    """An adapter-only update (a job with model.lora): the adapter's name on the engines; None = full
    weights."""
    stream: str = ""
    """A streamed update (weight_bus/stream.py: one call per engine): "arena" (byte ranges of the engines'
    weight arena, received in place) or "named" (flattened named buckets); "" for per-bucket calls."""
    engine_marks: list[float] = []
    """A streamed update: on the first engine, ms from the start of the transfer (one host's clock; other
    hosts' engines report none): its call taken up, step boundary held, first and last receive posted,
    every receive done, answered."""
    staged: bool = False
    """Streamed into the engines' staging arenas while they generated; pause_ms is the swap at the end."""
    path: str = "group"
    """How the tensors went: "group" (broadcast), "ipc" (handles), "files" (a PEFT directory the engines
    loaded: weight_bus/lora.py)."""
    phases_ms: dict[str, float] = {}
    """Where the update's wall time went, ms, in order: membership (probe, joiners, group rebuild), plan
    (the stream's plan), bucket0 (bucket 0 packed before the transfer; ~0 for an arena stream, whose
    announcement goes first and whose packing is in transfer), transfer, after (continue, promote)."""
    timeline: list[list[float]] = []
    """Per confirmed bucket: [index, launched, broadcast seen done, every engine seen answered], ms from
    the start of the transfer (seen: when Transfer.confirm polled it, so within POLL_S of the event once
    the bucket is at the head of the queue). Where the wire idles between buckets shows here."""

    @property
    def pause_s(self) -> float:
        return self.pause_ms / 1e3

    @property
    def kind(self) -> str:
        """ "adapter" for an adapter-only update, else "full"."""
        return "adapter" if self.adapter else "full"

    @property
    def transfer_s(self) -> float:
        return self.transfer_ms / 1e3


def wire_rate(stats: PublishStats) -> float | None:
    """Bytes per second between the first bucket's broadcast seen done and the last's: the buckets after
    the first (their bytes taken as equal shares of the update's), back to back on the wire. None with
    fewer than two buckets."""
    rows = stats.timeline
    if len(rows) < 2 or not stats.buckets:
        return None
    span_s = (rows[-1][2] - rows[0][2]) / 1e3
    if span_s <= 0:
        return None
    return stats.bytes * (len(rows) - 1) / len(rows) / span_s


def record_publish(stats: PublishStats, backend: str, sent: int, transfer_s: float, pause_s: float) -> None:
    """The bus metrics of one finished update (`sent`: bytes sent in all, over every rank)."""
    metrics.LAST_BYTES.labels(stats.kind).set(stats.bytes)
    if stats.adapter is not None:
        metrics.ADAPTER_UPDATES.labels(backend, stats.path).inc()
    metrics.BYTES.labels(backend).inc(sent)
    metrics.TRANSFER_SECONDS.labels(backend).observe(transfer_s)
    metrics.PAUSE_SECONDS.labels(backend).observe(pause_s)
    if transfer_s > 0 and stats.bytes:
        metrics.UPDATE_BANDWIDTH.labels(backend).set(stats.bytes / transfer_s)
    if (wire := wire_rate(stats)) is not None:
        metrics.WIRE_BANDWIDTH.labels(backend).set(wire)
    for phase, ms in stats.phases_ms.items():
        metrics.PHASE_SECONDS.labels(phase).observe(ms / 1e3)
    metrics.VERSION.set(stats.version)
    metrics.UPDATES.labels(backend).inc()
    metrics.ENGINES.set(len(stats.engines))
