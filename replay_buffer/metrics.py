"""Prometheus metrics of the replay buffer (process-local; each process exposes its own /metrics)."""

from prometheus_client import Counter, Histogram

GROUPS_PRODUCED = Counter("slipstream_buffer_groups_produced_total", "Groups written to the buffer")
GROUPS_CONSUMED = Counter("slipstream_buffer_groups_consumed_total", "Groups trained on and acknowledged")
GROUPS_DROPPED = Counter("slipstream_buffer_groups_dropped_stale_total", "Groups dropped as too stale")
DEAD_LETTER = Counter("slipstream_buffer_dead_letter_total", "Records moved to the dead-letter stream")
STALENESS = Histogram(
    "slipstream_buffer_consumed_staleness_versions",
    "Staleness (policy versions) of consumed groups",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
