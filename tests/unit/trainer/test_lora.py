"""LoRA training on one CPU rank: PEFT's adapter on the policy, only the adapter trains (the base stays
bit-identical), the gradients and loss of a step equal a plain float64 PEFT model's, and the adapter tensors
for the bus carry PEFT's saved names and shapes."""

from __future__ import annotations

import msgspec
import pytest
import torch
from oracles import build_batch, policy_loss, token_logprobs
from test_minibatch import _groups, _learner, _train
from transformers import AutoModelForCausalLM

import jobspec
from models.config import LoraSpec
from trainer.lora import wrap_lora

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _lora_spec(d: dict, lora: dict):
    """A job spec with `model.lora` set on its model section."""
    spec = jobspec.from_dict(d)
    spec.model.lora = msgspec.convert(lora, LoraSpec)
    return spec


def _spec(model_dir, loss: str = "ppo"):
    return _lora_spec(
        {
            "model": {"path": str(model_dir)},
            "algorithm": {"lr": 2e-2, "clip_eps": 0.05, "groups_per_step": 4, "loss": loss},
            "rollout": {"group_size": 3},
            "trainer": {"fsdp": False, "micro_batch_tokens": 24, "logprob_chunk_tokens": 16},
        },
        LORA,
    )


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_only_the_adapter_trains_and_matches_a_plain_peft_model(tiny_model_dir, loss):
    spec = _spec(tiny_model_dir, loss)
    ln = _learner(spec)
    named = dict(ln.model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert ln.adapter_bytes == sum(named[n].numel() * 4 for n in trainable)  # counted in fp32 at setup
    opt_params = {id(p) for g in ln.opt.param_groups for p in g["params"]}
    assert opt_params == {id(named[n]) for n in trainable}
    base_before = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    groups = _groups(base, noise=0.3)
    stats, seen, _ = _train(ln, spec, groups)
    assert stats["optimizer_steps"] == 1 and len(seen) == 1

    for n, p in ln.model.named_parameters():
        if ".lora_B." in n:
            assert not torch.equal(p.detach(), seen[0][0][trainable.index(n)]), n  # the adapter moved
        elif p.requires_grad:  # B = 0 at the first step: A's gradient B^T dY is zero
            assert not seen[0][1][trainable.index(n)].any(), n
        else:
            assert torch.equal(p.detach(), base_before[n]), n  # the base is bit-identical
    # B starts at zero: the untrained adapter is the base model
    for n, w in zip(trainable, seen[0][0], strict=True):
        if ".lora_B." in n:
            assert not w.any(), n

    # The oracle: a plain PEFT model (no FSDP, float64) at the step's starting adapter weights.
    ref = wrap_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64), spec.model.lora
    )
    ref_trainable = [p for p in ref.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, w in zip(ref_trainable, seen[0][0], strict=True):
            p.copy_(w)
    ref.eval()  # dropout 0: eval changes nothing but makes the intent clear
    alg = spec.algorithm
    batch = build_batch(groups, pad_id=0)
    with torch.no_grad():
        prox = token_logprobs(ref, batch.input_ids, batch.attention_mask)
    logp = token_logprobs(ref, batch.input_ids, batch.attention_mask)
    want, _ = policy_loss(
        logp,
        prox,
        batch.behav_logprobs.to(logp.dtype),
        batch.advantages.to(logp.dtype),
        batch.loss_mask,
        alg.loss,
        alg.clip_eps,
        alg.is_cap,
        alg.loss_agg,
        alg.dual_clip_c,
        clip_eps_low=alg.clip_eps_low,
        clip_eps_high=alg.clip_eps_high,
    )
    want.backward()
    assert ln.update_stats[0]["loss"] == pytest.approx(float(want), rel=1e-6, abs=3e-7)
    grads = [p.grad for p in ref_trainable]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    assert ln.update_stats[0]["grad_norm"] == pytest.approx(norm, rel=1e-6)
    coef = min(1.0, alg.max_grad_norm / (norm + 1e-6))
    for g, w in zip(seen[0][1], grads, strict=True):
        torch.testing.assert_close(g, w * coef, rtol=1e-6, atol=1e-6 * float(w.abs().max()) * coef)


def test_adapter_tensors_have_peft_saved_names(tiny_model_dir):
    from peft import get_peft_model_state_dict

    ln = _learner(_spec(tiny_model_dir))
    mine = dict(ln.adapter_tensors())
    want = get_peft_model_state_dict(ln.model)
    assert sorted(mine) == sorted(want)
    for n, t in mine.items():
        assert torch.equal(t, want[n]), n
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cfg = ln.config
    assert mine[name].shape == (4, cfg.hidden_size)
    assert mine[name.replace("lora_A", "lora_B")].shape[1] == 4
    assert {n.split(".")[6] for n in mine} == {"q_proj", "v_proj", "down_proj"}


def test_full_fine_tuning_has_no_adapter(tiny_model_dir):
    spec = _spec(tiny_model_dir)
    spec.model.lora = None
    ln = _learner(spec)
    assert ln.adapter_bytes == 0
    assert all(p.requires_grad for p in ln.model.parameters())
    with pytest.raises(ValueError, match="model.lora"):
        next(ln.adapter_tensors())


def test_dropout_trains_but_logprob_only_passes_do_not_drop(tiny_model_dir):
    from prometheus_client import REGISTRY

    spec = _lora_spec(
        {
            "model": {"path": str(tiny_model_dir)},
            "algorithm": {"lr": 2e-2, "groups_per_step": 4, "ppo_minibatches": 2},
            "rollout": {"group_size": 3},
            "trainer": {"fsdp": False, "micro_batch_tokens": 24, "logprob_chunk_tokens": 16},
        },
        LORA | {"dropout": 0.5},
    )
    ln = _learner(spec)
    params = sum(p.numel() for p in ln.model.parameters() if p.requires_grad)
    assert REGISTRY.get_sample_value("slipstream_trainer_lora_trainable_params") == params
    assert REGISTRY.get_sample_value("slipstream_trainer_lora_adapter_bytes") == ln.adapter_bytes
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    groups = _groups(base, noise=0.3)
    _train(ln, spec, groups)  # B != 0 now: dropout changes the adapted outputs
    from trainer.batch import build_samples, loss_aggregation

    alg = spec.algorithm
    samples = build_samples(
        groups, alg.advantage, *loss_aggregation(alg, spec.trainer_config().response_budget)
    )
    mbs = ln.distribute(samples)
    head = (ln.trainer.logprob_chunk_tokens, False)
    _, a = ln._prox(mbs, False, head)
    _, b = ln._prox(mbs, False, head)
    assert ln.model.training  # back in training mode
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)  # no dropout: deterministic


def test_export_writes_the_base_and_a_peft_adapter_with_the_trainers_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from trainer import checkpoint

    spec = _spec(tiny_model_dir)
    ln = _learner(spec)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    _train(ln, spec, _groups(base, noise=0.3))  # B != 0: the adapter changes the logits
    ln.model.float()
    out = checkpoint.export_hf(ln, tmp_path / "hf")
    assert (out / "adapter" / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for n, p in base.named_parameters():  # the exported base is the frozen base
        torch.testing.assert_close(dict(loaded.named_parameters())[n].double(), p, rtol=0, atol=0, msg=n)
    peft_model = PeftModel.from_pretrained(loaded, out / "adapter").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    ln.model.eval()
    with torch.no_grad():
        want = ln.model(input_ids=ids).logits
        got = peft_model(input_ids=ids).logits
        plain = base.float()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, want, atol=1e-4)  # the adapter is in the comparison
