"""The trainer computes logprobs at the sampling temperature each record says its samples were
generated with, not at any job-wide setting: a record whose behaviour logprobs are the policy's own at
temperature T trains with zero behaviour/trainer logprob gap exactly when the trainer also uses T."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import response_logprobs

import jobspec
from replay_buffer import Sample, make_group
from replay_buffer.schema import decode, encode
from trainer.batch import build_samples
from trainer.distributed import DistInfo, RankGroup
from trainer.learner import Learner


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    torch.manual_seed(0)
    spec = jobspec.from_dict(
        {
            "model": {"path": str(tiny_model_dir)},
            # lr so small that the steps below leave the policy as it was (every step measures it)
            "algorithm": {"lr": 1e-12, "max_grad_norm": 1e-12},
            "trainer": {"fsdp": False, "micro_batch_tokens": 64, "logprob_chunk_tokens": 8},
        }
    )
    ln = Learner(
        spec.model,
        spec.algorithm,
        spec.trainer,
        RankGroup(DistInfo(0, 1, "127.0.0.1", 0), torch.device("cpu")),
    )
    ln.setup()
    return ln


def _group(model, vocab: int, temperature: float | None, behav_temperature: float, seed: int):
    """A group of 3 samples whose behaviour logprobs are `model`'s at `behav_temperature`, recorded as
    generated at `temperature` (None: a record written before samples carried one)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(3):
        prompt = rng.integers(3, vocab, size=4).tolist()
        response = rng.integers(3, vocab, size=5 + i).tolist()
        with torch.no_grad():
            behav = response_logprobs(model, prompt, response, behav_temperature).tolist()
        extra = {} if temperature is None else {"temperature": temperature}
        samples.append(
            Sample.build(
                prompt_ids=prompt,
                response_ids=response,
                loss_mask=[1] * len(response),
                behavior_logprobs=behav,
                token_versions=[0] * len(response),
                reward=float(i),
                finish_reason="stop",
                **extra,
            )
        )
    return decode(encode(make_group("j", f"p{seed}", samples)))


def _gap(learner, groups) -> float:
    stats = learner.train_step(learner.distribute(build_samples(groups)))
    return stats["logprob_diff_mean"]


def test_logprobs_use_the_records_temperature(learner):
    model, vocab = learner.model, learner.config.vocab_size
    assert _gap(learner, [_group(model, vocab, 0.5, 0.5, seed=1)]) < 1e-5
    assert _gap(learner, [_group(model, vocab, 2.0, 2.0, seed=2)]) < 1e-5
    # the same tokens and behaviour logprobs, but recorded as sampled at 1.0: the trainer's differ
    assert _gap(learner, [_group(model, vocab, 1.0, 0.5, seed=1)]) > 0.01
    # an old record (no temperature) is trained at the documented default, 1.0
    assert _gap(learner, [_group(model, vocab, None, 1.0, seed=3)]) < 1e-5
    assert _gap(learner, [_group(model, vocab, None, 0.5, seed=3)]) > 0.01


def test_a_batch_mixing_temperatures_uses_each_samples_own(learner):
    model, vocab = learner.model, learner.config.vocab_size
    groups = [_group(model, vocab, 0.5, 0.5, seed=4), _group(model, vocab, 2.0, 2.0, seed=5)]
    mbs = learner.distribute(build_samples(groups))
    assert sorted(mb.temperature for mb in mbs) == [0.5, 2.0]  # one temperature per micro-batch
    assert _gap(learner, groups) < 1e-5
