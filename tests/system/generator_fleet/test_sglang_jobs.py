"""Jobs on SGLang engines: `slipstream run` with engine: sglang (the shim, tests/harness/sglang_shim.py,
through `sglang.python`) behind a router, and a LoRA job on SGLang engines that serves its adapter from the
first request."""

from __future__ import annotations

import json
import sys

import pytest
from fake_router import FakeRouter
from sglang_env import install_shim

from generator_fleet.launch import is_healthy

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


def test_job_with_sglang_engines_behind_a_router(tmp_path, tiny_model_dir):
    """`slipstream run` with engine: sglang and a router: the fleet launches the server (here the shim,
    through `sglang.python`, as for SGLang in its own venv), adds it to the router, sends rollouts through
    the router and weight updates straight to the engine, and stops it at the end."""
    import jobspec
    from slipstream.job.local import run_job

    python = tmp_path / "python-with-sglang"
    env = install_shim(tmp_path / "shim")
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    router = FakeRouter()
    try:
        spec = jobspec.from_dict(
            {
                "name": "sglang-e2e",
                "output_dir": str(tmp_path / "run"),
                "model": {"path": str(tiny_model_dir)},
                "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
                "generators": {
                    "engine": "sglang",
                    "router_url": router.url,
                    "sglang": {"python": str(python), "gpus_per_engine": 0, "skip_server_warmup": True},
                },
                "algorithm": {"groups_per_step": 2, "total_steps": 2},
                "buffer": {"max_staleness": 0},
            }
        )
        result = run_job(spec)
    finally:
        router.stop()
    assert result.version == 2
    [engine_url] = router.added
    assert router.workers == {}  # removed when the job ended
    # On-policy: step 2 trained on groups generated at version 1, which only a weight update sent to the
    # engine itself (the router forwards none) can have produced; they came back through the router.
    assert "0" in router.versions and "1" in router.versions
    log_text = (tmp_path / "run" / "logs" / "sglang-0.log").read_text()
    assert "SHIM_ARGS" in log_text and "--api-key ***" in log_text
    assert not is_healthy(engine_url)  # stopped with the job


def test_lora_job_on_sglang_engines_serves_its_adapter_from_the_start(tmp_path, tiny_model_dir):
    """A LoRA job with engine: sglang (the shim, through `sglang.python`): the server starts with the zero
    adapter (--lora-paths), rollouts name it from the first request, and the job's publishes replace it."""
    import jobspec
    from slipstream.job.local import run_job

    python = tmp_path / "python-with-sglang"
    env = install_shim(tmp_path / "shim")
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    spec = jobspec.from_dict(
        {
            "name": "sglang-lora",
            "output_dir": str(tmp_path / "run"),
            "model": {
                "path": str(tiny_model_dir),
                "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
            },
            "rollout": {"group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 4}},
            "generators": {
                "engine": "sglang",
                "sglang": {"python": str(python), "gpus_per_engine": 0, "skip_server_warmup": True},
            },
            "algorithm": {"groups_per_step": 2, "total_steps": 2},
            "buffer": {"max_staleness": 0},
            "bus": {"pause_mode": "abort"},
        }
    )
    result = run_job(spec)
    assert result.version == 2
    untrained = tmp_path / "run" / "lora" / "untrained-0"
    assert json.loads((untrained / "adapter_config.json").read_text())["r"] == 4
    log_text = (tmp_path / "run" / "logs" / "sglang-0.log").read_text()
    assert f"policy={untrained}" in log_text  # --lora-paths
    trainer_log = (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
    assert "published version 2 (adapter 'policy' only" in trainer_log
