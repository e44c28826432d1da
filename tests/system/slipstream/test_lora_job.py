"""A LoRA job end to end on CPU (`model.lora`): the demo's a+b task on the SFT-warmed tiny model, a
built-in engine started with the adapter's shape and serving its untrained version from the start, the
trainer training the adapter only and publishing it alone over the gloo bus (the engine keeps its base
weights), rollouts on the adapter (`lora_path`), real Redis, Ray and HTTP. Reward rises."""

import pytest
from test_colocated_job import WARMUP, Scraper, _rose

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray

STEPS = 30


def test_lora_job_publishes_the_adapter_only_and_learns(tmp_path, demo_model):
    tmp = tmp_path
    spec = jobspec.from_dict(
        {
            "name": "lora-job",
            "output_dir": str(tmp / "run"),
            "model": {
                "path": str(demo_model),
                "build": "tiny-arith",
                "warmup_steps": 100,
                "lora": {"rank": 8, "alpha": 16},
            },
            "dataset": {"name": "arith", "max_operand": 4},
            "reward": {"name": "arith", "format_weight": 0.1},
            "rollout": {"group_size": 8, "concurrency": 8, "sampling": {"max_new_tokens": 6}},
            "algorithm": {"lr": 3e-3, "lr_warmup_steps": WARMUP, "groups_per_step": 8, "total_steps": STEPS},
            "buffer": {"max_staleness": 1},
            "generators": {"num_engines": 1},
        }
    )
    assert spec.bus.backend == "gloo" and spec.model.lora.name == "policy"
    scraper = Scraper(spec)
    result = run_job(spec, on_progress=scraper)
    seen = scraper.seen

    assert result.version == STEPS and [p["version"] for p in seen] == list(range(1, STEPS + 1))
    assert any(p["publish_s"] > 0 for p in seen)
    first, last = _rose(seen)
    assert last > first + 0.05, (first, last, [round(p["reward_mean"], 2) for p in seen])
    # what the processes counted: every publish was the adapter alone, over the group
    assert scraper.samples, "the job's metrics were not read"
    adapter = scraper.value("trainer-0", "slipstream_trainer_lora_adapter_bytes")
    assert adapter > 0
    assert (
        scraper.value("trainer-0", "slipstream_bus_adapter_updates_total", backend="gloo", path="group") >= 3
    )
    assert scraper.value("trainer-0", "slipstream_bus_last_update_bytes", kind="adapter") == adapter
    assert scraper.value("trainer-0", "slipstream_bus_last_update_bytes", kind="full") == 0
    # the engine replaced its adapter from the group at each publish and served rollouts on it
    assert scraper.value("engine-0", "slipstream_engine_lora_ops_total", op="update", outcome="ok") >= 3
    log = (tmp / "run" / "logs" / "trainer-0.log").read_text()
    assert "(adapter 'policy' only, group)" in log
    engine_log = (tmp / "run" / "logs" / "engine-0.log").read_text()
    assert "serves the untrained adapter 'policy' at version 0" in engine_log


def test_colocated_lora_job_hands_the_adapter_over_shared_memory(tmp_path, tiny_model_dir):
    """`placement: colocated` (sync schedule, ipc bus): the engine releases its memory for each step and
    gets the adapter back through /load_lora_adapter_from_tensors, its base weights restored as they were."""
    spec = jobspec.from_dict(
        {
            "name": "lora-colo",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir), "lora": {"rank": 4}},
            "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
            "algorithm": {"groups_per_step": 2, "total_steps": 3},
            "buffer": {"max_staleness": 0},
            "placement": "colocated",
        }
    )
    assert spec.bus.backend == "ipc" and spec.schedule == "sync"
    scraper = Scraper(spec, at_version=2)
    result = run_job(spec, on_progress=scraper)
    assert result.version == 3
    for p in scraper.seen:
        assert p["released_engines"] == 1 and p["resumed_engines"] == 1 and p["publish_s"] > 0
        assert p["staleness_max"] == 0
    assert scraper.value("trainer-0", "slipstream_bus_adapter_updates_total", backend="ipc", path="ipc") >= 2
    adapter = scraper.value("trainer-0", "slipstream_trainer_lora_adapter_bytes")
    assert scraper.value("trainer-0", "slipstream_bus_last_update_bytes", kind="adapter") == adapter > 0
    assert (
        scraper.value("engine-0", "slipstream_engine_lora_ops_total", op="load_from_tensors", outcome="ok")
        >= 2
    )
    log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    assert "(adapter 'policy' only, ipc)" in log
