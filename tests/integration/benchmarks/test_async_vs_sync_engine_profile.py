"""async_vs_sync --engine-profile-steps: the engine sampler asks a real engine (CPU, tiny model, started
with a profile directory as ExternalEngine starts it) for a profile of N steps once it has generated the
given number of tokens, and the engine writes the trace and summary there."""

from __future__ import annotations

import time

import http_calls
from tiny_engine_model import build_noisy_model

from benchmarks.async_vs_sync.measure import EngineSampler
from generator_fleet.engine import EngineServer

KEY = "sampler-profile-key"


def test_the_sampler_starts_a_profile_once_the_engine_generated_enough_tokens(tmp_path):
    model = tmp_path / "m"
    build_noisy_model(model, seed=5)
    profiles = tmp_path / "profiles"
    server = EngineServer(str(model), api_key=KEY, profile_dir=str(profiles)).start()
    sampler = EngineSampler(
        tmp_path, "job", 0.02, server.url, profile_steps=4, profile_after_tokens=16, api_key=KEY
    )
    try:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
        deadline = time.monotonic() + 60
        while not list(profiles.glob("*-summary.txt")) and time.monotonic() < deadline:
            r = http_calls.post(
                server.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert r.status_code == 200, r.text
        summaries = list(profiles.glob("*-summary.txt"))
        assert summaries and summaries[0].read_text().startswith("4 steps profiled")
        assert sampler.profile_started is not None
        assert max(tokens for _, _, tokens, _ in sampler.samples) >= 16
    finally:
        sampler.stop()
        server.stop()
