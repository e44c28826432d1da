"""Mini-batch PPO (algorithm.ppo_minibatches, ppo_epochs) on one CPU rank in float64: every optimizer step's
loss, clip fraction, gradients and learning rate, and the weights after the batch, match a padded-batch
reference of verl's / AReaL's mini-batch update (tests/harness/oracles.py minibatch_ppo) on the same mini-batches;
the clip acts from the second mini-batch on; the engines' logprobs serve as pi_prox on a fully on-policy
batch; one mini-batch is the one-step path; a spec asking for more mini-batches than a rank has samples is
refused at its key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import build_batch, lr_at, minibatch_loss, minibatch_ppo, response_logprobs, token_logprobs
from transformers import AutoModelForCausalLM

import jobspec
from replay_buffer import Sample, make_group
from trainer.batch import build_samples, loss_aggregation
from trainer.distributed import DistInfo, RankGroup
from trainer.learner import Learner
from trainer.packing import split_minibatches


def _spec(model_dir, **algorithm):
    alg = {
        "lr": 2e-2,
        "clip_eps": 0.05,
        "lr_schedule": "linear",
        "lr_warmup_steps": 1,
        "total_steps": 2,
        "groups_per_step": 4,
    }
    return jobspec.from_dict(
        {
            "model": {"path": str(model_dir)},
            "algorithm": alg | algorithm,
            "rollout": {"group_size": 3},
            "trainer": {"fsdp": False, "micro_batch_tokens": 24, "logprob_chunk_tokens": 16},
        }
    )


def _learner(spec) -> Learner:
    pool = RankGroup(DistInfo(0, 1, "127.0.0.1", 0), torch.device("cpu"))
    ln = Learner(
        spec.model, spec.algorithm, spec.trainer, pool, response_budget=spec.trainer_config().response_budget
    )
    ln.setup()
    ln.model.double()  # parameters converted in place: the optimizer holds the same tensors
    return ln


def _groups(model, noise: float, seed: int = 0):
    """4 groups of 3 samples of varied lengths with some context (tool) tokens; behaviour logprobs are the
    model's own plus `noise` (0: exactly the policy being trained, a fully on-policy batch)."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    groups = []
    for g in range(4):
        samples = []
        for i in range(3):
            prompt = rng.integers(3, vocab, size=int(rng.integers(3, 6))).tolist()
            response = rng.integers(3, vocab, size=int(rng.integers(3, 9))).tolist()
            mask = (rng.random(len(response)) > 0.2).astype(int)
            mask[0] = 1
            with torch.no_grad():
                lp = response_logprobs(model, prompt, response).numpy()
            behav = (lp + noise * rng.normal(size=len(response))) * mask
            samples.append(
                Sample.build(
                    prompt_ids=prompt,
                    response_ids=response,
                    loss_mask=mask.tolist(),
                    behavior_logprobs=behav.tolist(),
                    token_versions=[0] * len(response),
                    reward=float(i == g % 3),
                    finish_reason="stop",
                )
            )
        groups.append(make_group("t", f"p{g}", samples))
    return groups


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    return lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()


def _train(ln: Learner, spec, groups, on_policy: bool = False):
    """One batch through the learner; (stats, [(weights, gradients)] as each optimizer step found them)."""
    seen = []

    def before_step(opt, args, kwargs):
        params = opt.param_groups[0]["params"]
        seen.append(([p.detach().clone() for p in params], [p.grad.detach().clone() for p in params]))

    handle = ln.opt.register_step_pre_hook(before_step)
    alg = spec.algorithm
    samples = build_samples(
        groups, alg.advantage, *loss_aggregation(alg, spec.trainer_config().response_budget)
    )
    stats = ln.train_step(ln.distribute(samples), on_policy=on_policy)
    handle.remove()
    return stats, seen, [len(s) for s in samples]


def _assert_matches_reference(ln, spec, stats, seen, groups, parts, make_model, prox=None) -> None:
    """Each optimizer step's loss, clip fraction, gradient and lr against minibatch_loss at the weights
    that step started from; then the whole batch's updates against minibatch_ppo from the start."""
    alg = spec.algorithm
    batch = build_batch(groups, pad_id=0)
    ref = make_model()
    if prox is None:
        with torch.no_grad():
            prox = token_logprobs(ref, batch.input_ids, batch.attention_mask)
    assert len(ln.update_stats) == len(seen) == stats["optimizer_steps"] == len(parts) * alg.ppo_epochs
    for u, (mine, (weights, grads)) in enumerate(zip(ln.update_stats, seen, strict=True)):
        with torch.no_grad():
            for p, w in zip(ref.parameters(), weights, strict=True):
                p.copy_(w)
        ref.zero_grad(set_to_none=True)
        r = minibatch_loss(ref, batch, parts[u % len(parts)], prox, alg)
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in r["grads"]])))
        # the product's fp32 token weights (1/tokens rounded, 6e-8 relative) on terms of |A| ratio <~ 2
        assert mine["loss"] == pytest.approx(r["loss"], rel=1e-6, abs=3e-7), u
        assert mine["clip_fraction"] == pytest.approx(r["clip_fraction"], abs=1e-7), u  # same tokens
        assert mine["grad_norm"] == pytest.approx(norm, rel=1e-6), u
        assert mine["lr"] == pytest.approx(lr_at(u, alg), rel=1e-12), u
        coef = min(1.0, alg.max_grad_norm / (norm + 1e-6))  # the step's gradients are clipped ones
        for g, want in zip(grads, r["grads"], strict=True):
            # token weights are fp32 on the product's side (1/tokens rounded): 1e-6 of the gradient's scale
            torch.testing.assert_close(g, want * coef, rtol=1e-6, atol=1e-6 * float(want.abs().max()) * coef)
    # The optimizer's part: AdamW fed the gradients checked above, one step each at its lr, its state
    # carried across the mini-batches, lands on the learner's weights.
    ref = make_model()
    params = list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=alg.lr, weight_decay=alg.weight_decay)
    for u, (_, grads) in enumerate(seen):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr_at(u, alg)
        opt.step()
    for (name, p), r in zip(ln.model.named_parameters(), params, strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-12, atol=1e-15, msg=name)
    # and the whole reference update from the start follows the same losses (Adam's first steps move a
    # weight by about lr whatever its gradient's size, so the fp32 roundings above grow to ~1e-5 here)
    whole = minibatch_ppo(make_model(), batch, parts, alg, prox=prox)
    assert [u["loss"] for u in ln.update_stats] == pytest.approx([u["loss"] for u in whole], rel=1e-3)


