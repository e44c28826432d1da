"""The engine's step-delay testing hook (SLIPSTREAM_ENGINE_STEP_DELAY_S): with it set, the generation thread
waits that long after every step it runs, and nowhere else; unset, it never waits; a bad value fails the
engine's start with the variable's name."""

from __future__ import annotations

import time

import httpx
import pytest

from generator_fleet.engine import EngineServer
from generator_fleet.engine import runner as runner_mod
from generator_fleet.engine.faults import STEP_DELAY_ENV, step_delay_s

DELAY_S = 0.0123
GENERATE = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


def _generate_and_count(model_dir, monkeypatch, delay: str | None) -> tuple[list[float], int]:
    """The sleeps the runner's module asked for while one request generated, and the steps it ran."""
    if delay is None:
        monkeypatch.delenv(STEP_DELAY_ENV, raising=False)
    else:
        monkeypatch.setenv(STEP_DELAY_ENV, delay)
    server = EngineServer(str(model_dir)).start()
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(runner_mod.time, "sleep", sleep)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/generate", json=GENERATE)
            assert r.status_code == 200, r.text
        stats = server.runner.stats
        steps = stats.num_prefill_steps_total + stats.num_decode_steps_total
    finally:
        # the answer can come back before the wait after the last step: stop() joins the generation
        # thread, so that wait is counted too (monkeypatch puts the real sleep back after the test)
        server.stop()
    return slept, steps


def test_each_generation_step_waits_the_delay(tiny_model_dir, monkeypatch):
    slept, steps = _generate_and_count(tiny_model_dir, monkeypatch, str(DELAY_S))
    assert steps >= 2  # a prefill and decodes
    assert slept.count(DELAY_S) == steps, (slept, steps)


def test_without_the_variable_no_step_waits(tiny_model_dir, monkeypatch):
    slept, steps = _generate_and_count(tiny_model_dir, monkeypatch, None)
    assert steps >= 2 and DELAY_S not in slept
    monkeypatch.setenv(STEP_DELAY_ENV, "0")
    assert step_delay_s() == 0.0


@pytest.mark.parametrize("bad", ["fast", "-0.1", "11", "nan"])
def test_a_bad_delay_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(STEP_DELAY_ENV, bad)
    with pytest.raises(ValueError, match=STEP_DELAY_ENV):
        step_delay_s()
