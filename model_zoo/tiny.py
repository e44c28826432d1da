"""A tiny Qwen2-architecture causal LM and a tokenizer trained on the fly: no downloads, a few seconds on CPU.

Used by the demo, the tests and CPU benchmarks. The tokenizer is a real HF fast tokenizer (BPE trained
with `tokenizers` on the task's alphabet), saved next to the model so engines and trainers load the
directory with AutoTokenizer/AutoModelForCausalLM like any checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = [PAD, BOS, EOS]


def build_tokenizer(alphabet: str, corpus: list[str]) -> PreTrainedTokenizerFast:
    """Character-level BPE (vocab = specials + alphabet, so no merges): digits stay single tokens,
    which is what lets a tiny model learn arithmetic."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + len(alphabet), special_tokens=SPECIALS, initial_alphabet=list(alphabet)
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.chat_template = None
    return fast


def tiny_config(vocab_size: int, hidden: int = 128, layers: int = 2, heads: int = 4, **kw) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        **kw,
    )


def build(path: str | Path, alphabet: str, corpus: list[str], seed: int = 0, **config_kw):
    """Create tokenizer + randomly initialised model, save both to `path`, return (model, tokenizer)."""
    tokenizer = build_tokenizer(alphabet, corpus)
    cfg = tiny_config(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_kw,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    save(path, model, tokenizer)
    return model, tokenizer


def save(path: str | Path, model, tokenizer) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    log.info("saved model (%d params) to %s", sum(p.numel() for p in model.parameters()), path)


def load(path: str | Path, device: str = "cpu"):
    """(model, tokenizer) from an HF directory, fp32, eval mode."""
    from models.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return model, tokenizer
