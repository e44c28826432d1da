"""Prefill under a steady stream: with the running batch nearly full, queued requests wait for an eighth of
the batch to be free (or `prefill_wait_steps` decode steps) instead of a prefill per freed slot; identical
prompts in one prefill (a group's samples) are computed once. Outputs are the same either way. The engine's generation thread runs for real (CPU, tiny model); requests
are queued before it starts, so the order of steps is fixed and counted exactly."""

from __future__ import annotations

import pytest
from tiny_engine_model import build_noisy_model, greedy_reference
from tiny_engine_model import greedy_params as greedy

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


def test_a_groups_identical_prompts_are_computed_once_with_the_same_tokens_and_logprobs(model):
    """Eight samples of one prompt and two others in one prefill: the seven copies take the first one's
    K/V; greedy outputs equal the reference, and input logprobs and seeded samples equal those of the
    prompt computed alone."""
    path, m = model
    prompt, other = [4, 9, 6, 11, 3], [5, 7, 7]
    runner = Runner(str(path), context_length=256, max_batch_size=BATCH)
    greedy_rows = [Request(f"g{i}", prompt, greedy(6)) for i in range(8)] + [Request("o", other, greedy(6))]
    logprob_rows = [
        Request(f"l{i}", prompt, greedy(1), return_logprob=True, logprob_start_len=0) for i in range(2)
    ]
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=7, ignore_eos=True)
    seeded_rows = [Request(f"s{i}", other, seeded) for i in range(2)]
    reqs = greedy_rows + logprob_rows + seeded_rows
    futs = [runner.submit(r) for r in reqs]
    runner.start()
    try:
        outs = [f.result(120) for f in futs]
        alone = runner.submit(Request("alone", prompt, greedy(1), return_logprob=True, logprob_start_len=0))
        alone = alone.result(60)
    finally:
        runner.stop()
    assert runner.stats.num_prefill_steps_total == 2  # the batch, then `alone`
    # shared: 7 + 2 copies of `prompt`, 2 of `other` (the two seeded rows after the greedy one)
    assert runner.stats.prefill_shared_tokens_total == 9 * len(prompt) + 2 * len(other)
    for c in outs[:8]:
        assert c.output_ids == greedy_reference(m, prompt, 6)
    assert outs[8].output_ids == greedy_reference(m, other, 6)
    for c in outs[9:11]:
        # another batch shape, so other fp32 reduction orders: ~1e-5 relative on logprobs of magnitude ~10
        assert c.input_logprobs == pytest.approx(alone.input_logprobs, abs=2e-4)
        assert c.output_ids == alone.output_ids
    assert outs[11].output_ids == outs[12].output_ids  # the same seed draws the same tokens
