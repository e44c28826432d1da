"""LoRA in the built-in engine's forward: logits with an adapter equal PEFT's on the same weights, rows of
the base model and of other adapters in the same batch are unaffected, and the bank loads, replaces and
unloads adapters by PEFT's saved names."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_engine_model import build_noisy_model

from generator_fleet.engine.kv_cache import PagedKVCache
from generator_fleet.engine.lora import LoraBank, LoraError
from generator_fleet.engine.model import DecodeInputs, PagedForward
from models.config import LoraSpec

peft = pytest.importorskip("peft")

TOL = 3e-4
"""fp32: the engine's packed forward and PEFT's differ only in summation order, which depends on the CPU's
kernels: up to 1.3e-4 on logits of magnitude ~16 on one x86 box (an adapter's own effect is > 0.1)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model, tok = build_noisy_model(tmp_path_factory.mktemp("lora_model"), seed=3)
    return model.float(), tok


def make_adapter(model, spec: LoraSpec, seed: int):
    """A PEFT model over a copy of `model` with random (nonzero) A and B; returns it and its saved
    state dict (PEFT's wire names)."""
    pm = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(**{k: v for k, v in spec.peft_config().items() if k not in ("peft_type",)}),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    pm.eval()
    return pm, peft.get_peft_model_state_dict(pm)


def engine(model, spec: LoraSpec | None, max_loras: int = 2, device: str = "cpu"):
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = PagedKVCache(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        num_blocks=64,
        block_size=16,
        dtype=torch.float32,
        device=torch.device(device),
    )
    fwd = PagedForward(model, cache, context_length=256)
    if spec is not None:
        fwd.lora = LoraBank(spec, cfg, max_loras, torch.device(device), torch.float32)
    return fwd


def prefill_last_logits(fwd: PagedForward, seqs, lora_slots=None):
    total = sum(len(s) for s in seqs)
    dev = fwd.cache.device
    slots = torch.arange(16, 16 + total, device=dev)
    with torch.no_grad():
        h = fwd.prefill(seqs, slots, lora_slots)
        ends = torch.tensor([len(s) for s in seqs], device=dev).cumsum(0) - 1
        return fwd.logits(h[ends]).float().cpu(), slots


def ref_logits(model, seqs):
    with torch.no_grad():
        return torch.stack([model(torch.tensor([s])).logits[0, -1].float() for s in seqs])


SEQS = [[1, 5, 7, 9, 3], [2, 4, 6], [8, 8, 1, 2, 3, 4, 5, 6, 7], [3, 1]]


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_and_decode_match_peft_mixed_with_base_and_other_adapter(base, device):
    """On CUDA too: eager decode with the adapters (fused q/k/v and gate/up GEMMs with the deltas added
    to their slices, the Triton paged attention)."""
    model, _ = base
    tol = TOL if device == "cpu" else 1e-3
    spec = LoraSpec(
        rank=8,
        alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    pa, sa = make_adapter(model, spec, seed=1)
    small = LoraSpec(rank=4, alpha=4, target_modules=["q_proj", "down_proj"], name="other")
    pb, sb = make_adapter(model, small, seed=2)
    fwd = engine(copy.deepcopy(model).to(device), spec, device=device)
    fwd.lora.load("policy", spec.peft_config(), sa)
    fwd.lora.load("other", small.peft_config(), sb)
    rows = [fwd.lora.slot_of(n) for n in ("policy", None, "other", "policy")]
    got, _ = prefill_last_logits(fwd, SEQS, rows)
    want = torch.cat(
        [
            ref_logits(pa, SEQS[:1]),
            ref_logits(model, SEQS[1:2]),
            ref_logits(pb, SEQS[2:3]),
            ref_logits(pa, SEQS[3:]),
        ]
    )
    assert (got - want).abs().max() < tol
    # the adapter really changes the outputs (else the comparison above proves nothing)
    assert (ref_logits(pa, SEQS[:1]) - ref_logits(model, SEQS[:1])).abs().max() > 0.1
    # merged weights give the same greedy tokens
    merged = copy.deepcopy(pa).merge_and_unload()
    assert got[0].argmax() == ref_logits(merged, SEQS[:1])[0].argmax()

    # decode one more token per sequence: re-prefill into two blocks per sequence, then one step
    nxt = got.argmax(-1).tolist()
    lens = [len(s) for s in SEQS]
    bs = fwd.cache.block_size
    tables, slot_rows = [], []
    for i, s in enumerate(SEQS):
        blocks = [1 + 2 * i, 2 + 2 * i]
        tables.append(blocks)
        slot_rows.append([blocks[p // bs] * bs + p % bs for p in range(len(s) + 1)])
    flat_slots = torch.tensor([x for i, s in enumerate(SEQS) for x in slot_rows[i][: len(s)]], device=device)
    with torch.no_grad():
        fwd.prefill(SEQS, flat_slots, rows)
        x = DecodeInputs(
            input_ids=torch.tensor(nxt, device=device),
            positions=torch.tensor(lens, device=device),
            slots=torch.tensor([r[-1] for r in slot_rows], device=device),
            block_tables=torch.tensor(tables, device=device),
            seq_lens=torch.tensor(lens, device=device) + 1,
        )
        dec = fwd.decode(x, rows).cpu()
    refs = [pa, model, pb, pa]
    want2 = torch.cat([ref_logits(m, [s + [t]]) for m, s, t in zip(refs, SEQS, nxt, strict=True)])
    assert (dec - want2).abs().max() < tol


def test_replace_unload_and_errors(base):
    model, _ = base
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    p1, s1 = make_adapter(model, spec, seed=5)
    p2, s2 = make_adapter(model, spec, seed=6)
    fwd = engine(model, spec, max_loras=1)
    slot = fwd.lora.load("policy", spec.peft_config(), s1)
    got, _ = prefill_last_logits(fwd, SEQS[:2], [slot, slot])
    assert (got - ref_logits(p1, SEQS[:2])).abs().max() < TOL
    assert fwd.lora.load("policy", spec.peft_config(), s2) == slot  # replaced in place
    got, _ = prefill_last_logits(fwd, SEQS[:2], [slot, slot])
    assert (got - ref_logits(p2, SEQS[:2])).abs().max() < TOL
    with pytest.raises(LoraError, match="slots are in use"):
        fwd.lora.load("second", spec.peft_config(), s1)
    fwd.lora.unload("policy")
    with pytest.raises(LoraError, match="not loaded"):
        fwd.lora.slot_of("policy")
    got, _ = prefill_last_logits(fwd, SEQS[:2], [-1, -1])
    assert (got - ref_logits(model, SEQS[:2])).abs().max() < TOL
    big = LoraSpec(rank=8, alpha=8, target_modules=["q_proj"])
    _, sbig = make_adapter(model, big, seed=7)
    with pytest.raises(LoraError, match="exceeds"):
        fwd.lora.load("big", big.peft_config(), sbig)
    wide = LoraSpec(rank=4, alpha=8, target_modules=["up_proj"])
    _, sw = make_adapter(model, wide, seed=8)
    with pytest.raises(LoraError, match="not among"):
        fwd.lora.load("wide", wide.peft_config(), sw)
    assert fwd.lora.names == {}


def test_no_adapter_bank_leaves_forward_unchanged(base):
    model, _ = base
    got, _ = prefill_last_logits(engine(model, None), SEQS)
    assert (got - ref_logits(model, SEQS)).abs().max() < TOL
