"""The trainer's fp32 LM head (trainer.fp32_lm_head): with the engines' fp32 head it cuts the trainer/engine
logprob mismatch on a bf16 model, its gradients reach the (tied) head weight as an fp32 model's do, under
FSDP2 too, and an fp32 model is unchanged.

The mismatch test runs the built-in engine's Runner (bf16, with and without its fp32 head) and the trainer's
packed_logprobs on the engine's sampled tokens, over several small models: a shallow trunk with LM-sized
logits (norm scaled so logits have std ~10), where the head's bf16 rounding is a visible part of the gap.
The trainer runs both ways it runs on a GPU: with bf16 parameters (FSDP2's bf16 compute copy) and as an
fp32 model under bf16 autocast (one rank without FSDP).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from rank_runs import start_ranks
from transformers import AutoModelForCausalLM

from common.net import free_port
from generator_fleet.engine.request import Request, SamplingParams
from generator_fleet.engine.runner import Runner
from generator_fleet.tasks.arith import ALPHABET, ArithTask
from model_zoo.tiny import build, save
from trainer import attention
from trainer.logprobs import fp32_logits, head_logprobs, packed_logprobs
from trainer.packing import TrainSample, pack

SEEDS = range(32)
"""Models the mismatch is pooled over: per model it varies by +-10% either way; pooled over 32, the fp32
heads' cut is ~6%."""
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [5, 9, 3], [4, 4, 4], [12, 3, 7, 9, 2], [6, 5]]
N = 32
NOISE_STD = 0.05
NORM_SCALE = 16.0


