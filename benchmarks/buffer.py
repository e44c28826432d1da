"""Replay-buffer benchmark: our put/get against raw redis-py on the same bytes, side by side in one run.

What is compared, each phase on a fresh job namespace of one private redis-server (the project's
deploy/redis.conf: AOF on, appendfsync everysec), for the full record count after an unmeasured warm-up:

- ours put: `BufferProducer.put` from `--concurrency` coroutines sharing one redis.asyncio client, as
  rollout workers do. Includes msgpack encode of the GroupRecord, the MULTI/EXEC with the XADD and
  whatever bookkeeping `put` does, and one round trip per record.
- raw put: sync redis-py, `--batch` XADDs of the pre-encoded bytes per non-transactional pipeline.
  No encode, no bookkeeping: the fastest way redis-py can append these bytes to a stream.
- ours get: `ReplayBuffer.take_batch(n=--batch)` then `commit` (what the trainer does per step).
  Includes every round trip those make (reads incl. the reclaim check, the trained-id lookup, the
  commit's MULTI, the trim), msgpack decode + validation and the duplicate/staleness checks.
- raw get: sync redis-py, one non-transactional pipeline per batch holding the XACK of the previous
  batch and the XREADGROUP of the next: the same ack-after-use order as ours, one round trip per batch,
  no decode.

Why it is fair: both sides send the identical msgpack bytes under the same field name to the same kind
of stream through the same client library, ACL user and server, so the ratios isolate what our code
adds (encode/decode, validation, bookkeeping, round trips). Test data is built and encoded before any
timing; only ours put encodes inside the clock, because a rollout worker has to. Encode, decode and
validate are also timed alone per record, so a gap can be attributed.

The records go through in rounds; within a round ours and raw alternate, first one then the other
(ABBA), so load that drifts on a small shared box falls on both alike. Rounds are sized to stay under
Redis's automatic AOF-rewrite threshold, and between rounds the streams are emptied and the AOF
compacted, untimed: a rewrite is server work on bytes both sides write alike, and left to chance it
lands on whichever side crosses the threshold. Production pays for rewrites too, so latency tails here
are a lower bound; forks seen inside timed work are reported per side (expected 0).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from time import perf_counter

import msgspec
import numpy as np
import redis
import redis.asyncio as aioredis

from replay_buffer import BufferProducer, GroupRecord, JobKeys, ReplayBuffer, Sample, decode, encode
from replay_buffer.keys import TRAINER_GROUP, jobs_pattern
from replay_buffer.redis_server import ManagedRedis
from replay_buffer.schema import validate

MAX_TOKEN_ID = 150_000
"""Token ids are drawn below this: a Qwen-sized vocabulary, so most ids take 5 msgpack bytes."""
SAMPLE_POOL = 16
"""Distinct sample lists built; records cycle through them (unique group_id each) to bound memory."""
NO_STALENESS_LIMIT = 1 << 30
"""max_staleness for ours get: every record is usable, so nothing is dropped and both sides read all."""
PHASE_TIMEOUT_S = 600.0
"""Give up on a side (or on waiting out an AOF rewrite) after this long rather than hang."""
AOF_ROUND_FRACTION = 0.75
"""Share of auto-aof-rewrite-min-size one round may write (both sides together); see plan_rounds."""
LONE_PUT_RECORDS = 200
"""Sequential puts timed for the unloaded put latency (put_p50_ms / put_p99_ms)."""


class BenchConfig(msgspec.Struct, forbid_unknown_fields=True):
    records: int = 2000
    """GroupRecords written and read by each measured phase."""
    samples: int = 8
    """Samples per group (GRPO group size)."""
    tokens: int = 1024
    """Response tokens per sample."""
    prompt_tokens: int = 128
    concurrency: int = 16
    """Coroutines calling BufferProducer.put on one asyncio client."""
    batch: int = 16
    """Records per take_batch (ours get) and per pipeline (raw put, raw get)."""
    warmup: int = 200
    """Records through every path before measuring (capped at `records`)."""
    rounds: int = 4
    """Fewest rounds the records are split into (more when needed to keep AOF rewrites out of rounds);
    ours and raw alternate within each round, in ABBA order."""
    seed: int = 0


class Phase(msgspec.Struct):
    """What one side did, summed over rounds: records, wall seconds, one latency per operation."""

    records: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = []
    take_s: list[float] = []
    """Ours get only: the take_batch part of each batch's latency."""
    commit_s: list[float] = []
    forks: int = 0
    """Redis forks (AOF rewrites) that started while this side ran."""

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    def add(self, other: Phase) -> None:
        self.records += other.records
        self.seconds += other.seconds
        self.forks += other.forks
        self.latencies_s += other.latencies_s
        self.take_s += other.take_s
        self.commit_s += other.commit_s


