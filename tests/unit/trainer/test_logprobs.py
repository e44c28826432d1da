"""The fused, chunked LM head (head_logprobs) equals the plain unchunked log-softmax: logprobs, entropy,
loss and gradients wrt hidden states and head weight, across chunk boundaries, tied and untied heads."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainer import attention
from trainer.logprobs import head_logprobs, packed_logprobs
from trainer.packing import TrainSample, pack


def _plain(hidden, weight, targets, temperature):
    z = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 7, 50])  # 7 does not divide K = 17; 50 > K is one chunk
def test_head_logprobs_equal_plain_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    k, h, v = 17, 8, 23
    hidden = torch.randn(k, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (k,), generator=g)
    c_lp, c_ent = torch.randn(k, generator=g), torch.randn(k, generator=g)

    lp, ent = head_logprobs(hidden, weight, targets, 0.7, chunk)
    ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
    got = lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()

    hidden.grad = weight.grad = None
    lp, ent = _plain(hidden, weight, targets, 0.7)
    ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
    want = lp.detach(), ent.detach(), hidden.grad, weight.grad
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # grads of ~10: fp32 rounding


def test_head_logprobs_gradcheck_float64_logprob_only_and_with_entropy():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (9,), generator=g)
    assert torch.autograd.gradcheck(lambda x, w: head_logprobs(x, w, targets, 1.3, 4), (hidden, weight))
    assert torch.autograd.gradcheck(lambda x, w: head_logprobs(x, w, targets, 1.0, 4)[0], (hidden, weight))


def _model(tied: bool):
    cfg = Qwen2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    attention.register()
    return AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=attention.ATTN_IMPLEMENTATION
    )


@pytest.mark.parametrize("tied", [True, False])
def test_packed_chunked_loss_and_gradients_equal_plain(tied):
    """A packed micro-batch with an entropy bonus: the chunked head (chunks of 5 over ~25 trained
    positions, boundaries inside samples) gives the plain path's logprobs, entropy, loss and every
    parameter's gradient, the head weight (tied to the embedding or not) included."""
    model = _model(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    rng = np.random.default_rng(3)
    samples = []
    for n in (9, 14, 6, 12):
        mask = (rng.random(n) > 0.3).astype(np.float32)
        mask[-1] = 0.0
        ids = rng.integers(3, 61, size=n).astype(np.int64)
        samples.append(TrainSample(ids, mask, (-rng.random(n) * mask).astype(np.float32), 0.5, 0.1, 0.0))
    mb = pack(samples)
    params = dict(model.named_parameters())
    runs = []
    for chunk in (0, 5):
        model.zero_grad()
        lp, ent = packed_logprobs(model, mb, temperature=0.7, entropy="grad", chunk_tokens=chunk)
        loss = ((lp * mb.advantages - 0.01 * ent) * mb.token_weights).sum()
        loss.backward()
        runs.append(
            (lp.detach(), ent.detach(), loss.detach(), {k: p.grad.clone() for k, p in params.items()})
        )
    (lp0, ent0, loss0, g0), (lp1, ent1, loss1, g1) = runs
    assert int((mb.loss_mask > 0).sum()) > 10
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-7)
    assert g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-7, msg=k)

    with torch.no_grad():  # a reference model's pass: no entropy, no graph
        lp_ng, ent_ng = packed_logprobs(model, mb, temperature=0.7, entropy="none", chunk_tokens=5)
    assert ent_ng is None and not lp_ng.requires_grad
    torch.testing.assert_close(lp_ng, lp0, rtol=1e-5, atol=1e-6)
