"""Prometheus metrics of the weight bus (trainer side)."""

from prometheus_client import Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BYTES = Counter("slipstream_bus_bytes_total", "Weight bytes broadcast to engines")
TRANSFER_SECONDS = Histogram(
    "slipstream_bus_transfer_seconds", "Time to move all buckets of one update", buckets=_BUCKETS
)
PAUSE_SECONDS = Histogram(
    "slipstream_bus_engine_pause_seconds", "Engine pause (pause->continue) per update", buckets=_BUCKETS
)
VERSION = Gauge("slipstream_bus_published_version", "Last weight version every engine acknowledged")
