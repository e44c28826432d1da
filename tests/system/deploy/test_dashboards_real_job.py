"""Grafana dashboards as code (deploy/grafana/dashboards/*.json), proved against real data: a real Prometheus,
configured from deploy/prometheus.yml, scrapes a short real job through the file_sd targets Slipstream
writes, and every panel's PromQL must return data for that job. A panel whose query returns nothing fails."""

from __future__ import annotations

import math
import re
import shutil
import threading
import time
from pathlib import Path

import http_calls
import httpx
import pytest
import redis
import yaml
from grafana_dashboards import DASHBOARDS, DEPLOY, board_panels, load_board
from prom import start_prometheus

import jobspec
from common.net import free_port
from slipstream.cluster.targets import write_file_sd
from slipstream.job import gpu_metrics
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray

WAIT_S = 60.0
"""Upper bound on waiting for Prometheus; a timeout only, never a performance threshold."""
SCRAPE_S = 1
JOB = "dash"
REPLICAS = {"engine-0", "rollout-0", "trainer-0"}
"""The job's processes that export metrics."""
MIN_SCRAPES = 12
"""Successful scrapes of every replica before the job is told to stop: rate()s over the 15 s window need
two in it, and a loaded 2-core box scrapes late. A count of events, not a time: the job runs until then."""
MIN_STEPS_SCRAPED = 4
"""Trainer steps between the first and the last scrape of its step counter before the job is told to stop: on
a starved box the first step can take longer than MIN_SCRAPES scrapes, and a job stopped after one step
leaves the per-update panels (transfer, pause, phases) no two samples to take a rate() of. A count too."""
MAX_STEPS = 400
"""Bound on the job when Prometheus never gets there (then the test fails on the panels without data)."""
SUBSTITUTIONS = {
    "job": JOB,
    "replica": ".*",  # the "All" value of the replica variable (allValue)
    "__rate_interval": "15s",  # Grafana: at least 4 scrape intervals, more on a longer time range; a loaded box scrapes late
    "__interval": "1s",
    "__range": "60s",
}


def gpu_only(expr: str) -> bool:
    """A query over GPU gauges only (slipstream/job/gpu_metrics.py): data only where a job process has a GPU."""
    names = set(re.findall(r"\b(slipstream_\w+|process_\w+|sglang\w*)", expr))
    return bool(names) and names <= set(gpu_metrics.METRICS)


def _substitute(expr: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in SUBSTITUTIONS, f"unknown variable ${name} in {expr}"
        return SUBSTITUTIONS[name]

    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)
    assert "$" not in out, out
    return out


def _prometheus_config(tmp_path: Path) -> Path:
    """deploy/prometheus.yml with a 1 s scrape interval and only the `slipstream` job (Ray's local instance
    in the test would otherwise be scraped too); targets/ next to the config, as `make cluster-up` lays it out."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    config["scrape_configs"] = [c for c in config["scrape_configs"] if c["job_name"] == "slipstream"]
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == ["targets/*.json"]
    (tmp_path / "targets").mkdir(parents=True)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _job_redis(run_dir: Path) -> redis.Redis | None:
    """A client of the job's (managed) Redis, whose URL the launcher writes to <output_dir>/redis.url; None
    while the file is still empty, OSError while it is absent."""
    url = (run_dir / "redis.url").read_text().strip()
    return redis.Redis.from_url(url, socket_timeout=2) if url else None


def _write_targets(run_dir: Path, out_dir: Path, stop: threading.Event) -> None:
    """What the control plane's TargetWriter does, every 0.5 s: the job's processes register their metrics
    addresses in the job's Redis."""
    r = None
    while not stop.wait(0.5):
        try:
            if r is None and (r := _job_redis(run_dir)) is None:
                continue
            write_file_sd(r, out_dir)
        except (OSError, redis.RedisError):
            pass  # not started yet, or Redis already stopped at the end of the job


def _stop_when_scraped(base: str, run_dir: Path, stop: threading.Event) -> None:
    """Ask the job to stop (JobStore.request_stop, what `slipstream stop` does) once Prometheus holds
    MIN_SCRAPES successful scrapes of each of its three replicas and has seen the trainer take
    MIN_STEPS_SCRAPED steps. A fixed step count made the trainer's life a few seconds long, and a loaded box
    scraped it too rarely for a rate()."""
    from slipstream.job.store import JobStore

    steps = f'slipstream_trainer_steps_total{{job="{JOB}"}}'
    while not stop.wait(0.5):
        try:
            scraped = {
                s["metric"]["replica"]: float(s["value"][1])
                for s in _query(base, f'sum_over_time(up{{job="{JOB}"}}[1h])')
            }
            if not all(scraped.get(replica, 0) >= MIN_SCRAPES for replica in REPLICAS):
                continue
            seen = _query(base, f"max(max_over_time({steps}[1h]) - min_over_time({steps}[1h]))")
            if not seen or float(seen[0]["value"][1]) < MIN_STEPS_SCRAPED:
                continue
            if (r := _job_redis(run_dir)) is None:
                continue
            with r:
                JobStore(r).request_stop(JOB)
            return
        except (OSError, httpx.HTTPError, redis.RedisError, KeyError):
            pass  # Prometheus or the job's Redis not up yet


