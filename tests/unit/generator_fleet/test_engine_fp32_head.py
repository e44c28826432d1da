"""fp32 LM head: on a bf16 model the engine's logprobs move closer to the fp32 model's; on an fp32 model the
option changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_engine_model import build_noisy_model, greedy_reference

from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner

CONTEXT = 256
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [5, 9, 3]]
N = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32head") / "m"
    m, _ = build_noisy_model(path, seed=11)
    return path, m


def run(path, dtype, fp32_lm_head: bool) -> list:
    r = Runner(str(path), dtype=dtype, context_length=CONTEXT, max_batch_size=8, fp32_lm_head=fp32_lm_head)
    r.start()
    try:
        params = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
        futs = [r.submit(Request(f"r{i}", p, params)) for i, p in enumerate(PROMPTS)]
        return [f.result(120) for f in futs]
    finally:
        r.stop()


def reference_logprobs(m, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The engine's bf16 weights computed in fp32, no cache: logprob of each output token given everything
    before it (so the difference is the engine's arithmetic, not the weights' rounding)."""
    ids = torch.tensor([prompt + output])
    ref = copy.deepcopy(m).to(torch.bfloat16).float()
    with torch.no_grad():
        lp = torch.log_softmax(ref(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return lp[pos, torch.tensor(output)]


def test_fp32_head_brings_bf16_logprobs_closer_to_the_fp32_reference(model):
    path, m = model
    diffs = {}
    for fp32 in (False, True):
        outs = run(path, torch.bfloat16, fp32)
        # Score the engine's own tokens under the fp32 model: the same tokens, so only precision differs.
        d = [
            (torch.tensor(c.output_logprobs[:N]) - reference_logprobs(m, p, c.output_ids)).abs()
            for p, c in zip(PROMPTS, outs, strict=True)
        ]
        diffs[fp32] = float(torch.cat(d).mean())
    print(f"mean |engine - fp32 ref| logprob: bf16 head {diffs[False]:.5f}, fp32 head {diffs[True]:.5f}")
    assert 0 < diffs[True] < diffs[False]


def test_fp32_head_leaves_an_fp32_model_unchanged(model):
    path, m = model
    plain, fp32 = run(path, torch.float32, False), run(path, torch.float32, True)
    assert [c.output_ids for c in plain] == [c.output_ids for c in fp32]
    assert [c.output_ids for c in fp32] == [greedy_reference(m, p, N) for p in PROMPTS]
    assert [c.output_logprobs for c in plain] == [c.output_logprobs for c in fp32]
