"""Soak run (not in CI): a CPU job for `--minutes` with a random fault every `--fault-every-s` seconds
(kill -9 a rollout worker, kill -9 an engine, SIGSTOP an engine, kill -9 the trainer, kill -9 and restart
redis-server; slipstream/job/faults.py).
Reports RSS growth per role (sampled every 30 s: first vs last quarter of the run), stuck periods (no
trainer progress for `--stuck-s`), and the books at the end: lost and trained-twice groups (both must be 0).

    PYTHONPATH=. python benchmarks/soak.py --minutes 30

Writes benchmarks/results/soak-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RSS_EVERY_S = 30.0


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(path: Path) -> Path:
    from generator_fleet.tasks.arith import ALPHABET, ArithTask
    from model_zoo.tiny import build

    task = ArithTask()
    build(path, ALPHABET, [p.prompt + str(p.answer) for p in task.problems], seed=0)
    return path


def spec_for(out: Path, model: Path):
    import jobspec

    return jobspec.loads(
        f"""
name: soak
output_dir: {out}
model: {{path: {model}}}
rollout: {{group_size: 4, concurrency: 4, sampling: {{max_new_tokens: 4}}}}
generators: {{num_engines: 2, num_workers: 2}}
algorithm: {{groups_per_step: 2, total_steps: 10000000, lr: 1.0e-4}}
buffer: {{max_staleness: 2, worker_lease_s: 3.0, ledger: true, reclaim_idle_ms: 3000}}
trainer: {{checkpoint_every: 20, keep_checkpoints: 2}}
bus: {{backend: gloo, timeout_s: 10.0}}
redis: {{appendfsync: always}}
"""
    )


class Watch(threading.Thread):
    """Samples RSS per role and notices stuck periods (no version change for stuck_s)."""

    def __init__(self, job, stuck_s: float) -> None:
        super().__init__(daemon=True, name="soak-watch")
        self.job, self.stuck_s = job, stuck_s
        self.rss: list[dict] = []
        self.stuck: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        last_v, last_change, next_rss = -1, time.monotonic(), 0.0
        while not self.done.wait(1.0):
            now = time.monotonic()
            v = self.job.version()
            if v != last_v:
                if now - last_change > self.stuck_s:
                    self.stuck.append({"at_version": last_v, "seconds": round(now - last_change, 1)})
                    log(f"no progress for {now - last_change:.0f} s at version {last_v}")
                last_v, last_change = v, now
            if now >= next_rss:
                next_rss = now + RSS_EVERY_S
                try:
                    sample = {"t": round(now, 1), "version": v}
                    for role, pid in self.job.pids().items():
                        sample[role.rsplit("-", 1)[0] + "_mb"] = sample.get(
                            role.rsplit("-", 1)[0] + "_mb", 0
                        ) + (psutil.Process(pid).memory_info().rss / 2**20)
                    sample["driver_mb"] = psutil.Process(os.getpid()).memory_info().rss / 2**20
                    self.rss.append(sample)
                except Exception as e:  # a process replaced mid-sample: the next sample has it
                    log(f"rss sample skipped: {e}")


def rss_growth(samples: list[dict]) -> dict:
    """Per role: mean MB over the first and the last quarter of the samples, and the difference."""
    if len(samples) < 4:
        return {}
    q = max(1, len(samples) // 4)
    roles = sorted({k for s in samples for k in s if k.endswith("_mb")})
    out = {}
    for role in roles:
        first = [s[role] for s in samples[:q] if role in s]
        last = [s[role] for s in samples[-q:] if role in s]
        if first and last:
            out[role] = {
                "first_quarter_mb": round(statistics.mean(first), 1),
                "last_quarter_mb": round(statistics.mean(last), 1),
                "growth_mb": round(statistics.mean(last) - statistics.mean(first), 1),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--fault-every-s", type=float, default=60.0)
    p.add_argument("--stuck-s", type=float, default=60.0, help="no trainer progress for this long = stuck")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--label", default="", help="suffix of the result file name (several runs in a day)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from slipstream.job import faults
    from slipstream.job import generators as generators_mod

    generators_mod.LAPSED_S = 5.0
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    log(f"building the tiny model in {tmp}")
    model = build_model(tmp / "model")
    spec = spec_for(tmp / "out", model)
    injected: list[dict] = []
    errors: list[str] = []
    t0 = time.monotonic()
    with faults.LocalJob(spec, tmp) as job:
        job.wait("the first steps", lambda: job.version() >= 3, timeout_s=300)
        watch = Watch(job, args.stuck_s)
        watch.start()
        end = t0 + args.minutes * 60
        kinds = [
            ("kill_worker", faults.kill_worker),
            ("kill_engine", lambda j: faults.kill_engine(j, rng.randrange(len(j.driver.generators.engines)))),
            ("hang_engine", lambda j: faults.hang_engine(j, rng.randrange(len(j.driver.generators.engines)))),
            ("kill_trainer", faults.kill_trainer),
            ("restart_redis", faults.restart_redis),
        ]
        while time.monotonic() + args.fault_every_s < end:
            time.sleep(rng.uniform(0.5, 1.5) * args.fault_every_s)
            name, fn = rng.choice(kinds)
            try:
                f = fn(job)
                f["at_s"] = round(time.monotonic() - t0, 1)
                injected.append(f)
                log(f"{len(injected)} faults; last {f}; version {job.version()}")
            except faults.JobFailed as e:
                errors.append(f"{name}: {e}")
                log(f"fault {name} not repaired: {e}")
                if job.error is not None or job.result is not None:
                    break
        remaining = end - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        watch.done.set()
        watch.join()
        result = job.stop()
        books = faults.books(job)
        restarts = dict(job.driver.restarts)
    wall = time.monotonic() - t0
    growth = rss_growth(watch.rss)
    counts: dict[str, int] = {}
    for f in injected:
        counts[f["fault"]] = counts.get(f["fault"], 0) + 1
    doc = {
        "benchmark": "soak",
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "minutes": args.minutes,
            "fault_every_s": args.fault_every_s,
            "stuck_s": args.stuck_s,
            "seed": args.seed,
            "cpu_count": os.cpu_count(),
            "host_load_1m_end": os.getloadavg()[0],
        },
        "metrics": {
            "wall_s": round(wall, 1),
            "final_version": result.version,
            "faults_injected": len(injected),
            "faults_by_kind": counts,
            "faults_not_repaired": errors,
            "restarts": restarts,
            "stuck_periods": watch.stuck,
            "rss_growth": growth,
            "books": books,
            "lost": books["lost"],
            "trained_twice": books["trained_twice"],
        },
        "faults": injected,
        "rss_samples": watch.rss,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"soak-cpu-{datetime.date.today():%Y%m%d}{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {path}")
    print(
        f"soak: {wall / 60:.1f} min, version {result.version}, {len(injected)} faults {counts}, "
        f"not repaired {len(errors)}, stuck periods {len(watch.stuck)}, lost {books['lost']}, "
        f"trained twice {books['trained_twice']}, RSS growth (MB) "
        + ", ".join(f"{k} {v['growth_mb']:+.0f}" for k, v in growth.items())
    )
    return 0 if books["lost"] == 0 and books["trained_twice"] == 0 and not errors else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the project's packages, not benchmarks/trainer.py
    sys.exit(main())
