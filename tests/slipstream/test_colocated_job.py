"""Colocated jobs end to end on CPU (`placement: colocated`): the demo's a+b task on the SFT-warmed tiny
model, a built-in engine pinned to the trainer's host, weights handed over through the ipc bus (shared
memory), real Redis, Ray and HTTP. The sync schedule releases the engine's memory before every optimizer
step and resumes it around the publish; the async one keeps both resident. Reward rises in both."""

import pytest

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.slow

STEPS = 30
WINDOW = 8
"""Steps averaged at the start and at the end of a job to tell whether reward rose."""


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """Where the demo's tiny-arith model (SFT-warmed: it answers, badly) is built by the first job."""
    return tmp_path_factory.mktemp("demo_model") / "model"


def _spec(tmp_path, model, name: str, max_staleness: int):
    return jobspec.from_dict(
        {
            "name": name,
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(model), "build": "tiny-arith", "warmup_steps": 200},
            "dataset": {"name": "arith", "max_operand": 19},
            "reward": {"name": "arith", "format_weight": 0.1},
            "rollout": {"group_size": 8, "concurrency": 8, "sampling": {"max_new_tokens": 6}},
            "algorithm": {"lr": 2e-3, "groups_per_step": 8, "total_steps": STEPS},
            "buffer": {"max_staleness": max_staleness},
            "placement": "colocated",
        }
    )


def _rose(seen: list[dict]) -> tuple[float, float]:
    first = sum(p["reward_mean"] for p in seen[:WINDOW]) / WINDOW
    last = sum(p["reward_mean"] for p in seen[-WINDOW:]) / WINDOW
    return first, last


def test_colocated_sync_job_releases_the_engines_for_each_step_and_learns(tmp_path, demo_model):
    spec = _spec(tmp_path, demo_model, "colo-sync", 0)
    assert spec.bus.backend == "ipc" and spec.schedule == "sync"
    seen: list[dict] = []
    result = run_job(spec, on_progress=seen.append)

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


def test_colocated_async_job_keeps_both_resident_and_learns(tmp_path, demo_model):
    spec = _spec(tmp_path, demo_model, "colo-async", 1)
    assert spec.bus.backend == "ipc" and spec.schedule == "async"
    seen: list[dict] = []
    result = run_job(spec, on_progress=seen.append)

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
