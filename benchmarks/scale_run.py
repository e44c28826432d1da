"""Scale run: ONE job whose generator and trainer pools are scaled independently while it trains,
measured at each size, plus async vs sync at the final size.

The scenario, in one invocation:
1. stage "1+1": the job starts with 1 engine + 1 trainer rank (slipstream/job/faults.py `LocalJob`: the cluster's
   JobDriver in a thread, over a private Redis and a local Ray). `--warmup` steps, then `--steps` timed steps.
2. generators 1 -> 2 as `slipstream scale JOB --generators 2` does it: the desired count goes to the JobStore
   (`store.set_desired(job, generators=2)`); the driver starts an engine that waits in the registry's joining
   set until the weight bus gives it the current weights at the next update, then takes rollout traffic.
   The script waits until the new engine is live in the registry AND has finished requests (its own
   sglang:num_requests counter), then measures stage "2+1" from the next step on.
3. trainers 1 -> 2 (`set_desired(job, trainers=2)`): the driver stops the pool after its step with a
   checkpoint and starts 2 ranks from it (FSDP2 reshards; gloo on CPU, NCCL on cuda). Stage "2+2" starts
   at the first step of the new pool (its progress records carry a new `pool_id`).
4. async vs sync at 2+2: two more jobs that START at 2 engines + 2 trainers, the same steps, only
   buffer.max_staleness differs (0 = synchronous on-policy, `--max-staleness`, default 2).

Per stage (all from the trainer's progress records and probes taken by this process, none from what was
requested):
- samples/s, tokens/s, trainer step/wait/publish fractions: `benchmarks.async_vs_sync.rates` over the stage's
  records (trainer clock: elapsed_s; the window starts at the last warm-up step's record);
- publish_s per step (the weight bus's transfer time to every engine; pause_s likewise): mean and median;
- staleness histogram of the stage: the buffer's histogram of consumed groups (`buffer.stats()["staleness"]`)
  read (with the buffer's step counter, in one transaction) when the window's first record arrives minus
  when its last one arrives; `staleness_histogram_exact` says no later step's commit was in either read
  (else `staleness_histogram_steps` is still the count of steps it covers, shifted by one);
- observed sizes: engines live in the registry, engines that finished requests in the window and since they
  started (their sglang:num_requests counters), the driver's reported pools (`slipstream status`), trainer ranks (the driver's
  actors, and the "trainer ready: ..., N ranks" lines of trainer-0's log);
- scale operation time: request (set_desired) -> the first trainer step at the new size (generators: the
  first step recorded after the new engine took traffic; also request -> engine live, -> first finished
  request); trainers: request -> the first step of the new pool.

Phases (`--phase`), each one command that fits one device call, appending to one result file
(`--label L --append`; a timeout keeps what the earlier phases measured):
- all (default): the scenario above, at most `--engines` E engines (default 2): 1+1 -> ... -> E+1 -> E+2;
- generators: one job 1+1 -> 2+1 -> ... -> E+1 (cuda default E = 3: peak 3 engines + 1 rank on 4 GPUs);
- trainers: one job that starts at 2+1 (measured) and is scaled to 2+2;
- ab: step 4 alone.
On 4 GPUs: `--phase generators`, then `--phase trainers --append`, then `--phase ab --append`.

Weight bus to 2 engines vs a raw broadcast: this run records the bus's per-step publish_s at 1 and at 2
engines inside the job (ratios.publish_s_2_vs_1_engines). The bus-vs-raw-broadcast number for 2 engines
comes from the weight-bus benchmark, which runs the raw broadcast side by side:
    python benchmarks/weight_bus.py --engines 2 --engine-gpus 1,2 --models qwen2.5-1.5b-shape \\
        --device-kind nvidia-h200-x4 --label 2engines

Devices:
- cpu (default): the demo's tiny-arith model (`benchmarks.async_vs_sync.build_tiny_arith`), built-in engines as
  Ray actors, gloo bus, trainer ranks on CPU with 1 torch thread each. Every process shares the box's cores
  (2 on the dev box), so more engines or ranks cannot run faster there: the CPU run checks the mechanics of
  scaling a running job and how the stages compare under shared cores, not the speed-up.
- cuda (needs 4 GPUs: nvidia-h200-x4): Qwen2.5-1.5B shape with random bf16 weights and the tiny-tools ChatML
  tokenizer (`build_cuda_model`), multi-turn tool rollouts (word problems + calculator, as async_vs_sync's
  cuda spec), built-in engine actors with `generators.gpus_per_engine: 1` (Ray gives each engine its own GPU;
  EngineActor then runs on cuda in bf16), trainer.device cuda (Ray gives each rank a GPU), NCCL trainer
  group and weight bus. Peak use is 4 GPUs (2 engines + 2 ranks); the 1 -> 2 trainer step frees the old
  rank's GPU before the new pool starts. One command:
    python benchmarks/scale_run.py --device cuda --device-kind nvidia-h200-x4

Run:
    python benchmarks/scale_run.py                 # CPU, ~10-15 min on 2 cores
    python benchmarks/scale_run.py --quick         # CPU smoke (the test)
Result: benchmarks/results/scale_run-<device-kind>-<YYYYMMDD>.json (the format in benchmarks/README.md) and a table.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FOREVER_STEPS = 10_000_000
"""total_steps of the scaled job: never reached; the script stops it when the last stage is measured."""
STAGES = ("1+1", "2+1", "2+2")
"""The stages of `--phase all` at the default --engines 2."""

DEFAULTS = {"steps": 250, "warmup": 10, "groups_per_step": 16, "model_warmup_steps": 100}
QUICK = {"steps": 2, "warmup": 1, "groups_per_step": 2, "model_warmup_steps": 0}
CUDA_DEFAULTS = {"groups_per_step": 32, "model_warmup_steps": 0}
CPU_NOTE = (
    "CPU run: every engine, rollout worker and trainer rank shares the host's cores, so scaling cannot "
    "speed the job up here; it checks the mechanics (scale while running, new engine joins through the "
    "bus and takes traffic, trainer pool reshards from a checkpoint, versions carry on) and reports what "
    "the stages measure under shared cores."
)


def log(msg: str) -> None:
    print(f"[scale-run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- specs ----------------------------------------------------------------------------------------------


def job_raw(args: argparse.Namespace, model: Path, engines: int, trainers: int) -> dict[str, Any]:
    """async_vs_sync's job (base_spec) at `engines` built-in engines (one rollout worker each) and `trainers`
    ranks. cuda: built-in engine actors with a GPU each instead of async_vs_sync's external engine."""
    from benchmarks.async_vs_sync import base_spec

    raw = base_spec(args, model)
    g = {"engine": "builtin", "num_engines": engines, "num_workers": engines}
    if args.device == "cuda":
        g |= {"gpus_per_engine": 1, "max_batch_size": args.engine_max_batch}
    raw["generators"] = g
    raw["bus"] = {**raw["bus"], "backend": "gloo" if args.device == "cpu" else args.bus_backend}
    raw["trainer"] = {**raw["trainer"], "num_trainers": trainers}
    return raw