class Progress:
    """Prints every quarter of a phase to stderr, so a long run shows it is alive."""

    def __init__(self, label: str, total: int, quiet: bool) -> None:
        self.label, self.total, self.quiet = label, total, quiet
        self.done, self.next_mark = 0, total / 4

    def tick(self, n: int = 1) -> None:
        self.done += n
        if not self.quiet and self.done >= self.next_mark:
            print(f"  {self.label}: {self.done}/{self.total}", file=sys.stderr, flush=True)
            self.next_mark += self.total / 4


# --- test data ------------------------------------------------------------------------------------


def _sample(rng: np.random.Generator, cfg: BenchConfig) -> Sample:
    """A tool-using rollout: the middle eighth of the response is a tool result (loss_mask 0)."""
    n = cfg.tokens
    mask = np.ones(n, dtype=np.int64)
    mask[n // 2 : n // 2 + n // 8] = 0
    logprobs = np.where(mask == 1, -rng.exponential(0.5, n), 0.0)
    return Sample.build(
        prompt_ids=rng.integers(0, MAX_TOKEN_ID, cfg.prompt_tokens).tolist(),
        response_ids=rng.integers(0, MAX_TOKEN_ID, n).tolist(),
        loss_mask=mask.tolist(),
        behavior_logprobs=logprobs.tolist(),
        token_versions=np.where(mask == 1, 0, -1).tolist(),
        reward=float(rng.random()),
        finish_reason="stop",
    )


def build_records(cfg: BenchConfig) -> list[GroupRecord]:
    rng = np.random.default_rng(cfg.seed)
    pool = [[_sample(rng, cfg) for _ in range(cfg.samples)] for _ in range(min(SAMPLE_POOL, cfg.records))]
    now = time.time()
    return [
        GroupRecord(
            group_id=f"bench-{i:08d}",
            job_id="bench",
            prompt_id=f"p{i}",
            samples=pool[i % len(pool)],
            min_version=0,
            max_version=0,
            created_at=now,
        )
        for i in range(cfg.records)
    ]


# --- the four sides: each times one chunk of records ----------------------------------------------


def _producer(client: aioredis.Redis, job: str) -> BufferProducer:
    return BufferProducer(client, job, worker_id="bench-worker")


async def put_ours(
    producer: BufferProducer, groups: list[GroupRecord], concurrency: int, progress: Progress
) -> Phase:
    latencies: list[float] = []
    todo = iter(groups)  # shared: each coroutine takes the next record when its put returns

    async def worker() -> None:
        for group in todo:
            t0 = perf_counter()
            await producer.put(group)
            latencies.append(perf_counter() - t0)
            progress.tick()

    t0 = perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Phase(len(groups), perf_counter() - t0, latencies)


def put_raw(client: redis.Redis, key: str, payloads: list[bytes], batch: int, progress: Progress) -> Phase:
    latencies: list[float] = []
    t_start = perf_counter()
    for i in range(0, len(payloads), batch):
        chunk = payloads[i : i + batch]
        t0 = perf_counter()
        pipe = client.pipeline(transaction=False)
        for data in chunk:
            pipe.xadd(key, {"d": data})
        pipe.execute()
        # Every record in the pipeline waits for the whole call: that is its latency.
        latencies.extend([perf_counter() - t0] * len(chunk))
        progress.tick(len(chunk))
    return Phase(len(payloads), perf_counter() - t_start, latencies)


def get_ours(buf: ReplayBuffer, n_records: int, batch: int, progress: Progress) -> Phase:
    deadline = perf_counter() + PHASE_TIMEOUT_S
    take_s: list[float] = []
    commit_s: list[float] = []
    done = 0
    t_start = perf_counter()
    while done < n_records:
        want = min(batch, n_records - done)
        t0 = perf_counter()
        entries = buf.take_batch(
            want, version=0, max_staleness=NO_STALENESS_LIMIT, should_stop=lambda: perf_counter() > deadline
        )
        t1 = perf_counter()
        buf.commit(entries, 0)
        t2 = perf_counter()
        if len(entries) != want:
            raise RuntimeError(
                f"take_batch returned {len(entries)} of {want} records: stream short or timed out"
            )
        take_s.append(t1 - t0)
        commit_s.append(t2 - t1)
        done += want
        progress.tick(want)
    seconds = perf_counter() - t_start
    per_batch = [t + c for t, c in zip(take_s, commit_s, strict=True)]
    return Phase(n_records, seconds, per_batch, take_s, commit_s)


def get_raw(client: redis.Redis, key: str, n_records: int, batch: int, progress: Progress) -> Phase:
    latencies: list[float] = []
    to_ack: list[bytes] = []
    done = 0
    t_start = perf_counter()
    while done < n_records:
        t0 = perf_counter()
        pipe = client.pipeline(transaction=False)
        if to_ack:
            pipe.xack(key, TRAINER_GROUP, *to_ack)
        pipe.xreadgroup(TRAINER_GROUP, "raw", {key: ">"}, count=min(batch, n_records - done))
        resp = pipe.execute()[-1]
        latencies.append(perf_counter() - t0)
        entries = resp[0][1] if resp else []
        if not entries:
            raise RuntimeError(f"raw XREADGROUP found nothing after {done} of {n_records} records")
        to_ack = [entry_id for entry_id, _ in entries]
        done += len(entries)
        progress.tick(len(entries))
    client.xack(key, TRAINER_GROUP, *to_ack)
    return Phase(n_records, perf_counter() - t_start, latencies)


# --- orchestration --------------------------------------------------------------------------------


def _forks(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_forks"])


def _wait_rewrite(admin: redis.Redis) -> None:
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while time.monotonic() < deadline:
        info = admin.info("persistence")
        if not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]):
            return
        time.sleep(0.02)