@pytest.fixture
def one_thread():
    """Reproducible CPU arithmetic: one intra-op thread (the reduction order of matmuls depends on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(path, seed: int, layers: int = 1):
    """A tiny tied-embedding model (arith tokenizer) with random weights, its logits scaled to LM size."""
    corpus = [f"{p.prompt}{p.answer}" for p in ArithTask().problems]
    model, tok = build(path, ALPHABET, corpus, seed=seed, layers=layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * NOISE_STD)
        model.model.norm.weight.mul_(NORM_SCALE)
    save(path, model, tok)
    return model


def _engine(path, fp32_lm_head: bool) -> list:
    r = Runner(
        str(path), dtype=torch.bfloat16, context_length=128, max_batch_size=8, fp32_lm_head=fp32_lm_head
    )
    r.start()
    try:
        futs = [
            r.submit(
                Request(
                    f"r{i}",
                    p,
                    SamplingParams(max_new_tokens=N, temperature=1.0, ignore_eos=True, sampling_seed=i),
                )
            )
            for i, p in enumerate(PROMPTS)
        ]
        return [f.result(120) for f in futs]
    finally:
        r.stop()


def _micro_batch(outs):
    samples = []
    for p, c in zip(PROMPTS, outs, strict=True):
        ids = np.array(p + c.output_ids, dtype=np.int64)
        # target-aligned: position i predicts ids[i + 1]; the response starts after the prompt's last token
        mask = np.array([0] * (len(p) - 1) + [1] * len(c.output_ids) + [0], dtype=np.float32)
        samples.append(TrainSample(ids, mask, np.zeros(len(ids), np.float32), 0.0, 0.0, 1.0))
    return pack(samples)


def _trainer_model(path, bf16_params: bool):
    attention.register()
    dtype = torch.bfloat16 if bf16_params else torch.float32
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
    ).eval()


def test_fp32_heads_cut_the_trainer_engine_mismatch(tmp_path, one_thread):
    """Mean |trainer - engine| logprob of the engine's sampled tokens, pooled over SEEDS models, for each
    trainer mode and each (engine head, trainer head): fp32 on both sides is below bf16 on both. (With the
    trunk's own bf16 differences, one side's fp32 head alone need not help: bf16 heads round both sides'
    logits to the same grid.)"""
    diffs = {}  # (mode, engine fp32, trainer fp32) -> [per model]
    for seed in SEEDS:
        path = tmp_path / f"m{seed}"
        _model(path, seed)
        engine = {fp32: _engine(path, fp32) for fp32 in (False, True)}
        chunk = 5 if seed % 2 else 0  # the plain and the fused head in turn
        for mode in ("bf16_params", "autocast"):
            model = _trainer_model(path, bf16_params=mode == "bf16_params")
            for e_fp32, outs in engine.items():
                mb = _micro_batch(outs)
                behav = torch.cat([torch.tensor(c.output_logprobs) for c in outs])
                for t_fp32 in (False, True):
                    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
                        lp, _ = packed_logprobs(model, mb, 1.0, "none", chunk, False, t_fp32)
                    d = float((lp[mb.loss_mask > 0] - behav).abs().mean())
                    diffs.setdefault((mode, e_fp32, t_fp32), []).append(d)
    mean = {k: sum(v) / len(v) for k, v in diffs.items()}
    for mode in ("bf16_params", "autocast"):
        print(
            f"{mode}: mean |trainer - engine| logprob, bf16 heads {mean[(mode, False, False)]:.5f}, "
            f"engine fp32 only {mean[(mode, True, False)]:.5f}, trainer fp32 only "
            f"{mean[(mode, False, True)]:.5f}, both fp32 {mean[(mode, True, True)]:.5f}"
        )
        assert 0 < mean[(mode, True, True)] < mean[(mode, False, False)], mode


def _grad_batch(vocab: int):
    rng = np.random.default_rng(5)
    samples = []
    for n in (11, 7, 13):
        mask = (rng.random(n) > 0.3).astype(np.float32)
        mask[-1] = 0.0
        ids = rng.integers(3, vocab, size=n).astype(np.int64)
        samples.append(TrainSample(ids, mask, np.zeros(n, np.float32), 1.0, 1.0, 0.0))
    return pack(samples)


def _loss_and_grads(model, mb, chunk: int, fp32_head: bool):
    model.zero_grad()
    lp, ent = packed_logprobs(model, mb, 0.8, "grad", chunk, False, fp32_head)
    loss = ((lp - 0.01 * ent) * mb.loss_mask).sum()
    loss.backward()
    return lp.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("chunk", [0, 4])
def test_fp32_head_values_and_gradients_are_the_fp32_computation(chunk, autocast):
    """The head alone, bf16 hidden states: the fp32 head (plain: fp32_logits + log_softmax; fused:
    head_logprobs) gives the fp32 computation's logprobs and entropy, and its gradients rounded to the
    inputs' dtypes; the bf16 head is off by bf16 rounding. Under autocast the weight is an fp32 master
    and the head uses its bf16 rounding (what the engines hold)."""
    g = torch.Generator().manual_seed(0)
    k, h, v = 13, 32, 97
    hidden = (torch.randn(k, h, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    master = torch.randn(v, h, generator=g) * 2
    weight = (master if autocast else master.to(torch.bfloat16)).requires_grad_()
    targets = torch.randint(0, v, (k,), generator=g)
    gl, ge = torch.randn(k, generator=g), torch.randn(k, generator=g)

    def run(fp32: bool):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            if chunk:
                lp, ent = head_logprobs(hidden, weight, targets, 1.0, chunk, False, fp32)
            else:
                logits = fp32_logits(_Head(weight), hidden) if fp32 else hidden @ weight.t()
                logp = torch.log_softmax(logits.float(), -1)
                lp, ent = logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        (lp * gl + ent * ge).sum().backward()
        return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()

    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().to(torch.bfloat16).float().requires_grad_()
    logp = torch.log_softmax(h32 @ w32.t(), -1)
    ref_lp, ref_ent = logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (ref_lp * gl + ref_ent * ge).sum().backward()

    lp, ent, gh, gw = run(True)
    assert lp.dtype == torch.float32 and gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    ulp = 2**-7  # one bf16 rounding of the fp32 gradients
    torch.testing.assert_close(gh.float(), h32.grad, rtol=ulp, atol=1e-4)
    torch.testing.assert_close(gw.float(), w32.grad, rtol=ulp, atol=1e-4)
    bf16_lp = run(False)[0]
    ref_lp = ref_lp.detach()
    err, bf16_err = float((lp - ref_lp).abs().max()), float((bf16_lp - ref_lp).abs().max())
    print(
        f"chunk {chunk} autocast {autocast}: max |logprob - fp32| fp32 head {err:.2e}, bf16 head {bf16_err:.2e}"
    )
    assert bf16_err > 100 * err


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, None


@pytest.mark.parametrize("chunk", [0, 5])
def test_fp32_head_gradients_reach_the_tied_weight_like_an_fp32_model(tmp_path, one_thread, chunk):
    """A bf16 model whose LM head is tied to its embedding, with the fp32 head: logprobs and every
    gradient (the tied weight's, which sums the head's and the embedding's parts) match the fp32 model
    holding the same weights, within the bf16 trunk's rounding."""
    _model(tmp_path / "m", seed=3, layers=2)
    bf16 = _trainer_model(tmp_path / "m", bf16_params=True).train()
    ref = copy.deepcopy(bf16).float()
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight  # tied
    mb = _grad_batch(bf16.config.vocab_size)
    ref_lp, ref_g = _loss_and_grads(ref, mb, chunk, False)
    lp, g = _loss_and_grads(bf16, mb, chunk, True)
    tied = "model.embed_tokens.weight"
    assert ref_g[tied].abs().sum() > 0 and g.keys() == ref_g.keys()
    errs = {k: _rel_err(g[k], ref_g[k]) for k in ref_g}
    print(
        f"chunk {chunk}: relative gradient error vs the fp32 model: tied weight {errs[tied]:.4f}, "
        f"largest {max(errs.values()):.4f}"
    )
    assert errs[tied] < 0.05 and max(errs.values()) < 0.1
    # The head's part of the tied gradient is far above that tolerance: a head that dropped it would fail.
    head_part = ref_g[tied] - _embedding_only_grad(ref, mb)
    assert float(head_part.norm() / ref_g[tied].norm()) > 0.2


def _embedding_only_grad(model, mb) -> torch.Tensor:
    """The tied weight's gradient from its embedding use alone (the head's matmul on a detached copy)."""
    head = model.get_output_embeddings()

    def detached(module, hidden):
        return hidden @ module.weight.detach().t()

    from trainer import logprobs

    model.zero_grad()
    logits = logprobs._run_with_head_hook(model, head, mb, detached)[0] / 0.8
    logp = torch.log_softmax(logits.float(), -1)
    keep = mb.logit_index
    lp = mb.loss_mask.new_zeros(mb.num_tokens).index_copy(
        0, keep, logp.gather(-1, mb.targets[keep, None])[:, 0]
    )
    ent = mb.loss_mask.new_zeros(mb.num_tokens).index_copy(0, keep, -(logp.exp() * logp).sum(-1))
    ((lp - 0.01 * ent) * mb.loss_mask).sum().backward()
    return head.weight.grad.detach().float().clone()


@pytest.mark.parametrize("chunk", [0, 5])
def test_fp32_head_leaves_an_fp32_model_unchanged(tmp_path, chunk):
    _model(tmp_path / "m", seed=4)
    model = _trainer_model(tmp_path / "m", bf16_params=False).train()
    mb = _grad_batch(model.config.vocab_size)
    lp0, g0 = _loss_and_grads(model, mb, chunk, False)
    lp1, g1 = _loss_and_grads(model, mb, chunk, True)
    assert torch.equal(lp0, lp1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


def _fsdp_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Rank `rank` of an FSDP2 gloo group: the bf16-sharded model's fp32-head logprobs and gathered grads."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    from trainer.distributed import DistInfo, RankGroup, full_tensor, shard

    pool = RankGroup(DistInfo(rank, world, "127.0.0.1", port), torch.device("cpu"))
    model = _trainer_model(path, bf16_params=False).train()  # fp32 master weights, bf16 compute
    shard(model, mixed_precision=True, reshard_after_forward=True)
    mb = _grad_batch(model.config.vocab_size)
    for chunk in (0, 5):
        model.zero_grad()
        lp, ent = packed_logprobs(model, mb, 0.8, "grad", chunk, False, True)
        ((lp - 0.01 * ent) * mb.loss_mask).sum().backward()
        grads = {n: full_tensor(p.grad).float() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"lp": lp.detach().float(), "grads": grads}, os.path.join(out, f"fsdp-{chunk}.pt"))
    pool.close()


def test_fp32_head_under_fsdp2_bf16_matches_the_unsharded_bf16_model(tmp_path):
    """Two gloo ranks, FSDP2 with bf16 mixed precision on the tied model: the fp32 head reads the gathered
    bf16 weight inside the root's forward, and the reduced gradient of the sharded tied weight equals the
    unsharded bf16 model's (the same bf16 values) within bf16 rounding; and matches the fp32 model's."""
    path = tmp_path / "m"
    _model(path, seed=6, layers=2)
    start_ranks(_fsdp_worker, (2, free_port(), str(path), str(tmp_path)), 2)
    torch.set_num_threads(1)
    bf16 = _trainer_model(path, bf16_params=True).train()
    ref = _trainer_model(path, bf16_params=False).train()
    with torch.no_grad():  # the fp32 model with the bf16 compute copy's values
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    mb = _grad_batch(bf16.config.vocab_size)
    for chunk in (0, 5):
        got = torch.load(tmp_path / f"fsdp-{chunk}.pt")
        lp, g = _loss_and_grads(bf16, mb, chunk, True)
        ref_lp, ref_g = _loss_and_grads(ref, mb, chunk, False)
        torch.testing.assert_close(got["lp"], lp, rtol=0, atol=2e-2)
        tied = "model.embed_tokens.weight"
        assert got["grads"].keys() == g.keys()
        assert _rel_err(got["grads"][tied], g[tied]) < 0.02
        assert _rel_err(got["grads"][tied], ref_g[tied]) < 0.05
        assert max(_rel_err(got["grads"][k], ref_g[k]) for k in g) < 0.05
