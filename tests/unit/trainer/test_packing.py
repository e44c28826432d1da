"""Sequence packing: layout, the rank/micro-batch plan, and packed logprobs equal unpacked ones."""

import numpy as np
import pytest
import torch
from oracles import build_batch, policy_loss, token_logprobs
from sample_pair import sample_pair_group
from transformers import AutoModelForCausalLM, Qwen2Config

from trainer import attention
from trainer.batch import build_samples
from trainer.logprobs import packed_logprobs
from trainer.packing import TrainSample, first_fit_decreasing, pack, plan_step, split_minibatches


def _sample(ids, mask, behav=None, adv=0.0, w=1.0):
    n = len(ids)
    behav = behav if behav is not None else [-0.5] * n
    return TrainSample(
        np.array(ids, np.int64), np.array(mask, np.float32), np.array(behav, np.float32), adv, w, 0.0
    )


def test_pack_layout_hand_checked():
    a = _sample([1, 5, 6, 7], [0, 1, 1, 0], adv=2.0, w=0.5)
    b = _sample([1, 9, 8], [1, 1, 0], adv=-1.0, w=0.25)
    mb = pack([a, b])
    assert mb.input_ids.tolist() == [[1, 5, 6, 7, 1, 9, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.max_seqlen == 4
    # targets shift within a sample; the last position of each sample predicts nothing
    assert mb.targets.tolist() == [5, 6, 7, 0, 9, 8, 0]
    assert mb.loss_mask.tolist() == [0, 1, 1, 0, 1, 1, 0]
    assert mb.advantages.tolist() == [2, 2, 2, 2, -1, -1, -1]
    assert mb.token_weights.tolist() == [0, 0.5, 0.5, 0, 0.25, 0.25, 0]
    assert mb.behav_logprobs.tolist() == [0, -0.5, -0.5, 0, -0.5, -0.5, 0]
    empty = pack([])
    assert empty.num_tokens == 1 and empty.token_weights.sum() == 0


def test_build_samples_align_with_padded_batch():
    groups = [sample_pair_group()]
    padded = build_batch(groups, pad_id=0)
    samples = build_samples(groups, "grpo", "token-mean")
    for i, s in enumerate(samples):
        n = len(s)
        assert s.input_ids.tolist() == padded.input_ids[i, :n].tolist()
        assert s.loss_mask[: n - 1].tolist() == padded.loss_mask[i, : n - 1].tolist()
        assert s.behav_logprobs[: n - 1].tolist() == padded.behav_logprobs[i, : n - 1].tolist()
        assert s.advantage == pytest.approx(float(padded.advantages[i][padded.loss_mask[i] > 0][0]))
        assert s.weight == pytest.approx(1 / 4)  # token-mean over the batch's 4 model tokens


def test_plan_step_covers_every_sample_once_and_balances_ranks():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, size=37).tolist()
    plan = plan_step(lengths, world=3, budget=600)
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(37))
    assert len({len(rank) for rank in plan}) == 1  # same number of micro-batches on every rank
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= 600
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)
    # a sample longer than the budget still gets a micro-batch of its own
    assert first_fit_decreasing([50, 900, 40], 100) == [[1], [0, 2]]
    # fewer samples than ranks: the idle rank gets empty micro-batches
    idle = plan_step([5], world=2, budget=100)
    assert sorted(len(mb) for rank in idle for mb in rank) == [0, 1]


