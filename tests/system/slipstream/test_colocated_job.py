"""Colocated jobs end to end on CPU (`placement: colocated`): the demo's a+b task on the SFT-warmed tiny
model, a built-in engine pinned to the trainer's host, weights handed over through the ipc bus (shared
memory), real Redis, Ray and HTTP. The sync schedule releases the engine's memory before every optimizer
step and resumes it around the publish; the async one keeps both resident; two trainer ranks each hand
the weights to their own engine. Reward rises in the sync and the async job (the two-rank job is too short
to tell a rise from noise: it checks that every version reaches both engines)."""

from pathlib import Path

import http_calls
import pytest
from prometheus_client.parser import text_string_to_metric_families

import jobspec
from replay_buffer.client import connect
from replay_buffer.keys import JobKeys
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray

STEPS = 30
FIRST, LAST = 4, 8
"""Steps averaged at the start and at the end of a job to tell whether reward rose. The start's window is
short: the warmed-up model's reward moves within the first ten steps, and a window reaching into them
takes part of the rise into the baseline (over 30-step runs of the sync and async jobs, the first 4 steps
against the last 8 rose by 0.11-0.23; the first 8 against the last 8 by 0.06-0.23)."""
WARMUP = 5
"""Optimizer steps of learning-rate warmup. Adam's first steps move every weight by about the full rate;
without warmup, 3 of 8 async runs fell to a step reward of 0.05-0.08 at steps 5-6 and one rose by only
0.057 (CI saw one rise by 0.0004). With it, 8 async runs rose by 0.13-0.23 and 6 sync runs by 0.13-0.27,
no step below 0.11. The LoRA job (test_lora_job.py) warms up too: 6 runs without warmup rose by
0.06-0.25, 6 with it by 0.16-0.22."""


def _spec(tmp_path, model, name: str, max_staleness: int, steps: int = STEPS, **sections):
    """The colocated a+b job; `sections` (trainer, generators, ...) are added to its spec."""
    return jobspec.from_dict(
        {
            "name": name,
            "output_dir": str(tmp_path / "run"),
            # a+b over 0..4: few enough problems that 30 short steps move the reward
            "model": {"path": str(model), "build": "tiny-arith", "warmup_steps": 100},
            "dataset": {"name": "arith", "max_operand": 4},
            "reward": {"name": "arith", "format_weight": 0.1},
            "rollout": {"group_size": 8, "concurrency": 8, "sampling": {"max_new_tokens": 6}},
            "algorithm": {"lr": 1e-3, "lr_warmup_steps": WARMUP, "groups_per_step": 8, "total_steps": steps},
            "buffer": {"max_staleness": max_staleness},
            "placement": "colocated",
            **sections,
        }
    )


class Scraper:
    """An on_progress callback that, once the job has published a few versions, reads the metrics the
    job's trainer and engine serve right then (their addresses are in the job's Redis): what the
    processes themselves counted, not what the spec asked for."""

    REPLICAS = ("trainer-0", "engine-0")

    def __init__(self, spec, at_version: int = 3) -> None:
        self.spec, self.at = spec, at_version
        self.seen: list[dict] = []
        self.samples: dict[str, list[tuple[str, dict, float]]] = {}

    def __call__(self, record: dict) -> None:
        self.seen.append(record)
        if self.samples or record["version"] < self.at:
            return
        r = connect((Path(self.spec.output_dir) / "redis.url").read_text())
        try:
            targets = {
                k.decode(): v.decode() for k, v in r.hgetall(JobKeys(self.spec.name).metrics_targets).items()
            }
        finally:
            r.close()
        for replica in self.REPLICAS:
            text = http_calls.get(f"http://{targets[replica]}/metrics", timeout=10).text
            self.samples[replica] = [
                (s.name, s.labels, s.value)
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
            ]

    def value(self, replica: str, name: str, **labels) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
        return sum(v for n, have, v in self.samples[replica] if n == name and labels.items() <= have.items())


def _rose(seen: list[dict]) -> tuple[float, float]:
    first = sum(p["reward_mean"] for p in seen[:FIRST]) / FIRST
    last = sum(p["reward_mean"] for p in seen[-LAST:]) / LAST
    return first, last


