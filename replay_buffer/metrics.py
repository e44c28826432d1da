"""Prometheus metrics of the replay buffer (process-local; each process exposes its own /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
GROUPS_PRODUCED = Counter("slipstream_buffer_groups_produced_total", "Groups written to the buffer")
GROUPS_CONSUMED = Counter("slipstream_buffer_groups_consumed_total", "Groups trained on and acknowledged")
GROUPS_DROPPED = Counter(
    "slipstream_buffer_groups_dropped_stale_total", "Groups dropped (or recycled) as too stale"
)
GROUPS_FUTURE = Counter(
    "slipstream_buffer_groups_dropped_future_total",
    "Groups dropped because a token came from a version newer than the trainer's (left by a run or attempt "
    "that got further than the checkpoint this one resumed from); never trained",
)
DEAD_LETTER = Counter("slipstream_buffer_dead_letter_total", "Records moved to the dead-letter stream")
DUPLICATES = Counter("slipstream_buffer_duplicates_total", "Redelivered groups skipped as already trained")
RECLAIMED = Counter("slipstream_buffer_reclaimed_total", "Pending entries claimed from idle (dead) consumers")
TRIMMED = Counter("slipstream_buffer_trimmed_total", "Acknowledged entries trimmed from the stream")
DEPTH = Gauge("slipstream_buffer_depth", "Entries in the job's stream (unread + pending + not yet trimmed)")
PENDING = Gauge("slipstream_buffer_pending", "Entries read by a trainer and not yet acknowledged")
REDIS_USED_MEMORY = Gauge(
    "slipstream_redis_used_memory_bytes", "Redis' used_memory (INFO memory), read by the trainer"
)
REDIS_MAXMEMORY = Gauge(
    "slipstream_redis_maxmemory_bytes",
    "Redis' memory limit (0: none); at it, writes fail and nothing is evicted",
)
REDIS_OOM = Counter(
    "slipstream_buffer_redis_oom_total",
    "Buffer writes Redis refused at its memory limit (maxmemory, noeviction)",
)
COMMIT_REPLAYS = Counter(
    "slipstream_buffer_commit_replays_total",
    "Trainer commits Redis received again after it had applied them (a retry after a lost reply, e.g. "
    "Redis stalled past the socket timeout); each was counted once",
)
OLDEST_AGE = Gauge(
    "slipstream_buffer_oldest_age_seconds",
    "Age of the oldest group still in the stream after trimming (waiting or being trained); 0 when empty",
)
PUT_SECONDS = Histogram(
    "slipstream_buffer_put_seconds", "Latency of one group put (encode + XADD)", buckets=_LATENCY
)
GET_SECONDS = Histogram(
    "slipstream_buffer_get_seconds",
    "Latency of one read round (XREADGROUP/XAUTOCLAIM + decode + checks)",
    buckets=_LATENCY,
)
STALENESS = Histogram(
    "slipstream_buffer_consumed_staleness_versions",
    "Staleness (policy versions) of consumed groups",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
RESPONSE_TOKENS = Histogram(
    "slipstream_buffer_response_tokens",
    "Response tokens per sample of the groups the trainer took: `trained`, or `stale` (dropped or recycled "
    "as too stale); a stale distribution longer than the trained one is a length bias",
    ["fate"],
    buckets=(4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
for _fate in ("trained", "stale"):
    RESPONSE_TOKENS.labels(_fate)  # both series exist from the start (a job without drops shows 0)