@pytest.fixture(scope="module")
def gqa_model():
    cfg = Qwen2Config(
        vocab_size=40,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_packed_logprobs_equal_unpacked(gqa_model):
    rng = np.random.default_rng(1)
    samples = []
    for n in (7, 12, 3, 20):
        mask = (rng.random(n) > 0.3).astype(np.float32)
        samples.append(_sample(rng.integers(3, 40, size=n).tolist(), mask.tolist()))
    mb = pack(samples)
    attention.register()
    gqa_model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    try:
        with torch.no_grad():
            packed, ent = packed_logprobs(gqa_model, mb, temperature=0.7, entropy="no_grad")
    finally:
        gqa_model.set_attn_implementation("sdpa")
    start = 0
    for s in samples:
        n = len(s)
        ids = torch.from_numpy(s.input_ids).unsqueeze(0)
        with torch.no_grad():
            ref = token_logprobs(gqa_model, ids, torch.ones_like(ids), temperature=0.7)[0]
        m = torch.from_numpy(s.loss_mask[: n - 1]) > 0
        got = packed[start : start + n - 1]
        torch.testing.assert_close(got[m], ref[m], rtol=0, atol=1e-5)
        assert (got[~m] == 0).all()
        start += n
    assert ent is not None and (ent[mb.loss_mask > 0] > 0).all()


def test_packed_loss_gradient_equals_padded_batch_gradient(gqa_model):
    """The trainer's packed loss (per-token loss x aggregation weight, summed over micro-batches) has the
    same value and gradient as the padded-batch policy loss with agg_loss over the same samples."""
    from trainer.losses import agg_weights, policy_loss_terms

    rng = np.random.default_rng(2)
    lens = (9, 4, 15, 7, 11)
    masks = [(rng.random(n) > 0.4).astype(np.float32) for n in lens]
    for m in masks:
        m[-1] = 0.0  # the last position predicts nothing
        m[0] = 1.0
    weights = agg_weights([int(m.sum()) for m in masks], "seq-mean-token-mean")
    samples = [
        TrainSample(
            rng.integers(3, 40, size=n).astype(np.int64),
            m,
            (-rng.random(n) * m).astype(np.float32),
            float(rng.standard_normal()),
            w,
            0.0,
        )
        for n, m, w in zip(lens, masks, weights, strict=True)
    ]
    attention.register()
    params = dict(gqa_model.named_parameters())

    gqa_model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    gqa_model.zero_grad()
    total = 0.0
    for mb in (pack(samples[:2]), pack(samples[2:])):  # two micro-batches, gradients accumulate
        lp, _ = packed_logprobs(gqa_model, mb)
        t = policy_loss_terms(
            lp, lp.detach(), mb.behav_logprobs, mb.advantages, "decoupled_ppo", dual_clip_c=3.0
        )
        loss = (t.loss * mb.token_weights).sum()
        loss.backward()
        total += float(loss.detach())
    packed_grads = {k: p.grad.clone() for k, p in params.items()}

    gqa_model.set_attn_implementation("sdpa")
    gqa_model.zero_grad()
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    attn = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width - 1)
    behav = torch.zeros(len(lens), width - 1)
    adv = torch.zeros(len(lens), width - 1)
    for i, s in enumerate(samples):
        n = len(s)
        ids[i, :n] = torch.from_numpy(s.input_ids)
        attn[i, :n] = 1
        mask[i, : n - 1] = torch.from_numpy(s.loss_mask[: n - 1])
        behav[i, : n - 1] = torch.from_numpy(s.behav_logprobs[: n - 1])
        adv[i] = s.advantage
    lp = token_logprobs(gqa_model, ids, attn)
    ref, _ = policy_loss(
        lp, lp.detach(), behav, adv, mask, "decoupled_ppo", agg="seq-mean-token-mean", dual_clip_c=3.0
    )
    ref.backward()
    assert total == pytest.approx(float(ref.detach()), rel=1e-5)
    for k, p in params.items():
        torch.testing.assert_close(packed_grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_minibatches_partition_the_batch_balanced_by_tokens():
    lengths = [30, 5, 12, 12, 7, 40, 3, 9, 22, 14]
    assert split_minibatches(lengths, 1) == [list(range(10))]  # one mini-batch: the batch in order
    parts = split_minibatches(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(10)) and all(p == sorted(p) for p in parts)
    # longest first, each to the lightest (ties: fewer samples): 40 30 22 open the three; 14 -> 22 (36),
    # 12 -> 30 (42), 12 -> 36 (48), 9 -> 40 (49), 7 -> 42 (49), 5 -> 48 (53), 3 -> the 49 of 2 samples (52)
    assert parts == [[5, 6, 7], [0, 2, 4], [1, 3, 8, 9]]
    assert [sum(lengths[i] for i in p) for p in parts] == [52, 49, 53]
    assert all(split_minibatches([4, 4, 4], 3))  # at least as many samples as mini-batches: none empty
    with pytest.raises(ValueError):
        split_minibatches(lengths, 0)