def test_colocated_sync_job_releases_the_engines_for_each_step_and_learns(tmp_path, demo_model):
    spec = _spec(tmp_path, demo_model, "colo-sync", 0)
    assert spec.bus.backend == "ipc" and spec.schedule == "sync"
    scraper = Scraper(spec)
    result = run_job(spec, on_progress=scraper)
    seen = scraper.seen

    assert result.version == STEPS and [p["version"] for p in seen] == list(range(1, STEPS + 1))
    for p in seen:
        assert p["placement"] == "colocated" and p["schedule"] == "sync" and p["bus_backend"] == "ipc"
        # the one engine released its memory before the step and got all of it back around the publish
        assert p["released_engines"] == 1 and p["resumed_engines"] == 1, p
        assert p["release_s"] > 0 and p["resume_s"] > 0
        assert p["publish_s"] > 0  # every version was handed over
        assert p["staleness_max"] == 0  # nothing was generated while the trainer trained
    st = result.buffer
    assert st["staleness"] == {0: st["consumed"]} and st["consumed"] == STEPS * 8
    first, last = _rose(seen)
    assert last > first + 0.05, (first, last, [round(p["reward_mean"], 2) for p in seen])
    log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    assert "engines released their memory" in log and "resumed kv_cache and cuda_graph" in log
    # what the processes counted: the trainer handed weights over through ipc only, and released the
    # engine once per step; the engine itself released each kind of memory that often
    assert scraper.samples, "the job's metrics were not read"
    at = scraper.value("trainer-0", "slipstream_colocated_releases_total")
    assert at >= 3
    assert scraper.value("trainer-0", "slipstream_bus_updates_total", backend="ipc") >= 3
    assert scraper.value("trainer-0", "slipstream_bus_updates_total", backend="gloo") == 0
    for tag in ("kv_cache", "weights", "cuda_graph"):
        assert scraper.value("engine-0", "slipstream_engine_memory_releases_total", tag=tag) >= at


def test_colocated_async_job_keeps_both_resident_and_learns(tmp_path, demo_model):
    spec = _spec(tmp_path, demo_model, "colo-async", 1)
    assert spec.bus.backend == "ipc" and spec.schedule == "async"
    scraper = Scraper(spec)
    result = run_job(spec, on_progress=scraper)
    seen = scraper.seen

    assert result.version == STEPS
    for p in seen:
        assert p["placement"] == "colocated" and p["schedule"] == "async" and p["bus_backend"] == "ipc"
        assert "release_s" not in p and "released_engines" not in p  # nothing released
        assert p["staleness_max"] <= 1
    assert any(p["publish_s"] > 0 for p in seen)
    first, last = _rose(seen)
    assert last > first + 0.05, (first, last, [round(p["reward_mean"], 2) for p in seen])
    log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    assert "engines released their memory" not in log
    assert scraper.value("trainer-0", "slipstream_bus_updates_total", backend="ipc") >= 1
    assert scraper.value("trainer-0", "slipstream_bus_updates_total", backend="gloo") == 0
    assert scraper.value("trainer-0", "slipstream_colocated_releases_total") == 0


class FleetScraper(Scraper):
    """Scraper reading the trainer and both engines of a two-rank job."""

    REPLICAS = ("trainer-0", "engine-0", "engine-1")


def test_colocated_job_on_two_ranks_hands_each_engine_its_own_ranks_weights(tmp_path, demo_model):
    """Two trainer ranks (FSDP over gloo) and two engines: every rank hands the weights to its own engine
    (weight_bus.rank_handoff), rank 0 pauses and continues both, and every version reaches both engines.
    That the handed-over bytes are each rank's own, bit for bit, is tests/integration/weight_bus/test_rank_handoff.py;
    that a colocated job learns is the two tests above (a 2-rank job of a few steps moves the reward too
    little to tell from noise)."""
    steps = 8
    spec = _spec(
        tmp_path,
        demo_model,
        "colo-2ranks",
        1,
        steps,
        trainer={"num_trainers": 2},
        generators={"num_engines": 2},
    )
    assert spec.bus.backend == "ipc" and spec.schedule == "async"
    scraper = FleetScraper(spec)
    result = run_job(spec, on_progress=scraper)
    seen = scraper.seen

    assert result.version == steps and [p["version"] for p in seen] == list(range(1, steps + 1))
    log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    for v in range(1, steps + 1):  # every version, from both ranks, to both engines
        assert (
            f"published version {v} to 2 engines from 2 ranks (each to the engines on its device)" in log
        ), v
    assert scraper.samples, "the job's metrics were not read"
    assert scraper.value("trainer-0", "slipstream_bus_updates_total", backend="ipc") >= 3
    for engine in ("engine-0", "engine-1"):  # each engine loaded payloads (from its own rank)
        assert scraper.value(engine, "slipstream_engine_ipc_payloads_total") >= 3, engine