def _query(base: str, expr: str) -> list[dict]:
    """An instant query's result vector."""
    return http_calls.get(f"{base}/api/v1/query", params={"query": expr}).json()["data"]["result"]


def _query_range(base: str, expr: str, start: float, end: float) -> list[dict]:
    resp = http_calls.get(
        f"{base}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": SCRAPE_S}
    )
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    assert body["data"]["resultType"] == "matrix"
    return body["data"]["result"]


def _has_data(base: str, expr: str, start: float, end: float) -> bool:
    """At least one series with at least one finite value (NaN, e.g. a quantile over no events, is no data)."""
    series = _query_range(base, expr, start, end)
    return any(math.isfinite(float(v)) for s in series for _, v in s["values"])


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian package) not on PATH")
def test_every_panel_query_returns_data_from_a_real_job(tmp_path, tiny_model_dir):
    config = _prometheus_config(tmp_path / "prom")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    prom = start_prometheus(config, tmp_path / "prom" / "data", port, tmp_path)
    stop = threading.Event()
    run_dir = tmp_path / "run"
    writer = threading.Thread(
        target=_write_targets, args=(run_dir, config.parent / "targets", stop), daemon=True
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert prom.poll() is None, "prometheus exited"
            try:
                if http_calls.get(f"{base}/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.1)

        spec = jobspec.from_dict(
            {
                "name": JOB,
                "output_dir": str(run_dir),
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 4}},
                "generators": {"num_engines": 1, "num_workers": 1},
                "algorithm": {"groups_per_step": 2, "total_steps": MAX_STEPS},
                "buffer": {"max_staleness": 1},
                # several buckets per update, so the wire-rate panel has a rate to show
                "bus": {"update_every": 1, "bucket_bytes": 64 << 10},
                # the evaluation panels: version 0 is evaluated before the first step
                "eval": {"every": 50, "heldout": 8, "max_samples": 8},
            }
        )
        stopper = threading.Thread(target=_stop_when_scraped, args=(base, run_dir, stop), daemon=True)
        writer.start()
        stopper.start()
        start = time.time()
        result = run_job(spec)
        end = time.time()
        assert result.version > 0
        stop.set()
        writer.join()
        stopper.join()
        # The job's processes are gone: Prometheus has everything it will get. Evaluate over the run.
        start, end = math.floor(start), math.ceil(end) + SCRAPE_S

        up = _query_range(base, f'up{{job="{JOB}"}}', start, end)
        replicas = {s["metric"]["replica"] for s in up}
        assert REPLICAS <= replicas, replicas
        scraped = {s["metric"]["replica"]: sum(v == "1" for _, v in s["values"]) for s in up}
        print(f"job ran {result.version} steps; successful scrapes per replica: {scraped}")
        assert all(s["metric"]["component"] == s["metric"]["replica"].rsplit("-", 1)[0] for s in up)

        empty, skipped_gpu = [], []
        checked = 0
        for path in DASHBOARDS:
            board = load_board(path)
            # the template variables' label_values(...) queries find the job and its replicas
            for v in board["templating"]["list"]:
                m = re.fullmatch(r"label_values\((.*), (\w+)\)", v["query"]["query"])
                selector, label = _substitute(m.group(1)), m.group(2)
                resp = http_calls.get(
                    f"{base}/api/v1/label/{label}/values",
                    params={"match[]": selector, "start": start, "end": end},
                ).json()
                values = set(resp["data"])
                assert (JOB in values) if label == "job" else (replicas <= values), (
                    path.name,
                    v["name"],
                    resp,
                )
            for panel in board_panels(board):
                for target in panel["targets"]:
                    expr = _substitute(target["expr"])
                    checked += 1
                    if gpu_only(expr) and not gpu_metrics.visible_gpus():
                        # a CPU job exports no GPU series (tests/unit/slipstream/test_gpu_metrics.py checks the
                        # exporter on a GPU); here the query must still be valid PromQL
                        _query_range(base, expr, start, end)
                        skipped_gpu.append(f"{panel['title']} / {target['refId']}")
                        continue
                    if not _has_data(base, expr, start, end):
                        empty.append(f"{path.name} / {panel['title']} / {target['refId']}: {expr}")
        assert checked >= 20
        # The check tells data from none: a metric the job never exports, and series that are NaN at every
        # step (what a quantile over a window without observations gives), both count as empty.
        assert not _has_data(base, f'slipstream_no_such_metric{{job="{JOB}"}}', start, end)
        assert _query_range(base, f'up{{job="{JOB}"}} * NaN', start, end)
        assert not _has_data(base, f'up{{job="{JOB}"}} * NaN', start, end)
        assert not empty, (
            f"panel queries without data (successful scrapes: {scraped}, steps {result.version}):\n"
            + "\n".join(empty)
        )
        if skipped_gpu:
            print(f"no GPU here: data not expected for {len(skipped_gpu)} GPU queries: {skipped_gpu}")
    finally:
        stop.set()
        prom.terminate()
        prom.wait(timeout=30)
