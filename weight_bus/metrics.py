"""Prometheus metrics of the weight bus (trainer side)."""

from prometheus_client import Counter, Gauge, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Seconds: a GPU update of a small model takes milliseconds, a CPU one or a recovery tens of seconds."""
BACKEND = ["backend"]
"""The bus's transport (bus.backend: gloo, nccl, ipc)."""
BYTES = Counter(
    "slipstream_bus_bytes_total", "Weight bytes handed to engines (broadcast, or shared over IPC)", BACKEND
)
TRANSFER_SECONDS = Histogram(
    "slipstream_bus_transfer_seconds",
    "Time to move all buckets of one update (first announce to the last engine's confirmation)",
    BACKEND,
    buckets=_BUCKETS,
)
PAUSE_SECONDS = Histogram(
    "slipstream_bus_engine_pause_seconds",
    "Engine pause per update: from /pause_generation sent to /continue_generation answered",
    BACKEND,
    buckets=_BUCKETS,
)
VERSION = Gauge("slipstream_bus_published_version", "Last weight version every live engine acknowledged")
UPDATES = Counter("slipstream_bus_updates_total", "Weight updates published", BACKEND)
ENGINES = Gauge("slipstream_bus_engines", "Engines in the update group after the last update")
ENGINE_FAILURES = Counter(
    "slipstream_bus_engine_failures_total", "Engines dropped from the update group (dead, timed out)"
)
PROBE_RETRIES = Counter(
    "slipstream_bus_probe_retries_total",
    "Engine probes tried once more on a new connection after a transport error other than a timeout",
)
GROUP_REBUILDS = Counter(
    "slipstream_bus_group_rebuilds_total", "Update groups built (first connect, joins, failures)"
)
LAST_BYTES = Gauge(
    "slipstream_bus_last_update_bytes",
    "Bytes of the last update: kind full (every weight) or adapter (a LoRA job's adapter only)",
    ["kind"],
)
ADAPTER_UPDATES = Counter(
    "slipstream_bus_adapter_updates_total",
    "Adapter-only updates (a LoRA job) by transport and path: group (broadcast), ipc (handles), files "
    "(a PEFT directory the engines load)",
    ["backend", "path"],
)
UPDATE_BANDWIDTH = Gauge(
    "slipstream_bus_update_bytes_per_second",
    "Bytes per second of the last update: its bytes over its whole transfer (first call to the last "
    "engine's answer)",
    BACKEND,
)
WIRE_BANDWIDTH = Gauge(
    "slipstream_bus_wire_bytes_per_second",
    "Bytes per second of the last update while its buckets followed each other on the wire (the second "
    "bucket's broadcast done to the last's, over the bytes between): about the link's own rate when the "
    "bus keeps it busy; the gap to slipstream_bus_update_bytes_per_second is the update's cost off the wire",
    BACKEND,
)
PHASE_SECONDS = Histogram(
    "slipstream_bus_publish_phase_seconds",
    "Where each update's wall time went (PublishStats.phases_ms): membership (probe, joiners, group "
    "rebuild), plan, bucket0 (packed before the transfer), transfer, after (continue, promote)",
    ["phase"],
    buckets=_BUCKETS,
)