def test_each_minibatch_step_matches_the_reference_and_the_clip_acts(tiny_model_dir, reference_model):
    spec = _spec(tiny_model_dir, ppo_minibatches=2, ppo_epochs=2)
    ln = _learner(spec)
    groups = _groups(ln.model, noise=0.3)
    stats, seen, lengths = _train(ln, spec, groups)
    parts = split_minibatches(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(12)) and all(parts)
    _assert_matches_reference(ln, spec, stats, seen, groups, parts, reference_model)

    clips = [u["clip_fraction"] for u in ln.update_stats]
    assert clips[0] == 0.0  # the first optimizer step's policy is pi_prox itself: every ratio is 1
    assert all(c > 0 for c in clips[1:]), clips  # later mini-batches see the moved policy, and the clip acts
    assert stats["clip_fraction"] > 0 and stats["clip_fraction_last"] == clips[-1]
    assert stats["prox_source"] == "recompute" and stats["optimizer_steps"] == 4
    assert stats["ratio_min"] < 1.0 < stats["ratio_max"]
    assert stats["loss"] == pytest.approx(sum(u["loss"] for u in ln.update_stats) / 4, rel=1e-12)
    assert (stats["loss_first"], stats["loss_last"]) == (
        ln.update_stats[0]["loss"],
        ln.update_stats[-1]["loss"],
    )
    assert stats["lr"] == ln.update_stats[-1]["lr"] and ln.lr_step == 4
    # the schedule spans total_steps x 4 = 8 optimizer steps: 1 of warmup, then linear decay over 7
    assert [u["lr"] for u in ln.update_stats] == pytest.approx([2e-2 * f for f in (1.0, 1.0, 6 / 7, 5 / 7)])
    assert stats["trained_tokens"] == sum(int(s.view("loss_mask").sum()) for g in groups for s in g.samples)


def test_engine_logprobs_are_pi_prox_on_a_fully_on_policy_batch(tiny_model_dir, reference_model):
    spec = _spec(tiny_model_dir, ppo_minibatches=3)
    ln = _learner(spec)
    groups = _groups(ln.model, noise=0.0)  # the engines sampled with exactly these weights
    stats, seen, lengths = _train(ln, spec, groups, on_policy=True)
    assert stats["prox_source"] == "engine" and stats["optimizer_steps"] == 3
    # the reference anchors on the same engine logprobs (stored in fp32), not on a forward pass of its own
    prox = build_batch(groups, pad_id=0).behav_logprobs.double()
    _assert_matches_reference(
        ln, spec, stats, seen, groups, split_minibatches(lengths, 3), reference_model, prox
    )
    assert ln.update_stats[0]["clip_fraction"] == 0.0 and stats["clip_fraction"] > 0


def test_one_minibatch_is_the_one_step_path(tiny_model_dir, reference_model):
    spec = _spec(tiny_model_dir)
    ln = _learner(spec)
    groups = _groups(ln.model, noise=0.3)
    stats, seen, lengths = _train(ln, spec, groups, on_policy=True)
    # one optimizer step: pi_prox is that step's own forward pass, whatever the batch's versions say
    assert stats["prox_source"] == "current" and stats["optimizer_steps"] == 1
    assert (
        stats["clip_fraction"] == 0.0
        and stats["ratio_mean"] == stats["ratio_min"] == stats["ratio_max"] == 1.0
    )
    _assert_matches_reference(ln, spec, stats, seen, groups, [list(range(len(lengths)))], reference_model)
    assert (
        stats["loss"] == ln.update_stats[0]["loss"] and stats["grad_norm"] == ln.update_stats[0]["grad_norm"]
    )


def test_more_minibatches_than_samples_per_rank_is_refused_at_the_key(tiny_model_dir):
    base = {"model": {"path": str(tiny_model_dir)}, "rollout": {"group_size": 2}}
    ok = jobspec.from_dict(
        base | {"algorithm": {"groups_per_step": 2, "ppo_minibatches": 2}, "trainer": {"num_trainers": 2}}
    )
    assert ok.algorithm.ppo_minibatches == 2
    with pytest.raises(
        jobspec.JobSpecError,
        match=r"3 mini-batches exceed the 2 samples per trainer rank.*algorithm\.ppo_minibatches",
    ):
        jobspec.from_dict(
            base | {"algorithm": {"groups_per_step": 2, "ppo_minibatches": 3}, "trainer": {"num_trainers": 2}}
        )
    with pytest.raises(jobspec.JobSpecError, match="ppo_epochs"):
        jobspec.from_dict(base | {"algorithm": {"ppo_epochs": 0}})
