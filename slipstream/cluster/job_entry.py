"""The cluster's entry for a submitted job: `slipstream submit` starts `python -m slipstream.cluster.job_entry
--home HOME --job NAME` through Ray's job API. It takes the job's run lease (one driver per job name,
ever: slipstream/job/lease.py), connects to the cluster's Ray, and runs the job's driver
(slipstream/job/driver.py) until the job ends, then reports its final state."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec
import redis

import jobspec
from common.logtext import PlainFormatter
from jobspec.spec import check_name
from replay_buffer.client import connect
from slipstream.cluster import state as cluster_state
from slipstream.job.driver import JobDriver, Stop, final_status
from slipstream.job.lease import LeaseRefused, RunLease, exit_now
from slipstream.job.store import NO_POOLS, JobStore, load_job_spec, resume_fields
from slipstream.job.supervise import GiveUp

log = logging.getLogger("slipstream.job.driver")


def _raise_stop(signum, frame):
    raise Stop(f"signal {signum}")


RAY_CONNECT_GRACE_S = 10.0
"""How long ray.init may still block after the job's stop was requested or its Redis went away."""


def _connect_ray(store: JobStore, job: str) -> None:
    """ray.init, watched. While the Ray cluster it dials goes away (a cluster down racing the driver's
    start), Ray's GCS client blocks in C++, where no Python signal handler runs, SIGTERM's included: the
    driver would outlive its cluster. A watchdog thread ends the process if ray.init has not returned
    RAY_CONNECT_GRACE_S after a stop was requested or the cluster's Redis went away; the control API marks
    the job from Ray's state (`_reconcile`)."""
    import ray

    connected = threading.Event()

    def watch() -> None:
        since = None
        while not connected.wait(1.0):
            try:
                why = "its stop was requested" if store.desired(job).stop else None
            except redis.RedisError as e:
                why = f"the cluster's Redis is gone ({e})"
            since = (since or time.monotonic()) if why else None
            if (
                since is not None
                and time.monotonic() - since >= RAY_CONNECT_GRACE_S
                and not connected.is_set()
            ):
                log.error(
                    "job %s: %s and Ray has not answered for %.0f s since: the driver exits",
                    job, why, RAY_CONNECT_GRACE_S,
                )  # fmt: skip
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(1)

    threading.Thread(target=watch, name="ray-connect-watch", daemon=True).start()
    try:
        # The Ray job's runtime env (PYTHONPATH, HF_HUB_OFFLINE: slipstream/cluster/control.py) reaches
        # every actor.
        ray.init(
            address="auto", namespace=f"slipstream-{job}", log_to_driver=True, logging_level=logging.WARNING
        )
    finally:
        connected.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slipstream.cluster.job_entry", description=__doc__.splitlines()[0]
    )
    p.add_argument("--home", required=True, help="the cluster's state directory")
    p.add_argument("--job", required=True)
    p.add_argument("--submission", help="the Ray submission id it runs as (default: the job's current)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The job's own Redis user (its keys only), not the control plane's: cluster_state.job_redis_url.
    if why := check_name(args.job):
        print(f"slipstream.job.driver: job name {args.job!r}: {why}", file=sys.stderr)
        return 1
    try:
        redis_url = cluster_state.job_redis_url(args.home, args.job)
    except OSError as e:
        print(f"slipstream.job.driver: job {args.job!r} has no Redis credentials: {e}", file=sys.stderr)
        return 1
    store = JobStore(connect(redis_url))
    lease = RunLease(store.r, args.job, args.submission)
    try:  # before any of the job's keys is read or written: one driver per job name, ever
        store.update_status(args.job, driver=lease.take())
    except (LeaseRefused, redis.RedisError) as e:
        print(f"slipstream.job.driver: {e}", file=sys.stderr)
        return 1
    lease.keep(on_lost=exit_now)
    try:
        return _main(args, store, redis_url, lease)
    finally:
        lease.release()


def _main(args: argparse.Namespace, store: JobStore, redis_url: str, lease: RunLease) -> int:
    try:
        spec = load_job_spec(store, args.job)
    except jobspec.JobSpecError as e:  # never run a job on defaults: fail it, loudly
        print(f"slipstream.job.driver: {e}", file=sys.stderr)
        try:
            if store.has_status(args.job):
                store.update_status(args.job, state="failed", error=str(e))
        except redis.RedisError as re_:
            print(f"slipstream.job.driver: could not mark the job failed: {re_}", file=sys.stderr)
        return 1
    out = Path(spec.output_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stdout)
    fh = logging.FileHandler(out / "logs" / "driver.log")
    fh.setFormatter(PlainFormatter(fmt))  # no colours or progress-bar redraws in the file
    logging.getLogger().addHandler(fh)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if (want := store.desired(args.job)).stop:  # a stop (or cluster down) came between submit and here
        resume = resume_fields(msgspec.json.decode(store.spec_json(args.job)))
        store.update_status(args.job, state="stopped", phase=None, pools=NO_POOLS, **resume)
        log.info(
            "job %s stopped before its driver started (%s): %s",
            args.job, want.stop_reason or "stop requested", resume["note"],
        )  # fmt: skip
        return 0
    import ray

    _connect_ray(store, args.job)
    signal.signal(signal.SIGTERM, _raise_stop)
    driver = JobDriver(spec, redis_url, store, serve_metrics=True)  # scraped as replica `driver`
    log.info("job %s: driver pid %d, output in %s", args.job, os.getpid(), out)
    code, final = 0, {}
    try:
        result = driver.run()
        final = final_status(driver, result)
    except (Stop, KeyboardInterrupt) as e:
        final = final_status(driver, error=e)
    except GiveUp as e:  # its message is the cause and the fix: no traceback to read
        final = final_status(driver, error=e)
        code = 1
    except Exception as e:
        log.exception("job %s failed", args.job)
        final = final_status(driver, error=e)
        code = 1
    finally:
        driver.close()  # the final state is reported once every actor is gone
        from slipstream.job.report import write_report_logged

        # PNG plots (the steps' and the evaluations'); logs and swallows any failure
        write_report_logged(driver.records + driver.progress.evals, out)
        lease.release()  # before the final state: once the job shows ended, its name is free
        driver.report(phase=None, **(final or {"state": "failed", "error": "the driver was interrupted"}))
        ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
