"""The tiny model the engine tests serve, and the reference decoding its output must equal."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from generator_fleet.tasks.arith import ALPHABET, ArithTask
from model_zoo.tiny import build, save

NOISE_STD = 0.5


def build_noisy_model(path: Path, seed: int):
    """A tiny model with large random weights: a freshly initialised one (tied embeddings, std 0.02) just
    echoes its last token, which would make greedy outputs and weight swaps indistinguishable."""
    corpus = [f"{p.prompt}{p.answer}" for p in ArithTask().problems]
    model, tok = build(path, ALPHABET, corpus, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * NOISE_STD)
    save(path, model, tok)
    return model.eval(), tok


def greedy_params(n: int, **kw):
    """The engine's sampling params of greedy decoding for `n` tokens, EOS ignored (the reference's)."""
    from generator_fleet.engine.request import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


_decoded: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, list[int]]] = weakref.WeakKeyDictionary()
"""Per model: (its weights' version, prompt) -> the longest greedy decoding computed so far."""


def greedy_reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding without a cache or batching: what the engine must reproduce.

    Each token is a forward pass over the whole sequence so far (quadratic), so decodings are kept per
    model and prompt and a shorter one is the prefix of a longer one. The key holds the sum of the
    parameters' in-place version counters: a model changed in place (add_, copy_, load_state_dict) is
    decoded anew."""
    key = (sum(p._version for p in model.parameters()), tuple(prompt))
    memo = _decoded.setdefault(model, {})
    ids = list(prompt) + memo.get(key, [])
    with torch.no_grad():
        while len(ids) - len(prompt) < n:
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    out = ids[len(prompt) :]
    if len(out) > len(memo.get(key, [])):
        memo[key] = out
    return out[:n]