def colocated_raw(args: argparse.Namespace, model: Path, ranks: int) -> dict[str, Any]:
    """async_vs_sync's colocated job (base_spec, `placement: colocated`) at `ranks` trainer ranks, each
    with its own engine on its device (verl's hybrid engine: one GPU holds a rank and an engine)."""
    from benchmarks.async_vs_sync import base_spec

    raw = base_spec(argparse.Namespace(**{**vars(args), "placement": "colocated"}), model)
    raw["generators"] |= {"num_engines": ranks, "num_workers": ranks}
    raw["trainer"] = {**raw["trainer"], "num_trainers": ranks}
    return raw


def job_spec(
    args,
    model: Path,
    name: str,
    out: Path,
    engines: int,
    trainers: int,
    max_staleness: int,
    steps: int,
    colocated: bool = False,
):
    """The job at `engines` + `trainers` (disaggregated), or `colocated` at `trainers` ranks and engines."""
    from benchmarks.async_vs_sync import make_spec

    raw = colocated_raw(args, model, trainers) if colocated else job_raw(args, model, engines, trainers)
    return make_spec(raw, name=name, out=out, max_staleness=max_staleness, total_steps=steps)


# --- watching a job -------------------------------------------------------------------------------------


class Progress:
    """Follows the job's trainer progress stream from this process (the driver reads its own copy). Each
    record gains `arrival` (monotonic time it was read) and `pool` (trainer pool index: a new pool writes
    a new `pool_id`; elapsed_s is the run's clock and goes on across pools)."""

    def __init__(self, job, timeout_s: float) -> None:
        from replay_buffer.client import connect
        from slipstream.job.progress import ProgressReader

        self.job, self.timeout_s = job, timeout_s
        self.r = connect(job.redis.url)
        self.reader = ProgressReader(self.r, job.spec.name)
        self.pending: collections.deque[dict] = collections.deque()
        self.all: list[dict] = []
        self.pool = 0
        self._last_pool_id: str | None = None

    def poll(self, block_ms: int = 200) -> None:
        for rec in self.reader.read(block_ms=block_ms):
            if self._last_pool_id is not None and rec["pool_id"] != self._last_pool_id:
                self.pool += 1
            self._last_pool_id = rec["pool_id"]
            rec["arrival"], rec["pool"] = time.monotonic(), self.pool
            self.pending.append(rec)
            self.all.append(rec)

    def _check(self, what: str, deadline: float) -> None:
        from slipstream.job.faults import JobFailed

        job = self.job
        if job.error is not None:
            raise JobFailed(f"job failed while waiting for {what}: {job.error!r}") from job.error
        if job.result is not None and not self.pending:
            raise JobFailed(f"job ended while waiting for {what}: {job.result}")
        if time.monotonic() > deadline:
            raise JobFailed(f"timed out ({self.timeout_s:.0f} s) waiting for {what}")

    def next(self, what: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while not self.pending:
            self.poll()
            if not self.pending:  # a job that ended has written its last records before: poll first
                self._check(what, deadline)
        return self.pending.popleft()

    def until(self, what: str, cond) -> list[dict]:
        """Consume records (returned: the transition) until cond() holds."""
        deadline = time.monotonic() + self.timeout_s
        passed: list[dict] = []
        while not cond():
            self._check(what, deadline)
            self.poll()
            while self.pending:
                passed.append(self.pending.popleft())
        return passed

    def lag(self) -> int:
        """Records already in the stream that this process has not handed out yet."""
        self.poll(block_ms=0)
        return len(self.pending)

    def close(self) -> None:
        self.r.close()


class Probe:
    """What the job looks like now, observed: buffer staleness histogram, registry, per-engine counters
    (each engine actor's /metrics, found through the job's metrics_targets hash), driver status."""

    def __init__(self, job) -> None:
        import httpx

        from weight_bus.registry import EngineRegistry

        self.job = job
        self.registry = EngineRegistry(job.r, job.spec.name)
        self.http = httpx.Client(timeout=5.0)

    def engine_counters(self) -> dict[str, dict[str, float]]:
        """engine name -> {requests, generation_tokens, weight_version}; engines that do not answer are left out."""
        from prometheus_client.parser import text_string_to_metric_families

        from replay_buffer.keys import JobKeys

        out: dict[str, dict[str, float]] = {}
        targets = self.job.r.hgetall(JobKeys(self.job.spec.name).metrics_targets)
        for name, addr in sorted(targets.items()):
            name = name.decode()
            if not name.startswith("engine-"):
                continue
            try:
                text = self.http.get(f"http://{addr.decode()}/metrics").text
            except Exception:  # noqa: BLE001 - an engine that is gone
                continue
            vals: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    vals[s.name] = s.value
            if "sglang:num_requests_total" in vals:
                out[name] = {
                    "requests": vals["sglang:num_requests_total"],
                    "generation_tokens": vals.get("sglang:generation_tokens_total", 0.0),
                    "weight_version": vals.get("slipstream_engine_weight_version", float("nan")),
                }
        return out

    def engines_serving(self) -> int:
        return sum(1 for c in self.engine_counters().values() if c["requests"] > 0)

    def snapshot(self, progress: Progress, version: int) -> dict[str, Any]:
        """Taken right after the record of `version` was read. The buffer's step counter and staleness
        histogram are read in one transaction (commits are transactions too): `steps` says whether a
        later step's commit is already in the histogram (steps > version)."""
        job, d = self.job, self.job.driver
        pipe = job.r.pipeline(transaction=True)
        pipe.hget(job.buffer.keys.stats, "steps")
        pipe.hgetall(job.buffer.keys.staleness)
        steps, hist = pipe.execute()
        return {
            "t": time.monotonic(),
            "version": version,
            "steps": int(steps or 0),
            "lag_records": progress.lag(),
            "staleness": {int(k): int(v) for k, v in hist.items()},
            "engines": self.engine_counters(),
            "live_engines": len(self.registry.live()),
            "joining_engines": len(self.registry.joining()),
            "status_pools": self.job.store.status(self.job.spec.name).pools or None,
            "driver_engines": len(d.generators.engines),
            "driver_trainer_ranks": len(d.trainers.ranks),
        }

    def close(self) -> None:
        self.http.close()


def trainer_ready_lines(out_dir: Path) -> list[dict[str, int]]:
    """Each trainer pool's rank 0 logs `trainer ready: <model>, N ranks, P params, version V` once set up
    (appended to trainer-0.log by every pool): the pools as the trainer saw them."""
    path = out_dir / "logs" / "trainer-0.log"
    if not path.exists():
        return []
    pat = re.compile(r"trainer ready: .*, (\d+) ranks, \d+ params, version (\d+)")
    return [{"ranks": int(m[1]), "version": int(m[2])} for m in pat.finditer(path.read_text())]


# --- a stage --------------------------------------------------------------------------------------------


def stage(args, progress: Progress, probe: Probe, label: str, spp: int, first: dict | None = None) -> dict:
    """warmup + steps records (starting with `first` if given) and the probes at the window's two ends."""
    from benchmarks.async_vs_sync import rates, slim

    recs = [first] if first is not None else []
    start = None
    while True:
        if len(recs) == args.warmup and start is None:
            start = probe.snapshot(progress, recs[-1]["version"])
        if len(recs) == args.warmup + args.steps:
            break
        recs.append(progress.next(f"stage {label} step {len(recs) + 1}"))
    end = probe.snapshot(progress, recs[-1]["version"])
    m = rates(recs, [r["arrival"] for r in recs], args.warmup, spp)
    m["wall_window"] = None
    timed = recs[args.warmup :]
    pub = [float(r.get("publish_s") or 0.0) for r in timed]
    pause = [float(r.get("pause_s") or 0.0) for r in timed]
    m["publish_s_mean"], m["publish_s_median"] = statistics.mean(pub), statistics.median(pub)
    m["pause_s_mean"] = statistics.mean(pause)
    hist = {
        str(k): end["staleness"].get(k, 0) - start["staleness"].get(k, 0)
        for k in sorted(set(end["staleness"]) | set(start["staleness"]))
    }
    m["staleness_histogram"] = {k: v for k, v in hist.items() if v}
    m["staleness_histogram_groups"] = sum(hist.values())
    m["staleness_histogram_steps"] = end["steps"] - start["steps"]
    # exact: at both reads the buffer had committed exactly the steps recorded so far (no later step's
    # groups in the histogram), so it covers precisely the stage's timed steps
    m["staleness_histogram_exact"] = start["steps"] == start["version"] and end["steps"] == end["version"]
    m["snapshot_lag_records"] = [start["lag_records"], end["lag_records"]]
    engines = {}
    for name, c in end["engines"].items():
        c0 = start["engines"].get(name, {"requests": 0.0, "generation_tokens": 0.0})
        engines[name] = {
            "requests": c["requests"] - c0["requests"],
            "generation_tokens": c["generation_tokens"] - c0["generation_tokens"],
            "weight_version_end": c["weight_version"],
        }
    m["engines"] = engines
    m["observed"] = {
        "engines_with_traffic": sum(1 for e in engines.values() if e["requests"] > 0),
        # since the engine started: a window of a few steps in a sync job may route all its groups to one
        "engines_served_since_start": sum(1 for c in end["engines"].values() if c["requests"] > 0),
        "live_engines": [start["live_engines"], end["live_engines"]],
        "joining_engines_end": end["joining_engines"],
        "status_pools": end["status_pools"],
        "driver_engines": end["driver_engines"],
        "driver_trainer_ranks": end["driver_trainer_ranks"],
        "trainer_pool_index": sorted({r["pool"] for r in recs}),
    }
    m["versions"] = [recs[0]["version"], recs[-1]["version"]]
    m["progress"] = [{**s, "pool": r["pool"]} for s, r in zip(slim(recs), recs, strict=True)]
    o = m["observed"]
    log(
        f"stage {label}: {m['samples_per_s']:.1f} samples/s, {m['tokens_per_s']:.0f} tokens/s, trainer busy "
        f"{m['trainer_busy_fraction']:.2f} wait {m['trainer_wait_fraction']:.2f} publish "
        f"{m['trainer_publish_fraction']:.3f} (publish_s {m['publish_s_mean'] * 1e3:.1f} ms), staleness "
        f"{m['staleness_histogram']}; observed engines with traffic {o['engines_with_traffic']}, live "
        f"{o['live_engines']}, trainer ranks {o['driver_trainer_ranks']}"
    )
    return m


def slim_transition(recs: list[dict]) -> list[dict]:
    return [{"version": r["version"], "pool": r["pool"], "elapsed_s": r["elapsed_s"]} for r in recs]


# --- the scaled job -------------------------------------------------------------------------------------


def scale_generators(job, progress: Progress, probe: Probe, n: int) -> tuple[dict, list[dict], dict]:
    """Generators n-1 -> n as `slipstream scale --generators n` does it: (the scale operation's times, the
    records passed meanwhile, the first record after the new engine took traffic)."""
    d = job.driver
    before = set(d.generators.engine_urls)
    t_req = time.monotonic()
    job.store.set_desired(job.spec.name, generators=n)

    def new_engine_live() -> bool:
        urls = list(d.generators.engine_urls)
        new = set(urls) - before
        return len(urls) == n and bool(new) and new <= set(probe.registry.live())

    passed = progress.until("the new engine to join (live in the registry)", new_engine_live)
    t_live = time.monotonic()
    passed += progress.until("the new engine to finish requests", lambda: probe.engines_serving() >= n)
    t_traffic = time.monotonic()
    first = progress.next("the first step after the new engine took traffic")
    op = {
        "to_stage": f"{n}+1",
        "engine_live_s": t_live - t_req,
        "engine_took_traffic_s": t_traffic - t_req,
        "scale_s": first["arrival"] - t_req,
        "definition": "request (set_desired) -> the first trainer step recorded after the new engine "
        "was live in the registry and had finished requests",
        "steps_during": len(passed),
    }
    return op, passed, first


def scaled_job(
    args, model: Path, work: Path, spp: int, engines: tuple[int, int] = (1, 2), scale_trainers: bool = True
) -> dict[str, Any]:
    """One job that starts at engines[0] engines + 1 rank, is measured there, then scaled one engine at a
    time to engines[1] (measured at each size), then (scale_trainers) to 2 trainer ranks (module docstring)."""
    from slipstream.job.faults import LocalJob

    name = "scale"
    out = work / name
    lo, hi = engines
    spec = job_spec(args, model, name, out, lo, 1, args.max_staleness, FOREVER_STEPS)
    res: dict[str, Any] = {"stages": {}, "scale_ops": {}, "transitions": {}}
    with LocalJob(spec, work / f"{name}-data") as job:
        progress, probe = Progress(job, args.phase_timeout_s), Probe(job)
        try:
            res["stages"][f"{lo}+1"] = stage(args, progress, probe, f"{lo}+1", spp)
            for n in range(lo + 1, hi + 1):
                key = f"generators_{n - 1}_to_{n}"
                res["scale_ops"][key], passed, first = scale_generators(job, progress, probe, n)
                res["transitions"][key] = slim_transition(passed)
                log(f"generators {n - 1} -> {n}: {res['scale_ops'][key]}")
                res["stages"][f"{n}+1"] = stage(args, progress, probe, f"{n}+1", spp, first)

            if scale_trainers:  # trainers 1 -> 2: checkpoint, new pool of 2 ranks resharded from it
                pool0 = progress.pool
                t_req = time.monotonic()
                job.store.set_desired(name, trainers=2)
                passed = []
                while (rec := progress.next("the first step of the 2-rank trainer pool"))["pool"] == pool0:
                    passed.append(rec)
                res["scale_ops"]["trainers_1_to_2"] = {
                    "to_stage": f"{hi}+2",
                    "scale_s": rec["arrival"] - t_req,
                    "definition": "request (set_desired) -> the first step of the new trainer pool "
                    "(checkpoint, stop, start 2 ranks, reshard from the checkpoint, first step)",
                    "steps_during": len(passed),
                    "resumed_after_version": passed[-1]["version"]
                    if passed
                    else res["stages"][f"{hi}+1"]["versions"][1],
                    "first_version_new_pool": rec["version"],
                }
                res["transitions"]["trainers_1_to_2"] = slim_transition(passed)
                log(f"trainers 1 -> 2: {res['scale_ops']['trainers_1_to_2']}")
                res["stages"][f"{hi}+2"] = stage(args, progress, probe, f"{hi}+2", spp, rec)

            versions = [r["version"] for r in progress.all]
            res["versions"] = {
                "first": versions[0],
                "last": versions[-1],
                "records": len(versions),
                "consecutive": versions == list(range(versions[0], versions[0] + len(versions))),
                "trainer_pools": progress.pool + 1,
            }
            res["trainer_ready"] = trainer_ready_lines(out)
            res["buffer_end"] = {k: v for k, v in job.buffer.stats().items() if k != "staleness"}
        finally:
            probe.close()
            progress.close()
    return res


def ab_job(
    args, model: Path, work: Path, spp: int, max_staleness: int, colocated_ranks: int = 0
) -> dict[str, Any]:
    """A job that starts at 2 engines + 2 trainer ranks (or, `colocated_ranks` N, colocated at N ranks
    and N engines) and runs warmup + steps at `max_staleness`."""
    from slipstream.job.faults import LocalJob

    n = colocated_ranks
    name = f"colocated-{n}-staleness-{max_staleness}" if n else f"ab-staleness-{max_staleness}"
    out = work / name
    spec = job_spec(
        args, model, name, out, n or 2, n or 2, max_staleness, args.warmup + args.steps, colocated=bool(n)
    )
    with LocalJob(spec, work / f"{name}-data") as job:
        progress, probe = Progress(job, args.phase_timeout_s), Probe(job)
        try:
            label = f"colocated {n} GPUs" if n else "2+2"
            m = stage(args, progress, probe, f"{label} max_staleness {max_staleness}", spp)
        finally:
            probe.close()
            progress.close()
        m["trainer_ready"] = trainer_ready_lines(out)
    return m


# --- the run --------------------------------------------------------------------------------------------


def build_model(args, work: Path) -> Path:
    from benchmarks.async_vs_sync import build_cuda_model, build_tiny_arith

    return build_tiny_arith(args, work) if args.device == "cpu" else build_cuda_model(args, work)


def summarise(result: dict) -> None:
    """Per-stage figures and every stage's samples/s against 1+1's (of the phases measured so far)."""
    m, r = result["metrics"], result["ratios"]
    st = m.get("stages", {})
    for label in sorted(st):
        key = label.replace("+", "p")
        m[f"samples_per_s_{key}"] = st[label]["samples_per_s"]
        m[f"tokens_per_s_{key}"] = st[label]["tokens_per_s"]
        m[f"publish_s_mean_{key}"] = st[label]["publish_s_mean"]
    if "1+1" in st:
        base = st["1+1"]["samples_per_s"]
        for label in st:
            if label != "1+1":
                r[f"samples_per_s_{label.replace('+', 'p')}_vs_1p1"] = st[label]["samples_per_s"] / base
        for label in st:
            if label.endswith("+1") and label != "1+1" and st["1+1"]["publish_s_mean"] > 0:
                n = label.split("+")[0]
                r[f"publish_s_{n}_vs_1_engines"] = st[label]["publish_s_mean"] / st["1+1"]["publish_s_mean"]
    splits(m, r)
    ab = m.get("async_vs_sync_2p2", {})
    if "0" in ab and len(ab) > 1:
        (ms,) = [k for k in ab if k != "0"]
        r["async_vs_sync_2p2"] = ab[ms]["samples_per_s"] / ab["0"]["samples_per_s"]
        m["samples_per_s_2p2_sync"] = ab["0"]["samples_per_s"]
        m[f"samples_per_s_2p2_staleness_{ms}"] = ab[ms]["samples_per_s"]


def splits(m: dict, r: dict) -> None:
    """The split table (samples/s and samples/s per GPU of every disaggregated stage, the async job at
    2+2 and each colocated sync job), each colocated size against one GPU's, and the headline: the best
    disaggregated async split on 4 GPUs against colocated sync on all 4."""
    table: dict[str, dict[str, float]] = {}
    for label, s in m.get("stages", {}).items():
        e, t = (int(x) for x in label.split("+"))
        table[f"disaggregated {e}:{t}"] = {"gpus": e + t, "samples_per_s": s["samples_per_s"]}
    for ms, s in m.get("async_vs_sync_2p2", {}).items():
        kind = "sync" if ms == "0" else "async"
        table[f"disaggregated 2:2 {kind}"] = {"gpus": 4, "samples_per_s": s["samples_per_s"]}
    colo = m.get("colocated_sync", {})
    for n, s in colo.items():
        table[f"colocated {n} GPUs sync"] = {"gpus": int(n), "samples_per_s": s["samples_per_s"]}
    for row in table.values():
        row["samples_per_s_per_gpu"] = row["samples_per_s"] / row["gpus"]
    if table:
        m["splits"] = table
    if "1" in colo:
        for n, s in colo.items():
            if n != "1":
                r[f"colocated_{n}_vs_1_gpu"] = s["samples_per_s"] / colo["1"]["samples_per_s"]
    four = [
        (row["samples_per_s"], k)
        for k, row in table.items()
        if row["gpus"] == 4 and k.startswith("disaggregated") and not k.endswith(" sync")
    ]  # the scaled job's stages run async (--max-staleness), as does the 2:2 async job
    if four and "4" in colo:
        best = max(four)
        r["disaggregated_async_vs_colocated_sync_4gpu"] = best[0] / colo["4"]["samples_per_s"]
        m["headline_split"] = best[1]


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    from benchmarks.async_vs_sync import env_info
    from benchmarks.common import ResultFile

    rf = ResultFile("scale_run", args.device_kind, argv, args.out_dir, args.label, append=args.append)
    result, save = rf.result, rf.save

    t_start = time.monotonic()
    work_root = Path(args.work_dir) if args.work_dir else None
    with tempfile.TemporaryDirectory(prefix="scale-run-", dir=work_root) as tmp:
        work = Path(tmp)
        t = time.monotonic()
        model = build_model(args, work)
        log(f"model at {model} in {time.monotonic() - t:.1f} s")
        spec0 = job_spec(args, model, "x", work / "x", 1, 1, args.max_staleness, 1)
        spp = spec0.algorithm.groups_per_step * spec0.rollout.group_size
        result["config"] = result["config"] | {
            "steps_timed": args.steps,
            "warmup_steps": args.warmup,
            "groups_per_step": args.groups_per_step,
            "samples_per_step": spp,
            "max_staleness_scaled_job": args.max_staleness,
            "async_vs_sync_max_staleness": [0, args.max_staleness],
            "stages": "E+T: E engines + T trainer ranks; phase all: 1+1 -> E+1 one engine at a time -> E+2 "
            "(--engines, default 2), then async vs sync at 2+2; generators: 1+1 -> E+1 (cuda default 3); "
            "trainers: 2+1 -> 2+2; ab: async vs sync at 2+2",
            "job": job_raw(args, model, 1, 1),
            "model_shape": "tiny-arith (demo)" if args.device == "cpu" else args.model_shape,
            "engine": "built-in engine actors (Ray), cpu, 1 torch thread"
            if args.device == "cpu"
            else "built-in engine actors (Ray), 1 GPU each (generators.gpus_per_engine 1), bf16",
            "trainer": "cpu ranks, 1 torch thread, gloo"
            if args.device == "cpu"
            else "cuda ranks, 1 GPU each, NCCL",
            "bus": spec0.bus.backend,
            "note": CPU_NOTE if args.device == "cpu" else "one job scaled 1+1 -> 2+1 -> 2+2 on 4 GPUs",
            "bus_vs_raw_broadcast_2_engines": "python benchmarks/weight_bus.py --engines 2 --engine-gpus 1,2 "
            "--models qwen2.5-1.5b-shape --device-kind nvidia-h200-x4 --label 2engines",
            "definitions": {
                "samples_per_s": "trained samples / trainer wall time over the stage's steps after warmup_steps "
                "(progress records' elapsed_s; the window starts at the last warm-up record)",
                "trainer_*_fraction": "sum(step_s | wait_s | publish_s) / window",
                "publish_s": "weight bus transfer time per step to every engine (progress records)",
                "staleness_histogram": "buffer histogram of consumed groups' staleness (versions): read at the "
                "window's last record minus at its first",
                "observed": "sizes seen by probes, not requested: registry, engines' own request counters, "
                "driver status, trainer ranks",
                "scale_s": "request (JobStore.set_desired, as `slipstream scale`) -> first trainer step at "
                "the new size (scale_ops.*.definition)",
            },
            "env": env_info(args),
        }
        save()
        with rf.recording(log, t_start, lambda: summarise(result)):
            m = result["metrics"]
            if args.phase == "colocated":
                colo = m.setdefault("colocated_sync", {})
                for n in args.colocated_ranks:
                    colo[str(n)] = ab_job(args, model, work, spp, 0, colocated_ranks=n)
                    save()
            elif args.phase != "ab":
                scaled = {
                    "all": dict(engines=(1, args.engines), scale_trainers=True),
                    "generators": dict(engines=(1, args.engines), scale_trainers=False),
                    "trainers": dict(engines=(2, 2), scale_trainers=True),
                }[args.phase]
                res = scaled_job(args, model, work, spp, **scaled)
                for key in ("stages", "scale_ops", "transitions"):  # an --append phase adds its own
                    m[key] = m.get(key, {}) | res.pop(key)
                m |= res
                save()
            if args.phase in ("all", "ab"):
                ab: dict[str, Any] = {}
                m["async_vs_sync_2p2"] = ab
                for ms in (0, args.max_staleness):
                    ab[str(ms)] = ab_job(args, model, work, spp, ms)
                    save()
    return result


def report(result: dict) -> str:
    m, r = result["metrics"], result["ratios"]
    cfg = result["config"]
    lines = [
        f"scale run on {result['device']}: {cfg.get('samples_per_step')} samples/step, {cfg.get('steps_timed')} timed steps"
    ]
    if result["device"] == "cpu":
        lines.append(
            "(CPU run: checks the mechanics; every process shares the host's cores, no speed-up expected)"
        )
    hdr = f"{'stage':<14} {'eng':>3} {'rk':>3} {'samples/s':>10} {'tokens/s':>9} {'step':>5} {'wait':>5} {'pub':>5}"
    lines.append(hdr + f" {'publish ms':>10} {'stale mean':>10} {'scale s':>8}  staleness histogram")
    ops = m.get("scale_ops", {})
    scale_s = {op["to_stage"]: op["scale_s"] for op in ops.values() if "to_stage" in op}
    rows = [(k, v) for k, v in m.get("stages", {}).items()]
    rows += [(f"2+2 stale {k}", v) for k, v in m.get("async_vs_sync_2p2", {}).items()]
    rows += [(f"colocated {k} sync", v) for k, v in m.get("colocated_sync", {}).items()]
    for label, s in rows:
        o = s["observed"]
        sc = scale_s.get(label)
        lines.append(
            f"{label:<14} {o['engines_with_traffic']:>3} {o['driver_trainer_ranks']:>3} {s['samples_per_s']:>10.1f} "
            f"{s['tokens_per_s']:>9.0f} {s['trainer_busy_fraction']:>5.2f} {s['trainer_wait_fraction']:>5.2f} "
            f"{s['trainer_publish_fraction']:>5.3f} {s['publish_s_mean'] * 1e3:>10.1f} {s['staleness_mean']:>10.2f} "
            f"{'-' if sc is None else f'{sc:.1f}':>8}  {s['staleness_histogram']}"
        )
    if "versions" in m:
        lines.append(
            f"versions: {m['versions']}; trainer pools seen by the trainer: {m.get('trainer_ready')}"
        )
    lines.append(f"bus vs raw broadcast to 2 engines: {cfg.get('bus_vs_raw_broadcast_2_engines')}")
    for e in result["errors"]:
        lines.append(f"ERROR {e['error']}")
    fmt = lambda k: f"{k}={r[k]:.3f}" if k in r else f"{k}=n/a"  # noqa: E731
    lines.append(
        "scale_run "
        + " ".join(
            fmt(k)
            for k in ("samples_per_s_2p1_vs_1p1", "samples_per_s_3p1_vs_1p1", "samples_per_s_2p2_vs_1p1")
            + ("async_vs_sync_2p2", "colocated_2_vs_1_gpu", "colocated_4_vs_1_gpu")
            + ("disaggregated_async_vs_colocated_sync_4gpu",)
        )
        + f" (device={result['device']})"
    )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"CPU smoke defaults: {QUICK}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--device-kind", help="device named in the result file (cpu, nvidia-h200-x4; default: --device)"
    )
    p.add_argument("--steps", type=int, help=f"timed optimizer steps per stage (default {DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed first steps per stage (default {DEFAULTS['warmup']})")
    p.add_argument("--groups-per-step", type=int, help="algorithm.groups_per_step (default 16 cpu, 32 cuda)")
    p.add_argument("--max-staleness", type=int, default=2, help="the scaled job's and the async job's bound")
    p.add_argument("--model-warmup-steps", type=int, help="SFT warm-up of the tiny CPU model")
    p.add_argument("--model-shape", default="qwen2.5-1.5b-shape", help="cuda: benchmarks/shapes.py shape")
    p.add_argument("--full-vocab", action="store_true", help="cuda: keep the shape's real vocabulary")
    p.add_argument("--max-new-tokens", type=int, default=256, help="cuda: tokens per model turn")
    p.add_argument("--engine-max-batch", type=int, default=256, help="cuda: generators.max_batch_size")
    p.add_argument("--bus-backend", choices=["nccl", "gloo"], default="nccl", help="cuda: the weight bus")
    p.add_argument("--phase-timeout-s", type=float, default=600.0, help="bound on each wait for the job")
    p.add_argument(
        "--phase",
        choices=["all", "generators", "trainers", "ab", "colocated"],
        default="all",
        help="all: one job 1+1 -> E+1 -> E+2, then async vs sync at 2+2; or one part, each a command of its "
        "own that fits one device call (with --append: generators 1+1 -> E+1; trainers 2+1 -> 2+2; ab; "
        "colocated: a colocated sync job at each --colocated-ranks size, the headline's baseline)",
    )
    p.add_argument(
        "--colocated-ranks",
        default="1,2,4",
        help="--phase colocated: comma-separated sizes, each a job of N ranks with an engine on each rank's "
        "device (cuda: N GPUs)",
    )
    p.add_argument(
        "--engines",
        type=int,
        help="E: most engines of the scaled job (default 3 for cuda --phase generators, else 2)",
    )
    p.add_argument("--label", help="result file label (scale_run-<device>-<label>-<date>.json)")
    p.add_argument(
        "--append", action="store_true", help="add to today's result file of this device and label"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="parent of the temporary job directories (default: system temp)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    from benchmarks.common import apply_presets  # here: the script runs without PYTHONPATH

    apply_presets(args, DEFAULTS, CUDA_DEFAULTS, QUICK)
    if args.warmup < 1 or args.steps < 1:
        p.error(
            "--warmup and --steps must be at least 1 (a stage's window starts at a warm-up step's record)"
        )
    if args.max_staleness < 1:
        p.error("--max-staleness must be at least 1 (0 is the sync baseline the run compares against)")
    args.device_kind = args.device_kind or args.device
    args.colocated_ranks = [int(x) for x in str(args.colocated_ranks).split(",") if x]
    if any(n < 1 or n > 4 for n in args.colocated_ranks):
        p.error("--colocated-ranks: sizes from 1 to 4")
    if args.engines is None:
        args.engines = 3 if args.device == "cuda" and args.phase == "generators" else 2
    if args.engines < 2:
        p.error("--engines must be at least 2 (the scaled job adds engines to its first one)")
    if args.device == "cuda" and args.engines + (args.phase == "all") > 3:
        p.error(f"--engines {args.engines} with --phase {args.phase} needs more than 4 GPUs")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # Ray's workers inherit it (see KINDS.md on multicast)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.device == "cuda":
        import torch

        need = max(args.colocated_ranks) if args.phase == "colocated" else 4
        if torch.cuda.device_count() < need:
            raise SystemExit(
                f"--device cuda --phase {args.phase} needs {need} GPUs; {torch.cuda.device_count()} visible"
            )
    result = run(args, argv)
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
