"""Prefill batching under a steady stream: with the running batch nearly full, queued requests wait for an
eighth of the batch to be free (or `prefill_wait_steps` decode steps) instead of a prefill per freed slot;
outputs are the same either way. The engine's generation thread runs for real (CPU, tiny model); requests
are queued before it starts, so the order of steps is fixed and counted exactly."""

from __future__ import annotations

import pytest
from tiny_engine_model import build_noisy_model, greedy_reference

from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner
from generator_fleet.engine.runner_steps import PREFILL_BATCH_FRACTION

BATCH = 32
QUEUED = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "m"
    m, _ = build_noisy_model(path, seed=5)
    return path, m


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run(path, wait_steps: int, requests: list[tuple[list[int], int]], before=None) -> tuple[Runner, list]:
    """Queue every (prompt, tokens) request, then start the runner; returns it stopped with the outputs.
    `before(runner, reqs)` runs before they are queued."""
    runner = Runner(str(path), context_length=256, max_batch_size=BATCH, prefill_wait_steps=wait_steps)
    reqs = [Request(f"r{i}", p, greedy(n)) for i, (p, n) in enumerate(requests)]
    if before is not None:
        before(runner, reqs)
    futs = [runner.submit(r) for r in reqs]
    runner.start()
    try:
        outs = [f.result(120).output_ids for f in futs]
    finally:
        runner.stop()
    return runner, outs


def test_a_full_batch_admits_freed_slots_together_with_the_same_outputs(model):
    """A full batch whose requests finish one per step, with more queued: a prefill per finished request
    without batching (every other step), one per eighth of the batch with it; the tokens are the same."""
    path, m = model
    requests = [([3 + i % 12, 4 + i % 9], 4 + i) for i in range(BATCH)]
    requests += [([5 + i % 10, 6], 30) for i in range(QUEUED)]  # still running when the batch drains
    eager, eager_out = run(path, 0, requests)
    batched, batched_out = run(path, 1000, requests)
    assert eager_out == batched_out
    assert batched_out == [greedy_reference(m, p, n) for p, n in requests]
    share = BATCH // PREFILL_BATCH_FRACTION
    for r in (eager, batched):  # the first prefill fills the batch; later ones refill it
        assert r.stats.prefill_rows_total == BATCH + QUEUED
    # batched: each later prefill takes an eighth of the batch or the rest of the queue
    assert batched.stats.num_prefill_steps_total - 1 <= QUEUED // share
    # eager: a prefill as soon as a slot frees, one request each
    assert eager.stats.num_prefill_steps_total - 1 == QUEUED
    steps = lambda r: r.stats.num_prefill_steps_total + r.stats.num_decode_steps_total  # noqa: E731
    assert steps(batched) < steps(eager)


@pytest.mark.parametrize("wait_steps", [0, 5])
def test_a_queued_request_waits_at_most_prefill_wait_steps(model, wait_steps):
    """One slot frees after the first decode step and stays the only one: the queued requests (more than
    it holds) join after `prefill_wait_steps` decode steps since the last prefill, not later."""
    path, m = model
    requests = [([7, 8], 2)] + [([3 + i % 12, 5], 40) for i in range(BATCH - 1)]
    requests += [([9, 4 + i], 3) for i in range(BATCH // PREFILL_BATCH_FRACTION + 1)]
    joined: list[int] = []

    def watch_first_queued(runner: Runner, reqs: list[Request]) -> None:
        def first_token() -> None:
            if not joined:
                joined.append(runner.stats.num_decode_steps_total)

        reqs[BATCH].listener = first_token

    _, outs = run(path, wait_steps, requests, before=watch_first_queued)
    assert outs == [greedy_reference(m, p, n) for p, n in requests]
    # the short request finishes at decode step 1; its slot is filled then (0) or once the wait is over
    assert joined == [max(1, wait_steps)]
