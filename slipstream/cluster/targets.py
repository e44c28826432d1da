"""Prometheus file_sd targets from the metrics addresses Slipstream's processes register in Redis.

Every actor serves its metrics on 127.0.0.1 and registers `replica -> host:port` in the hash
`slipstream:{job}:metrics_targets` (slipstream/job/actors.py). `write_file_sd` turns all jobs' hashes into one
file_sd file, `<out_dir>/slipstream.json`, which deploy/prometheus.yml watches; `TargetWriter` keeps it
current as pools scale. A job that has ended (its status `succeeded`, `failed`, `stopped` or `interrupted`)
is left out even while its hash remains: its processes are gone, and Prometheus would show them `down`. The file is replaced atomically and only when its content changes, so Prometheus
never reads half a file and is not woken for nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

import msgspec
import redis
from prometheus_client import Gauge

from replay_buffer.keys import METRICS_TARGETS_PATTERN, JobKeys, job_of_metrics_targets
from slipstream.job.records import decode_status
from slipstream.job.store import ENDED_STATES

log = logging.getLogger(__name__)

FILE_NAME = "slipstream.json"
"""deploy/prometheus.yml reads `targets/*.json`; this is the one file Slipstream writes there."""
SCAN_COUNT = 1000
"""Keys per SCAN round trip: a cluster holds a handful of jobs times ~15 keys each."""
DEFAULT_INTERVAL_S = 5.0
"""How often TargetWriter rewrites the file: deploy/prometheus.yml's scrape_interval."""

SCRAPE_TARGETS = Gauge("slipstream_control_scrape_targets", "Scrape targets in the last file_sd file written")

_INDEX_SUFFIX = re.compile(r"-(\d+)$")


def component_of(replica: str) -> str:
    """`trainer-0` -> `trainer`, `engine-12` -> `engine`; a name without a -N suffix is its own component."""
    return _INDEX_SUFFIX.sub("", replica)


def _sort_key(group: dict) -> tuple:
    labels = group["labels"]
    m = _INDEX_SUFFIX.search(labels["replica"])
    # engine-2 before engine-10: number order within a component, not string order.
    return labels["job"], labels["component"], int(m.group(1)) if m else -1, labels["replica"]


def _has_ended(status: bytes | str | None) -> bool:
    """Whether a job's status record says it ended. No record, or one that is not JSON, counts as running:
    a target is dropped only on the job's own word (`slipstream run` jobs have a record too)."""
    if status is None:
        return False
    try:
        return decode_status(status).state in ENDED_STATES
    except (ValueError, msgspec.MsgspecError):
        return False


def collect_targets(r: redis.Redis) -> list[dict]:
    """The file_sd target groups of every job in Redis that has not ended, one per replica, in a stable order.

    SCAN, not KEYS: the app's ACL user may not run KEYS (it is @dangerous), and SCAN does not block Redis."""
    keys = sorted(r.scan_iter(match=METRICS_TARGETS_PATTERN, count=SCAN_COUNT, _type="hash"))
    if not keys:
        return []
    keys = [key.decode() if isinstance(key, bytes) else key for key in keys]
    jobs = [job_of_metrics_targets(key) for key in keys]
    pipe = r.pipeline(transaction=False)
    for key, job in zip(keys, jobs, strict=True):
        pipe.hgetall(key)
        pipe.get(JobKeys(job).status)
    replies = pipe.execute()
    groups = []
    for job, entries, status in zip(jobs, replies[0::2], replies[1::2], strict=True):
        if _has_ended(status):
            continue
        for replica, address in entries.items():
            replica = replica.decode() if isinstance(replica, bytes) else replica
            address = address.decode() if isinstance(address, bytes) else address
            labels = {"job": job, "replica": replica, "component": component_of(replica)}
            groups.append({"targets": [address], "labels": labels})
    return sorted(groups, key=_sort_key)


def _write_if_changed(path: Path, content: str) -> bool:
    """Replace `path` with `content` atomically (temp file in the same directory + os.replace); leave it
    untouched when it already holds exactly that. Returns whether it was written."""
    try:
        if path.read_text() == content:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temp name must not match Prometheus' `*.json` glob, or it could read a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus may run as another user (or in a container)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def _publish(path: Path, groups: list[dict]) -> None:
    _write_if_changed(path, json.dumps(groups, indent=2) + "\n")
    SCRAPE_TARGETS.set(len(groups))


def write_file_sd(r: redis.Redis, out_dir: Path) -> int:
    """Write every job's metrics targets to `out_dir/slipstream.json` in Prometheus' file_sd format:
    `[{"targets": ["127.0.0.1:1234"], "labels": {"job": JOB, "replica": "engine-0", "component": "engine"}}]`.
    Returns the number of targets."""
    groups = collect_targets(r)
    _publish(Path(out_dir) / FILE_NAME, groups)
    return len(groups)


class TargetWriter:
    """Rewrites the file_sd file every `interval_s` on a background thread. A Redis or file error is logged
    and retried on the next tick; the file keeps its last good content meanwhile. Give it a client with a
    `socket_timeout`, so that `stop()` cannot wait on a hung connection."""

    def __init__(self, r: redis.Redis, out_dir: Path, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.r = r
        self.path = Path(out_dir) / FILE_NAME
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: set[tuple[str, str, str]] | None = None

    def tick(self) -> None:
        """One round: read Redis, write the file if it changed, log what changed in the target set."""
        groups = collect_targets(self.r)
        _publish(self.path, groups)
        now = {(g["labels"]["job"], g["labels"]["replica"], g["targets"][0]) for g in groups}
        if now != self._last:
            added, removed = sorted(now - (self._last or set())), sorted((self._last or set()) - now)
            log.info(
                "scrape targets: %d in %s (added %s, removed %s)",
                len(now),
                self.path,
                ", ".join(f"{j}/{rep}={a}" for j, rep, a in added) or "none",
                ", ".join(f"{j}/{rep}={a}" for j, rep, a in removed) or "none",
            )
            self._last = now

    def _run(self) -> None:
        while True:
            try:
                self.tick()
            except (redis.RedisError, OSError) as e:
                log.warning("scrape targets not updated (retrying in %g s): %s", self.interval_s, e)
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> TargetWriter:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="slipstream-targets", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> TargetWriter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