def compact_aof(admin: redis.Redis) -> None:
    """BGREWRITEAOF and wait for it: with the streams emptied first this is quick, and the AOF starts
    the next round near empty."""
    _wait_rewrite(admin)
    admin.bgrewriteaof()
    _wait_rewrite(admin)


def plan_rounds(admin: redis.Redis, n: int, record_bytes: float, min_rounds: int) -> list[slice]:
    """Split the records into rounds small enough that one round of both sides' writes stays under the
    size at which Redis starts an automatic AOF rewrite. A rewrite is server work on bytes both sides
    write alike; left to chance it lands on whichever side crosses the threshold and swamps the ratio."""
    conf = admin.config_get("auto-aof-rewrite-*")
    if int(conf["auto-aof-rewrite-percentage"]) == 0:
        per_round = n
    else:
        budget = AOF_ROUND_FRACTION * int(conf["auto-aof-rewrite-min-size"])
        per_round = max(1, int(budget // (2 * record_bytes)))
    rounds = max(min_rounds, -(-n // per_round))
    step = -(-n // rounds)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def timed(admin: redis.Redis, side: Callable[[slice], Phase], part: slice) -> Phase:
    _wait_rewrite(admin)
    forks0 = _forks(admin)
    phase = side(part)
    phase.forks = _forks(admin) - forks0
    return phase


def _per_record_ms(fn: Callable, items: list) -> float:
    t0 = perf_counter()
    for x in items:
        fn(x)
    return (perf_counter() - t0) / len(items) * 1e3


def _pct_ms(latencies_s: list[float], q: float) -> float:
    return float(np.percentile(latencies_s, q)) * 1e3


def run(url: str, admin_url: str, cfg: BenchConfig, run_id: str, quiet: bool = False) -> dict:
    """All phases against the redis at `url` (the app's ACL user, as in production); `admin_url` is only
    for INFO/BGREWRITEAOF between rounds. Returns {"config", "metrics", "ratios"}."""
    load_start = os.getloadavg()[0]
    groups = build_records(cfg)
    payloads = [encode(g) for g in groups]
    record_bytes = sum(map(len, payloads)) / len(payloads)
    n, warm = cfg.records, min(cfg.warmup, cfg.records)
    client = redis.Redis.from_url(url)
    admin = redis.Redis.from_url(admin_url)
    aclient = aioredis.Redis.from_url(url)

    def ns(name: str) -> str:
        return f"bench-{run_id}-{name}"

    def reader(name: str) -> ReplayBuffer:
        buf = ReplayBuffer(client, ns(name), consumer="bench-trainer")
        buf.ensure_group()  # raw get reads through the same consumer group, created the same way
        return buf

    silent = Progress("warm-up", warm, quiet=True)
    with asyncio.Runner() as loop:
        # Warm-up: connections opened, code paths and server allocations hot; nothing kept.
        if warm:
            loop.run(put_ours(_producer(aclient, ns("warm-ours")), groups[:warm], cfg.concurrency, silent))
            put_raw(client, JobKeys(ns("warm-raw")).groups, payloads[:warm], cfg.batch, silent)
            get_ours(reader("warm-ours"), warm, cfg.batch, silent)
            get_raw(client, reader("warm-raw").keys.groups, warm, cfg.batch, silent)
            for key in client.scan_iter(match=jobs_pattern(ns("warm-"))):
                client.delete(key)

        producer, ours_buf = _producer(aclient, ns("ours")), reader("ours")
        raw_key = reader("raw").keys.groups
        prog = {label: Progress(label, n, quiet) for label in ("ours put", "raw put", "ours get", "raw get")}
        put_sides = {
            "ours put": lambda c: loop.run(put_ours(producer, groups[c], cfg.concurrency, prog["ours put"])),
            "raw put": lambda c: put_raw(client, raw_key, payloads[c], cfg.batch, prog["raw put"]),
        }
        get_sides = {
            "ours get": lambda c: get_ours(ours_buf, c.stop - c.start, cfg.batch, prog["ours get"]),
            "raw get": lambda c: get_raw(client, raw_key, c.stop - c.start, cfg.batch, prog["raw get"]),
        }
        totals = {label: Phase() for label in prog}
        parts = plan_rounds(admin, n, record_bytes, cfg.rounds)
        for i, part in enumerate(parts):
            compact_aof(admin)
            # ABBA: which side goes first alternates, so drifting background load hits both alike.
            for sides in (put_sides, get_sides):
                for label in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                    totals[label].add(timed(admin, sides[label], part))
            # Untimed: ours' commit trims its stream; empty the raw one too, so compaction stays cheap.
            client.xtrim(raw_key, maxlen=0, approximate=False)

        # Unloaded put latency: one put in flight, so the number is service time, not queueing behind
        # the other coroutines (at concurrency c the loaded p50 is roughly c / throughput).
        lone_producer = _producer(aclient, ns("lone"))
        lone = slice(0, min(LONE_PUT_RECORDS, n))
        p_lone = timed(admin, lambda c: loop.run(put_ours(lone_producer, groups[c], 1, silent)), lone)
        loop.run(aclient.aclose())
    p_ours, p_raw, g_ours, g_raw = (totals[k] for k in ("ours put", "raw put", "ours get", "raw get"))
    if not quiet:
        for label, phase in totals.items():
            print(f"  {label}: {phase.records_per_s:,.0f} records/s", file=sys.stderr, flush=True)

    # Attribution: the part of our cost that is msgpack work outside Redis.
    sample_n = min(200, n)
    encode_ms = _per_record_ms(encode, groups[:sample_n])
    decode_ms = _per_record_ms(msgspec.msgpack.Decoder(GroupRecord).decode, payloads[:sample_n])
    validate_ms = _per_record_ms(validate, [decode(p) for p in payloads[:sample_n]])
    for key in client.scan_iter(match=jobs_pattern(ns(""))):
        client.delete(key)
    client.close()
    admin.close()

    def mb_per_s(phase: Phase) -> float:
        return phase.records_per_s * record_bytes / 1e6

    metrics = {
        "record_bytes": round(record_bytes),
        "host_load_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "put_records_per_s": p_ours.records_per_s,
        "raw_put_records_per_s": p_raw.records_per_s,
        "get_records_per_s": g_ours.records_per_s,
        "raw_get_records_per_s": g_raw.records_per_s,
        "put_mb_per_s": mb_per_s(p_ours),
        "raw_put_mb_per_s": mb_per_s(p_raw),
        "get_mb_per_s": mb_per_s(g_ours),
        "raw_get_mb_per_s": mb_per_s(g_raw),
        # Headline put latency = one put with nothing else queued (what a rollout worker waits when it
        # hands over a finished group). Under `concurrency` puts in flight on this 2-core box latency is
        # queueing (~ concurrency / throughput, Little's law): reported as put_loaded_*.
        "put_p50_ms": _pct_ms(p_lone.latencies_s, 50),
        "put_p99_ms": _pct_ms(p_lone.latencies_s, 99),
        "put_loaded_p50_ms": _pct_ms(p_ours.latencies_s, 50),
        "put_loaded_p99_ms": _pct_ms(p_ours.latencies_s, 99),
        "raw_put_p50_ms": _pct_ms(p_raw.latencies_s, 50),
        "raw_put_p99_ms": _pct_ms(p_raw.latencies_s, 99),
        "get_p50_ms": _pct_ms(g_ours.latencies_s, 50),
        "get_p99_ms": _pct_ms(g_ours.latencies_s, 99),
        "take_p50_ms": _pct_ms(g_ours.take_s, 50),
        "take_p99_ms": _pct_ms(g_ours.take_s, 99),
        "commit_p50_ms": _pct_ms(g_ours.commit_s, 50),
        "commit_p99_ms": _pct_ms(g_ours.commit_s, 99),
        "raw_get_p50_ms": _pct_ms(g_raw.latencies_s, 50),
        "raw_get_p99_ms": _pct_ms(g_raw.latencies_s, 99),
        "encode_ms_per_record": encode_ms,
        "decode_ms_per_record": decode_ms,
        "validate_ms_per_record": validate_ms,
        "forks": {
            "put": p_ours.forks,
            "raw_put": p_raw.forks,
            "get": g_ours.forks,
            "raw_get": g_raw.forks,
        },
    }
    ratios = {
        "put_vs_raw": p_ours.records_per_s / p_raw.records_per_s,
        "get_vs_raw": g_ours.records_per_s / g_raw.records_per_s,
    }
    config = msgspec.structs.asdict(cfg) | {
        "rounds_run": len(parts),
        "round_records": parts[0].stop - parts[0].start,
        "redis": "managed redis-server (deploy/redis.conf: appendonly yes, appendfsync everysec), "
        "app ACL user; AOF compacted between rounds, untimed",
        "sides": {
            "ours put": "BufferProducer.put per record from `concurrency` coroutines on one asyncio "
            "client: encode + MULTI(XADD + bookkeeping); latency = one put",
            "raw put": "pre-encoded bytes, `batch` XADDs per non-transactional pipeline; "
            "latency = the pipeline call each record rode in",
            "ours get": "take_batch(batch) + commit per batch: reads, decode + validate, duplicate "
            "check, MULTI(trained, XACK, counters), trim; latency = one batch (take_/commit_ split)",
            "raw get": "one pipeline per batch: XACK previous batch + XREADGROUP next, no decode; "
            "latency = one pipeline",
        },
    }
    return {"config": config, "metrics": metrics, "ratios": ratios}


def report(result: dict, device: str) -> str:
    """Headline lines (the names in benchmarks/README.md) and a table; sub-rows have latencies only."""
    m, r = result["metrics"], result["ratios"]
    rows = [  # (label, metric prefix, what one latency sample is)
        ("ours put", "put", "one put, one in flight (records/s: --concurrency in flight)"),
        ("  loaded", "put_loaded", "one put, --concurrency in flight (queueing)"),
        ("raw put", "raw_put", "the pipeline the record rode in"),
        ("ours get", "get", "take_batch + commit"),
        ("  take_batch", "take", "take_batch"),
        ("  commit", "commit", "commit (incl. trim)"),
        ("raw get", "raw_get", "one XACK+XREADGROUP pipeline"),
    ]

    def num(key: str, fmt: str) -> str:
        return format(m[key], fmt) if key in m else ""

    lines = [
        f"buffer put_vs_raw={r['put_vs_raw']:.2f} get_vs_raw={r['get_vs_raw']:.2f} "
        f"put_p99_ms={m['put_p99_ms']:.1f} (device={device})",
        f"buffer get_p99_ms={m['get_p99_ms']:.1f} put_p50_ms={m['put_p50_ms']:.1f} "
        f"get_p50_ms={m['get_p50_ms']:.1f} put_loaded_p99_ms={m['put_loaded_p99_ms']:.1f} "
        f"record_bytes={m['record_bytes']} (device={device})",
        "",
        f"{'side':<13}{'records/s':>11}{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}  latency of",
    ]
    for label, k, what in rows:
        lines.append(
            f"{label:<13}{num(f'{k}_records_per_s', ',.0f'):>11}{num(f'{k}_mb_per_s', '.0f'):>9}"
            f"{num(f'{k}_p50_ms', '.2f'):>9}{num(f'{k}_p99_ms', '.2f'):>9}  {what}"
        )
    lines.append(
        f"outside Redis, per record: encode {m['encode_ms_per_record']:.3f} ms, decode "
        f"{m['decode_ms_per_record']:.3f} ms, validate {m['validate_ms_per_record']:.3f} ms; "
        f"forks per side {m['forks']}; host load (1 min) at start/end {m['host_load_1m']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    for field in BenchConfig.__struct_fields__:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    p.add_argument("--device", default="cpu", help="device kind named in the result file")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    cfg = BenchConfig(**{f: getattr(args, f) for f in BenchConfig.__struct_fields__})

    today = datetime.date.today()
    with ManagedRedis() as server:
        result = run(server.url, server.admin_url, cfg, run_id=f"{time.time_ns():x}", quiet=args.quiet)
    result = {
        "benchmark": "buffer",
        "device": args.device,
        "date": today.isoformat(),
        "command": shlex.join(["python", "benchmarks/buffer.py", *argv]),
        **result,
    }
    print(report(result, args.device))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"buffer-{args.device}-{today:%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
